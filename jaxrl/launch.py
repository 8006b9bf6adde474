"""``python -m jaxrl.launch --nproc K [--local-devices N] [--module M] -- <jaxrl.train arguments>``: one run as K
processes on this machine.

Starts ``python -m jaxrl.train <arguments>`` K times with the explicit world of :mod:`jaxrl.distributed`
(``JAXRL_COORDINATOR_ADDRESS=127.0.0.1:<a free port>``, ``JAXRL_NUM_PROCESSES=K``, ``JAXRL_PROCESS_ID=i`` and, with
``--local-devices``, ``JAXRL_LOCAL_DEVICE_COUNT=N``: CPU devices per process), and supervises them:

* every line a process prints is prefixed ``[rank i]`` (stdout to stdout, stderr to stderr);
* the first process that exits non-zero (or is killed) ends the others at once (SIGKILL to each one's process
  group) and its status is the launcher's (a signal ``s`` is ``128 + s``): without this, the others would wait for
  it in a collective until the heartbeat timeout;
* SIGTERM or SIGINT is passed on as SIGTERM to every process (a run saves a checkpoint and stops cleanly; rerun
  the same command to resume); a second one kills them;
* when the launcher returns, no process it started (or any process in their groups) is left.

The coordinator listens on 127.0.0.1 only. Each process is a session of its own (``start_new_session``), so a
terminal's Ctrl-C reaches the launcher only, which decides what the processes get.

Exit status: 0 when every process exited 0, 2 for a usage error of the launcher itself, else the first failing
process's status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxrl.distributed import ENV_COORDINATOR_ADDRESS, ENV_LOCAL_DEVICE_COUNT, ENV_NUM_PROCESSES, ENV_PROCESS_ID

_POLL_S = 0.05


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl.launch",
        description="Run one jaxrl training run as several processes of one JAX world on this machine.",
        epilog="example: python -m jaxrl.launch --nproc 2 --local-devices 2 -- --config configs/quickstart.yaml "
               "trainer.nnodes=2 trainer.n_gpus_per_node=2 trainer.mesh.fsdp=4",
    )
    p.add_argument("--nproc", type=int, required=True, metavar="K", help="processes to start (>= 1)")
    p.add_argument("--local-devices", type=int, default=None, metavar="N",
                   help="CPU devices each process simulates (JAXRL_LOCAL_DEVICE_COUNT); default: the platform's")
    p.add_argument("--module", default="jaxrl.train", metavar="M",
                   help="the module each process runs with python -m (default: jaxrl.train; tests and tools may run "
                        "their own, which joins the world with jaxrl.distributed.initialize)")
    return p


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(rank: int, nproc: int, port: int, local_devices: int | None,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (default ``os.environ``) plus the ``JAXRL_*`` world."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
    if local_devices is not None:
        env[ENV_LOCAL_DEVICE_COUNT] = str(local_devices)
    else:
        env.pop(ENV_LOCAL_DEVICE_COUNT, None)
    return env


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed."""
    for line in iter(stream.readline, b""):
        with lock:
            try:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()
            except (OSError, ValueError):  # our own stdout/stderr closed: keep draining the child's pipe
                pass
    stream.close()


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Group:
    """The K processes of one run and the threads that copy their output."""

    def __init__(self, module: str, train_args: Sequence[str], nproc: int, local_devices: int | None):
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        port = free_port()
        cmd = [sys.executable, "-m", module, *train_args]
        try:
            for rank in range(nproc):
                p = subprocess.Popen(cmd, env=process_env(rank, nproc, port, local_devices), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                self.procs.append(p)
                prefix = f"[rank {rank}] ".encode()
                for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(stream, out, prefix, self.lock), daemon=True)
                    t.start()
                    self.threads.append(t)
        except BaseException:
            self.kill()
            self.reap()
            raise

    def terminate(self) -> None:
        """SIGTERM to each process (not its group: its own helper processes stop with it)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL to every process group."""
        for p in self.procs:
            _kill_group(p.pid, signal.SIGKILL)

    def wait_first_failure(self, signals: list[int]) -> int:
        """Wait until all processes exited 0 (returns 0) or one failed (returns its status); forwards the signals
        the launcher receives meanwhile (``signals`` is filled by the handler)."""
        forwarded = 0
        while True:
            if len(signals) > forwarded:
                if forwarded == 0:
                    self.terminate()
                else:
                    self.kill()
                forwarded = len(signals)
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return _exit_status(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(_POLL_S)

    def reap(self) -> None:
        """Wait for every process, end whatever is left in their groups, and drain their output."""
        for p in self.procs:
            try:
                p.wait()
            except BaseException:  # noqa: BLE001 - interrupted: kill and wait again
                _kill_group(p.pid, signal.SIGKILL)
                p.wait()
            _kill_group(p.pid, signal.SIGKILL)  # helpers left in the process's group
        for t in self.threads:
            t.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), start the processes, supervise them; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" not in argv:
        parser.print_usage(sys.stderr)
        print("jaxrl: error: put the jaxrl.train arguments after '--', e.g. python -m jaxrl.launch --nproc 2 -- "
              "--config configs/quickstart.yaml", file=sys.stderr)
        return 2
    cut = argv.index("--")
    try:
        args = parser.parse_args(argv[:cut])
    except SystemExit as e:
        return int(e.code or 0)
    if args.nproc < 1:
        print(f"jaxrl: error: --nproc={args.nproc} must be >= 1", file=sys.stderr)
        return 2
    if args.local_devices is not None and args.local_devices < 1:
        print(f"jaxrl: error: --local-devices={args.local_devices} must be >= 1", file=sys.stderr)
        return 2
    signals: list[int] = []
    handler = lambda signum, _frame: signals.append(signum)  # noqa: E731
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    group = None
    try:
        group = _Group(args.module, argv[cut + 1:], args.nproc, args.local_devices)
        code = group.wait_first_failure(signals)
        if code != 0:
            group.kill()
        return code
    finally:
        if group is not None:
            group.reap()
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
