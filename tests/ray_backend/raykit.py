"""Ray clusters for the tests, on loopback only, that leave nothing behind.

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is imported: every Ray listener is then on 127.0.0.1 (without
  it Ray binds the machine's routable interface, which tests must never use). It also makes ``ray start
  --address=...`` refuse to add a node, so extra nodes are started the way ``ray.cluster_utils.Cluster`` starts
  them (in this process, by PID).
* ``HOME`` of every Ray process is a temporary folder (Ray may write ``~/.ray/auth_token`` there); the fixed default
  ports (dashboard agent 52365, metrics 44217 / 44227, client server 10001, dashboard 8265) are replaced by free
  ones, so a test cluster never meets another one on this machine.
* Never ``ray stop`` (it kills every Ray process on the machine by name): a cluster is shut down by its own handle
  (``Cluster.shutdown``: its processes by PID) and a ``ray start --head --block`` child by its PID and process group.

Tests that need Ray call :func:`require_ray` first: it fails when ``CI`` is set (CI installs the ``ray`` extra) and
skips otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before any `import ray` in this process
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from tests.distributed.worldkit import REPO, child_env, require_loopback_hostname  # noqa: E402

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def require_ray():
    """The ``ray`` module; fails under ``CI`` (where ``.ci/run`` installs ``.[ray]``) and skips elsewhere."""
    try:
        import ray
    except ImportError:
        msg = "ray is not installed (pip install -e '.[ray]')"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def patched_environ(values: dict[str, str | None]):
    """``os.environ`` with ``values`` set (None: removed) inside the block, restored after it."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ray_process_env(home: Path) -> dict[str, str]:
    """The environment of the processes a test starts (drivers, ``ray`` commands): this process's (PYTHONPATH,
    JAXRL_SHARED, ...), Ray on loopback, ``HOME`` in the test's folder, no ``RAY_ADDRESS`` / ``JAXRL_*`` world."""
    env = {k: v for k, v in child_env().items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV)
    env["HOME"] = str(home)
    return env


def _port_env() -> dict[str, str]:
    return {"AUTOSCALER_METRIC_PORT": str(free_port()), "DASHBOARD_METRIC_PORT": str(free_port())}


class LocalCluster:
    """A ``ray.cluster_utils.Cluster`` in this process: a head and ``len(nodes) - 1`` more nodes, each node started
    with its own extra environment (e.g. ``TPU_WORKER_ID``) and resources. ``pids()`` lists every process of it."""

    def __init__(self, home: Path, nodes: list[dict], node_env: list[dict[str, str]] | None = None):
        require_loopback_hostname()
        require_ray()
        from ray.cluster_utils import Cluster

        self.home = home
        # what this test process had started before (an earlier test file's helper on the same xdist worker, e.g.
        # a multiprocessing resource tracker) is not the cluster's
        self.before = _descendants()
        node_env = node_env or [{} for _ in nodes]
        self.cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
        try:
            for i, (args, extra) in enumerate(zip(nodes, node_env)):
                args = dict(args)
                if i == 0:
                    args.setdefault("dashboard_agent_listen_port", free_port())
                    args.setdefault("include_dashboard", False)
                with patched_environ({"HOME": str(home), **RAY_ENV, **_port_env(), **extra}):
                    self.cluster.add_node(**args)
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def pids(self) -> set[int]:
        """This test process's descendants now that it did not have before the cluster started (the cluster's
        processes and whatever they and the test started since)."""
        return _descendants() - self.before

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def describe(pids) -> list[str]:
    """``"pid cmdline (parent ppid)"`` of each of ``pids`` still there: what an assertion about leftovers names."""
    named = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            named.append(f"{pid} {' '.join(p.cmdline())[:100]} (parent {p.ppid()})")
    return named


def alive(pids) -> list[int]:
    """The PIDs of ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def wait_gone(pids, timeout_s: float = 30.0) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still alive at the timeout."""
    t0 = time.monotonic()
    left = alive(pids)
    while left and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
        left = alive(pids)
    return left


