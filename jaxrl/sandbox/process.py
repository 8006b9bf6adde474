"""Start one sandboxed program, feed it stdin, collect its output under the wall-time and output limits, and say
which limit it hit. Standard library only.

The program is started through a small *launcher* (``python -S -c LAUNCHER``) that runs where the program will
run (inside bubblewrap, or in the temp dir when unisolated): it leaves uid 0 for an unprivileged uid when it was
started as root (the kernel never applies ``RLIMIT_NPROC`` to uid 0), sets the resource limits (``RLIMIT_AS``,
``RLIMIT_CPU``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE``) and ``exec``\\ s the
interpreter on the program. Setting the limits there, not in a ``preexec_fn`` of this process, keeps this module
safe to call from threads, and counts ``RLIMIT_NPROC`` inside bubblewrap's own user namespace (so concurrent
sandboxes and the caller's own threads do not share the budget). The launcher reports on a status pipe (closed
on ``exec``): one NUL byte just before ``exec``, or its error text; nothing at all means the launcher never ran
(bubblewrap could not set the sandbox up).
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from jaxrl.sandbox.limits import Limits, SandboxResult

LAUNCH_OK = b"\0"
FIRST_UNPRIVILEGED_UID = 1 << 20  # random uids for root-started runs are drawn above this
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the process to be reaped
DRAIN_S = 0.2  # once the outer process exited: how long its pipes may stay open
NOFILE = 256  # open files per process

# Runs with -S (no site import), so it starts in ~10 ms; its argv[1] is the JSON of _LaunchSpec.
LAUNCHER = """\
import json, os, resource, sys
spec = json.loads(sys.argv[1])
status = spec["status_fd"]
os.set_inheritable(status, False)
try:
    uid = spec["uid"]
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for name, soft, hard in spec["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.write(status, b"\\0")
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
except BaseException as e:
    os.write(status, ("%s: %s" % (type(e).__name__, e)).encode())
    os._exit(127)
"""


@dataclass
class LaunchSpec:
    """How to start one program.

    Attributes:
        prefix: the argv before the launcher (bubblewrap and its options; empty when unisolated).
        python: the interpreter that runs the launcher and the program (a path valid where they run).
        argv: the program's argv (see :func:`jaxrl.sandbox.local.program_argv`).
        env: the program's whole environment.
        uid: the uid the launcher switches to when it starts as root, or None to stay.
        cwd: working directory of the outer process (the temp dir when unisolated; None for bwrap).
        pass_fds: extra descriptors the outer process needs (bubblewrap's ``--file`` sources).
        backend: ``"bwrap"`` or ``"none"``.
    """

    prefix: list[str]
    python: str
    argv: list[str]
    env: dict[str, str]
    uid: int | None
    cwd: str | None = None
    pass_fds: tuple[int, ...] = ()
    backend: str = "bwrap"


def random_uid() -> int:
    """An unused-looking unprivileged uid for one root-started run (its own ``RLIMIT_NPROC`` count)."""
    return FIRST_UNPRIVILEGED_UID + secrets.randbelow(1 << 30)


def rlimits(limits: Limits) -> list[tuple[str, int, int]]:
    """``(RLIMIT name, soft, hard)`` for :data:`LAUNCHER`."""
    mem = limits.memory_mb << 20
    fsize = limits.tmp_mb << 20
    return [
        ("RLIMIT_AS", mem, mem),
        ("RLIMIT_CPU", limits.cpu_rlimit, limits.cpu_rlimit + 1),
        ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
        ("RLIMIT_FSIZE", fsize, fsize),
        ("RLIMIT_NOFILE", NOFILE, NOFILE),
        ("RLIMIT_CORE", 0, 0),
    ]


def _stdin_file(stdin: str):
    """A file holding ``stdin`` (read from its start), so a program that never reads cannot block the writer."""
    import tempfile

    f = tempfile.TemporaryFile()
    f.write(stdin.encode("utf-8", errors="surrogateescape"))
    f.seek(0)
    return f


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the outer process's group (it leads one, and is not reaped yet, so the id is still its own) and
    reap the outer process."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass


def run(spec: LaunchSpec, stdin: str, limits: Limits) -> SandboxResult:
    """Run the program of ``spec`` under ``limits``; see the module docstring.

    Returns:
        The :class:`SandboxResult` (``error`` set when the sandbox could not start the program).
    """
    status_r, status_w = os.pipe()
    launch = {"status_fd": status_w, "uid": spec.uid, "rlimits": rlimits(limits), "argv": spec.argv,
              "env": spec.env}
    cmd = [*spec.prefix, spec.python, "-S", "-c", LAUNCHER, json.dumps(launch)]
    t0 = time.monotonic()
    with _stdin_file(stdin) as fin:
        try:
            proc = subprocess.Popen(
                cmd, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=spec.cwd, env=spec.env,
                pass_fds=(status_w, *spec.pass_fds), process_group=0, close_fds=True,
            )
        except OSError as e:
            os.close(status_r)
            return SandboxResult(backend=spec.backend, error=f"could not start {cmd[0]}: {e}")
        finally:
            os.close(status_w)
        try:
            out, err, status, killed_for = _collect(proc, status_r, limits, t0)
        finally:
            _kill_group(proc)  # also what is left in its group (the unisolated program's children)
    seconds = time.monotonic() - t0
    rc = proc.returncode
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    if killed_for is None and status != LAUNCH_OK:
        if status:
            why = "the sandbox launcher failed: " + status.decode("utf-8", errors="replace")
        else:
            why = f"the sandbox did not start (exit status {rc}): {stderr.strip()[-500:] or 'no message'}"
        return SandboxResult(stdout=stdout, stderr=stderr, seconds=seconds, backend=spec.backend, error=why)
    exit_code, sig = (None, None) if killed_for is not None else _decode_status(rc, spec.backend)
    return SandboxResult(
        stdout=stdout, stderr=stderr, exit_code=exit_code, signal=sig, seconds=seconds, backend=spec.backend,
        limit=killed_for or limit_from_failure(exit_code, sig, stderr),
    )


def _collect(proc: subprocess.Popen, status_r: int, limits: Limits, t0: float):
    """Read stdout, stderr and the status pipe until the outer process has exited and they are closed (or
    :data:`DRAIN_S` after it exited: a left-behind child of an unisolated program may hold them), the wall time
    passes or the output is too big. The outer process is left unreaped (its exit is seen on a pidfd).

    Returns:
        ``(stdout bytes, stderr bytes, status bytes, killed_for)`` with ``killed_for`` ``"wall_time"``,
        ``"output"`` or None.
    """
    out_fds = (proc.stdout.fileno(), proc.stderr.fileno())
    bufs = {out_fds[0]: bytearray(), out_fds[1]: bytearray(), status_r: bytearray()}
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    deadline = t0 + limits.wall_s
    drain_until = None  # set when the outer process exited
    killed_for = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                killed_for = "wall_time"
                break
            if drain_until is not None and (len(sel.get_map()) == 0 or now >= drain_until):
                break
            for key, _ in sel.select(timeout=min(deadline, drain_until or deadline) - now):
                if key.fd == pidfd:
                    sel.unregister(pidfd)
                    drain_until = time.monotonic() + DRAIN_S
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
            if len(bufs[out_fds[0]]) + len(bufs[out_fds[1]]) > limits.max_output_bytes:
                killed_for = "output"
                break
    finally:
        sel.close()
        os.close(pidfd)
        os.close(status_r)
        proc.stdout.close()
        proc.stderr.close()
    out, err = bytes(bufs[out_fds[0]]), bytes(bufs[out_fds[1]])
    if killed_for == "output":  # keep at most the limit, stdout first
        out = out[: limits.max_output_bytes]
        err = err[: max(0, limits.max_output_bytes - len(out))]
    return out, err, bytes(bufs[status_r]), killed_for


def _decode_status(rc: int, backend: str) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of the program from the outer process's return code.

    Unisolated, the outer process is the program: a negative code is its signal. bubblewrap reports a program
    that died of signal ``s`` as exit status ``128 + s`` (the shell convention).
    """
    if rc < 0:
        return None, -rc
    if backend == "bwrap" and 128 < rc < 128 + 65:
        return None, rc - 128
    return rc, None


def limit_from_failure(exit_code: int | None, sig: int | None, stderr: str) -> str | None:
    """Which limit a program that failed on its own most likely hit (see :class:`SandboxResult`)."""
    if exit_code == 0:
        return None
    if sig == signal.SIGXCPU:
        return "cpu_time"
    tail = stderr[-2000:]
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory"
    if ("BlockingIOError" in tail and "Resource temporarily unavailable" in tail) or "can't start new thread" in tail:
        return "processes"
    return None
