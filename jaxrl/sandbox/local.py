"""Run a Python program on this machine: in bubblewrap (``isolation="bwrap"``, the default) or, only when asked
for, unisolated (``isolation="none"``: trusted code only). Standard library only.

:class:`LocalSandbox` is what rewards and tools hold (picklable: it crosses into reward scoring processes);
:func:`run_code` is the one-call form.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from jaxrl.sandbox import bwrap as bw
from jaxrl.sandbox import process
from jaxrl.sandbox.limits import Limits, SandboxResult

logger = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "none")
UNISOLATED_WARNING = (
    "UNISOLATED CODE EXECUTION (sandbox isolation=none): programs run as this user (uid %d), with this machine's "
    "network and files; only CPU, memory, output and wall-time limits apply (and, unless run as root, a process "
    "limit). Use this only for code you trust."
)
_warned = False


def sandbox_env(home: str, python: str) -> dict[str, str]:
    """The program's whole environment. ``PYTHONPATH`` holds this interpreter's site-packages when ``python`` is
    this interpreter: programs run with ``-S`` (no ``site`` import: ~100 ms less per run, no ``.pth`` hooks such
    as editable installs' finders) and still import the installed packages."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        import site

        dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
        if dirs:
            env["PYTHONPATH"] = os.pathsep.join(dirs)
    return env


def program_argv(python: str, main: str) -> list[str]:
    """How the program is run: no ``site`` import, no user site-packages, unbuffered-stdio defaults kept."""
    return [python, "-S", "-s", main]


def run_isolated(code: str, stdin: str, limits: Limits, *, bwrap: str, python: str) -> SandboxResult:
    """Run ``code`` with ``python`` inside bubblewrap (:mod:`jaxrl.sandbox.bwrap`); no probe, no checks."""
    code_r, code_w = os.pipe()
    try:
        data = code.encode("utf-8", errors="surrogateescape")
        if len(data) > 60000:  # more than a pipe buffer: write from a file instead
            os.close(code_w)
            os.close(code_r)
            f = tempfile.TemporaryFile()
            f.write(data)
            f.seek(0)
            code_r, code_w = os.dup(f.fileno()), -1
            f.close()
        else:
            os.write(code_w, data)
            os.close(code_w)
        as_root = os.geteuid() == 0
        spec = process.LaunchSpec(
            prefix=bw.bwrap_prefix(bwrap, python, tmp_mb=limits.tmp_mb, code_fd=code_r, as_root=as_root),
            python=python, argv=program_argv(python, f"{bw.WORKDIR}/main.py"), env=sandbox_env(bw.WORKDIR, python),
            uid=process.random_uid() if as_root else None, pass_fds=(code_r,), backend="bwrap",
        )
        return process.run(spec, stdin, limits)
    finally:
        os.close(code_r)


def run_unisolated(code: str, stdin: str, limits: Limits, *, python: str) -> SandboxResult:
    """Run ``code`` with ``python`` in a fresh temp directory (removed after), no isolation; see
    :data:`UNISOLATED_WARNING`. The program leads its own process group, which is killed at the end."""
    work = tempfile.mkdtemp(prefix="jaxrl-unisolated-")
    try:
        main = os.path.join(work, "main.py")
        with open(main, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(code)
        spec = process.LaunchSpec(
            prefix=[], python=python, argv=program_argv(python, main), env=sandbox_env(work, python), uid=None,
            cwd=work, backend="none",
        )
        return process.run(spec, stdin, limits)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class LocalSandbox:
    """Runs Python programs on this machine.

    Attributes:
        isolation: ``"bwrap"`` (bubblewrap; refuses to run when it does not work here) or ``"none"`` (no
            isolation, trusted code only; logged loudly on first use).
        python: the interpreter; None = the one running this process.
    """

    isolation: str = "bwrap"
    python: str | None = None

    def __post_init__(self):
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation={self.isolation!r} is not valid; use one of {ISOLATIONS}")

    @property
    def backend(self) -> str:
        return self.isolation

    def check(self) -> None:
        """Fail now if programs cannot run: bubblewrap missing or unable to create the sandbox here.

        Raises:
            SandboxUnavailableError: see :func:`jaxrl.sandbox.bwrap.check_bwrap`.
        """
        if self.isolation == "bwrap":
            bw.check_bwrap(self._python())
        else:
            _warn_unisolated()

    def run_code(self, code: str, stdin: str = "", limits: Limits | None = None) -> SandboxResult:
        """Run the Python program ``code`` with ``stdin`` on its standard input.

        Args:
            code: the program's source (UTF-8), run as ``/tmp/main.py`` (``__name__ == "__main__"``).
            stdin: its standard input.
            limits: the run's limits (default :class:`Limits`).

        Returns:
            A :class:`SandboxResult`; a program that fails or hits a limit is a result, not an exception.

        Raises:
            SandboxUnavailableError: ``isolation="bwrap"`` and bubblewrap does not work here.
        """
        limits = limits or Limits()
        python = self._python()
        if self.isolation == "none":
            _warn_unisolated()
            return run_unisolated(code, stdin, limits, python=python)
        return run_isolated(code, stdin, limits, bwrap=bw.check_bwrap(python), python=python)

    def _python(self) -> str:
        return os.path.realpath(self.python or sys.executable)


def _warn_unisolated() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(UNISOLATED_WARNING, os.getuid())
        print("jaxrl: WARNING: " + UNISOLATED_WARNING % os.getuid(), file=sys.stderr, flush=True)


def run_code(code: str, stdin: str = "", limits: Limits | None = None, *, isolation: str = "bwrap") -> SandboxResult:
    """``LocalSandbox(isolation).run_code(code, stdin, limits)``: run one Python program (see
    :meth:`LocalSandbox.run_code`).

    Raises:
        SandboxUnavailableError: ``isolation="bwrap"`` and bubblewrap does not work here.
        ValueError: an unknown ``isolation``.
    """
    return LocalSandbox(isolation).run_code(code, stdin, limits)
