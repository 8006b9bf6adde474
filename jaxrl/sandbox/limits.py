"""What one sandboxed run may use, and what it gives back. Standard library only."""

from __future__ import annotations

import math
from dataclasses import dataclass

# the names a SandboxResult.limit can take
LIMITS = ("wall_time", "cpu_time", "memory", "processes", "output")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run (one program, one stdin).

    Attributes:
        wall_s: seconds of wall-clock time, from start to the kill (> 0).
        cpu_s: seconds of CPU time of the program's process (``RLIMIT_CPU``, rounded up to whole seconds; > 0).
        memory_mb: address space of each process in MiB (``RLIMIT_AS``; verl's ``memory_limit_mb`` means the same).
        max_processes: processes and threads the program may have at once (``RLIMIT_NPROC``, counted inside the
            sandbox's own user; >= 1).
        max_output_bytes: stdout + stderr together; the run is killed past it (>= 1).
        tmp_mb: size of the writable ``/tmp`` (a fresh tmpfs; also the largest file, ``RLIMIT_FSIZE``).

    Raises:
        ValueError: a value out of range (one line naming it).
    """

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_output_bytes: int = 4 << 20
    tmp_mb: int = 64

    def __post_init__(self):
        for name in ("wall_s", "cpu_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"sandbox limit {name}={v!r} is not valid; use a number of seconds > 0")
        for name, lo in (("memory_mb", 16), ("max_processes", 1), ("max_output_bytes", 1), ("tmp_mb", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"sandbox limit {name}={v!r} is not valid; use an int >= {lo}")

    @property
    def cpu_rlimit(self) -> int:
        """``RLIMIT_CPU`` soft limit in whole seconds (SIGXCPU there, SIGKILL one second later)."""
        return max(1, math.ceil(self.cpu_s))


@dataclass
class SandboxResult:
    """What one run gave.

    Attributes:
        stdout: the program's standard output (UTF-8, undecodable bytes replaced; at most ``max_output_bytes``).
        stderr: its standard error (same).
        exit_code: the program's exit status, or None when it was ended by a signal (see ``signal``) or by
            a limit the sandbox enforced itself (wall time, output size) or never ran (``error``).
        signal: the signal that ended the program, or None.
        limit: the limit it hit, one of :data:`LIMITS`, or None. ``wall_time`` and ``output`` are exact (the
            sandbox killed it); ``cpu_time`` is the program dying of SIGXCPU; ``memory`` and ``processes`` are
            read from how it failed (a ``MemoryError`` resp. a ``fork``/thread start refused for lack of
            resources, in its stderr).
        seconds: wall time of the run.
        backend: ``"bwrap"`` (isolated), ``"none"`` (unisolated, trusted code only) or ``"fusion"`` (a Sandbox
            Fusion server).
        error: set when the sandbox itself failed (it could not start, a Sandbox Fusion server did not answer):
            the program's outcome is unknown, never a verdict on the code.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    limit: str | None = None
    seconds: float = 0.0
    backend: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited 0 within every limit."""
        return self.error is None and self.limit is None and self.exit_code == 0

    @property
    def status(self) -> str:
        """``"ok"``, ``"failed"`` (non-zero exit or a signal), ``"limit:<name>"`` or ``"sandbox_error"``."""
        if self.error is not None:
            return "sandbox_error"
        if self.limit is not None:
            return f"limit:{self.limit}"
        return "ok" if self.exit_code == 0 else "failed"