def kill_all(pids) -> None:
    """SIGKILL ``pids`` (the processes a failed test left)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def sockets(pids) -> list[tuple[int, str, str, str, str]]:
    """``(pid, name, status, local ip, remote ip)`` of every inet socket of ``pids``."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            for c in p.net_connections(kind="inet"):
                out.append((pid, p.name(), c.status, c.laddr.ip if c.laddr else "", c.raddr.ip if c.raddr else ""))
    return out


@contextlib.contextmanager
def driver_process(args: list[str], env: dict[str, str], *, module: str = "jaxrl.train"):
    """``python -m <module> *args`` in its own session with output to temporary files; yields ``(Popen, read)``
    where ``read()`` returns ``(stdout, stderr)`` so far. Killed (its group) if still running at the end."""
    import tempfile

    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=out, stderr=err,
                            start_new_session=True, text=True)

    def read() -> tuple[str, str]:
        texts = []
        for f in (out, err):
            f.flush()
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]

    try:
        yield proc, read
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.close()
        err.close()


def wait_http(url: str, timeout_s: float, proc=None) -> None:
    """Wait until ``url`` answers (fails early when ``proc`` exits)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{proc.args[:3]} exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).read()
            return
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


class CliHead:
    """``ray start --head --block`` as a child of this test (its own session, loopback, free ports, a dashboard for
    ``ray job submit``), plus extra nodes joined to it the way ``ray.cluster_utils.Cluster`` starts its worker
    nodes (``ray start --address`` refuses under ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). :meth:`shutdown` ends
    the nodes by their handles and the head by its PID and process group, never ``ray stop``."""

    def __init__(self, home: Path, env: dict[str, str], log: Path, *, num_cpus: int = 1, timeout_s: float = 120.0):
        require_loopback_hostname()
        require_ray()
        self.home, self.env, self.nodes, self.tree = home, env, [], set()
        self.before = _descendants()  # earlier tests' helpers in this process are not the cluster's
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        args = ["ray", "start", "--head", "--block", f"--port={self.gcs_port}", f"--num-cpus={num_cpus}",
                "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}", "--min-worker-port=0", "--max-worker-port=0",
                f"--object-store-memory={200 * 1024 * 1024}", "--disable-usage-stats"]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(args, env={**env, **_port_env()}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_http(f"{self.dashboard_url}/api/version", timeout_s, self.proc)
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, **resources) -> None:
        """Join a node (``num_cpus`` / ``num_gpus`` / ``resources`` as in ``Cluster.add_node``) to the head."""
        from ray._private.node import Node  # what ray.cluster_utils.Cluster.add_node uses for its worker nodes
        from ray._private.parameter import RayParams

        kwargs = dict(num_cpus=1, num_gpus=0, object_store_memory=150 * 1024 * 1024, min_worker_port=0,
                      max_worker_port=0, include_log_monitor=False, node_manager_port=0)
        params = RayParams(gcs_address=self.address, **{**kwargs, **resources})
        params.dashboard_agent_listen_port = None
        # the node's raylet, and so every worker and actor it starts, sees the same environment as the head's
        # (JAXRL_SHARED above all: a job's working directory is unpacked elsewhere, away from ../shared)
        with patched_environ({**self.env, **_port_env()}):
            self.nodes.append(Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True))

    def pids(self) -> set[int]:
        """The head's process tree and this process's descendants (the joined nodes), now."""
        with contextlib.suppress(psutil.Error):
            self.tree |= {self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))}
        return self.tree | (_descendants() - self.before)

    def shutdown(self) -> list[str]:
        """End every node and the head (gracefully, then by PID after 20 s); returns the processes that survived even
        SIGKILL for 30 s, named (none, unless something is stuck in the kernel)."""
        everything = self.pids()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what `ray start` left in its session (dashboard modules)
        self.proc.wait()
        self.log.close()
        # the second node's processes are this process's children (ray._private.node.Node): a graceful stop of a
        # loaded machine can take long, so what is still there after 20 s is killed by PID; what survives even
        # that is returned, named
        kill_all(wait_gone(everything - {os.getpid()}, 20))
        return describe(wait_gone(everything - {os.getpid()}, 30))
