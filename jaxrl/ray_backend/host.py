"""The actor on each host of a Ray-launched run: it runs that host's process of the JAX world.

:class:`HostAgent` is a plain class; the driver makes it a Ray actor (``ray.remote(HostAgent)``) placed on one bundle
of the run's placement group, so it holds all of its host's accelerators (Ray sets ``CUDA_VISIBLE_DEVICES`` /
``TPU_VISIBLE_CHIPS`` for it). It starts ``python -m jaxrl.train <arguments>`` as a child process (the same
command as a process of ``python -m jaxrl.launch``) with the :mod:`jaxrl.distributed` env contract the driver
gives it, in a session of its own (so its helpers can be ended with it) and with ``PR_SET_PDEATHSIG`` = SIGKILL
(so it dies when its actor dies, e.g. killed or its node lost), and keeps its output for the driver to fetch
(:meth:`HostAgent.poll`).

A child process, not the trainer in the actor itself: the trainer owns its main thread and its signals (SIGTERM ->
checkpoint -> exit), leaves with ``os._exit`` when it fails in a multi-process world
(:func:`jaxrl.distributed.exit_now`), and writes to file descriptors 1 and 2 from C++ too; all of that stays
as it is in every other launcher.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

__all__ = ["HostAgent", "TAIL_LINES", "free_port_on_node"]

TAIL_LINES = 30  # stderr lines kept for the failure message
_PR_SET_PDEATHSIG = 1


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # runs in the child between fork and exec: nothing that takes a lock
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port_on_node() -> tuple[str, int]:
    """``(this Ray node's IP, a TCP port free on it a moment ago)`` (call inside a Ray worker): where a world's
    process 0 will run its coordinator."""
    import ray

    ip = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


class HostAgent:
    """One host of the run (use as a Ray actor): describes its node, picks the coordinator's port, runs the host's
    process, buffers its output, signals and stops it. Every method returns plain picklable values."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._lines: list[tuple[str, str]] = []  # (stream "out" | "err", text without the newline)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pumps: list[threading.Thread] = []

    def describe(self) -> dict[str, Any]:
        """Where this actor runs: ``node_ip``, ``node_id``, ``hostname``, ``pid`` (the actor's), ``tpu_worker_id``
        (the node's ``ray.io/tpu-worker-id`` label as an int, or None) and ``cwd``."""
        import ray

        ctx = ray.get_runtime_context()
        labels = ctx.get_node_labels() or {}
        wid = labels.get("ray.io/tpu-worker-id")
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "tpu_worker_id": int(wid) if wid not in (None, "") else None, "cwd": os.getcwd()}

    def free_port(self) -> tuple[str, int]:
        """``(node IP, a TCP port free on it a moment ago)``: where process 0's coordinator will listen."""
        return free_port_on_node()

    def start(self, cmd: list[str], env: dict[str, str], drop_env: list[str], cwd: str | None) -> int:
        """Start ``cmd`` with this actor's environment plus ``env`` (less ``drop_env``), in ``cwd`` (None: the
        actor's own, which is the job's working directory under ``ray job submit --working-dir``).

        Returns:
          the child's pid.

        Raises:
          FileNotFoundError: ``cwd`` does not exist on this node (one line naming it and the node).
        """
        if self._proc is not None:
            raise RuntimeError("this host's process was started already")
        if cwd is not None and not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"the driver's working directory {cwd} does not exist on node {socket.gethostname()}; submit with "
                "`ray job submit --working-dir .` (Ray copies it to every node) or use one path on every node")
        full = {k: v for k, v in os.environ.items() if k not in drop_env}
        full.update(env)
        self._proc = subprocess.Popen(cmd, env=full, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
        for stream, name in ((self._proc.stdout, "out"), (self._proc.stderr, "err")):
            t = threading.Thread(target=self._pump, args=(stream, name), daemon=True)
            t.start()
            self._pumps.append(t)
        return self._proc.pid

    def _pump(self, stream, name: str) -> None:
        for raw in iter(stream.readline, b""):
            # a progress bar redraws with "\r": each redraw is a line of its own, so each gets its rank prefix
            parts = [p for p in raw.decode("utf-8", errors="replace").rstrip("\n").split("\r") if p.strip()] or [""]
            with self._lock:
                for text in parts:
                    self._lines.append((name, text))
                    if name == "err" and text.strip():
                        self._tail.append(text)
        stream.close()

    def poll(self) -> dict[str, Any]:
        """The output lines since the last call and the child's state.

        Returns:
          ``{"lines": [(stream, text), ...], "returncode": None while it runs, else its exit status (-N: killed by
          signal N), "tail": its last stderr lines once it ended (else [])}``; the child's own output is in ``lines``
          by the time a return code is reported.
        """
        code = None if self._proc is None else self._proc.poll()
        if code is not None:  # its last lines (a helper still holding the pipe is drained after stop())
            for t in self._pumps:
                t.join(timeout=0.5)
        with self._lock:
            lines, self._lines = self._lines, []
            tail = list(self._tail) if code is not None else []
        return {"lines": lines, "returncode": code, "tail": tail}

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the child (not its helpers: e.g. SIGTERM, which the trainer turns into save-and-stop)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop(self) -> int | None:
        """SIGKILL the child's whole session (it and its helpers), wait for it; returns its exit status (None if it
        never started)."""
        if self._proc is None:
            return None
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self._proc.wait()
        for t in self._pumps:
            t.join(timeout=5)
        return code
