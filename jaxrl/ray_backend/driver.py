"""The driver of a Ray-launched run: place one actor per host, start the world, stream its logs, supervise it.

``python -m jaxrl.train ...`` with ``trainer.launcher=ray`` (or ``RAY_ADDRESS`` set, as under ``ray job submit``)
calls :func:`run_driver`, which runs :func:`run_group`:

1. connect to the cluster (``RAY_ADDRESS``, else the local one) and reserve the hosts (:class:`~jaxrl.ray_backend.
   pool.HostPool`: ``trainer.nnodes`` bundles on distinct nodes, or one TPU slice);
2. place a :class:`~jaxrl.ray_backend.host.HostAgent` on each bundle, order them into ranks
   (:func:`~jaxrl.ray_backend.pool.rank_order`), and let rank 0's actor pick the coordinator address (its node IP
   and a free port);
3. start ``python -m jaxrl.train <the driver's own arguments> trainer.launcher=local trainer.max_restarts=0
   trainer.distributed.coordinator_bind_address=<that address>`` on every host with the :mod:`jaxrl.distributed`
   env contract (``JAXRL_COORDINATOR_ADDRESS``, ``JAXRL_NUM_PROCESSES``, ``JAXRL_PROCESS_ID``; the driver's
   ``JAXRL_LOCAL_DEVICE_COUNT`` is passed on), in the job's working directory (``ray job submit --working-dir``)
   or else the driver's;
4. every 0.2 s fetch each host's new output and print it prefixed ``[rank i]`` (stdout to stdout, stderr to
   stderr). The first process that exits non-zero, or actor that dies (killed, its node lost), ends the group: every
   other host's process is killed at once (its peers would otherwise wait in a collective until the heartbeat
   timeout) and the driver exits with that status (an actor's death: 1; a signal ``s``: ``128 + s``), naming the
   rank, its node and its last error line;
5. with ``trainer.max_restarts`` = N > 0, a failure (other than a config error, status 2) instead restarts the group
   on the same placement, up to N times; each restart resumes from the newest checkpoint in
   ``trainer.default_local_dir`` (``trainer.resume_mode=auto``);
6. SIGTERM / SIGINT to the driver (``ray job stop``, Ctrl-C) is passed on as SIGTERM to every host's process (the
   run saves a checkpoint and stops); a second one kills them.

When the driver returns, the actors are gone (their processes with them: each dies with its actor), the placement
group is removed and the driver has left the cluster.

``python -m jaxrl.ray_backend.driver --nnodes N --devices-per-host G [--module M] -- <arguments>`` runs any module
that joins its world with :func:`jaxrl.distributed.initialize` the same way (tests, tools).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from jaxrl.config.errors import ConfigError
from jaxrl.distributed import ENV_COORDINATOR_ADDRESS, ENV_LOCAL_DEVICE_COUNT, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from jaxrl.ray_backend import RAY_ADDRESS_ENV

__all__ = ["GroupSpec", "main", "run_driver", "run_group"]

POLL_S = 0.2  # how often the driver fetches output and states
ANSWER_TIMEOUT_S = 60.0  # an actor that does not answer a poll this long counts as failed
STOP_TIMEOUT_S = 15.0  # how long the driver waits for the hosts to kill their processes before killing the actors
PREFIX = "jaxrl: ray:"


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One group of host processes to place and supervise.

    Attributes:
      module, args: each host runs ``python -m <module> <args> <member_args>`` (the same on every host).
      nnodes: hosts (processes); devices_per_host: accelerators each host's bundle holds.
      resource, tpu_topology, tpu_accelerator: the bundle's accelerator (``trainer.ray.*``, see
        :class:`~jaxrl.ray_backend.pool.HostPool`).
      placement_timeout_s: seconds to wait for the placement and for the actors to start.
      max_restarts: restarts after a failure (0: the first failure ends the run).
      local_device_count: ``JAXRL_LOCAL_DEVICE_COUNT`` for every host (CPU devices each simulates), or None.
      member_args: appended to ``args`` on every host.
      bind_key: when set (and several hosts), ``<bind_key>=<coordinator address>`` is appended too (process 0's
        coordinator then listens on its node IP only, never on every interface).
      restart_args: called at each restart; its arguments are appended on that attempt.
    """

    module: str = "jaxrl.train"
    args: tuple[str, ...] = ()
    nnodes: int = 1
    devices_per_host: int = 1
    resource: str = "auto"
    tpu_topology: str | None = None
    tpu_accelerator: str | None = None
    placement_timeout_s: float = 300.0
    max_restarts: int = 0
    local_device_count: int | None = None
    member_args: tuple[str, ...] = ()
    bind_key: str | None = None
    restart_args: Callable[[], Sequence[str]] = lambda: ()


@dataclasses.dataclass(frozen=True)
class _Failure:
    rank: int
    status: int  # the driver's exit status for it
    message: str  # one line: what failed


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _where(info: dict[str, Any]) -> str:
    return f"node {info['node_ip']} ({info['hostname']}, actor pid {info['pid']})"


class _Group:
    """One attempt: the actors on the pool's bundles, ranked, and their processes."""

    def __init__(self, spec: GroupSpec, pool, out: TextIO, err: TextIO):
        import ray

        from jaxrl.ray_backend.host import HostAgent

        self.spec, self.out, self.err = spec, out, err
        agent = ray.remote(HostAgent)
        self.actors = [agent.options(max_restarts=0, max_task_retries=0, **pool.actor_options(i)).remote()
                       for i in range(spec.nnodes)]
        self.infos: list[dict[str, Any]] = []
        self.codes: list[int | None] = [None] * spec.nnodes
        self.dead: set[int] = set()

    def launch(self, extra_args: Sequence[str]) -> None:
        """Rank the actors, pick the coordinator, start every host's process.

        Raises:
          RuntimeError: the actors did not start in time, or a host could not start its process (one line).
        """
        import ray

        from jaxrl.ray_backend.pool import rank_order

        spec, err, actors = self.spec, self.err, self.actors
        try:
            infos = ray.get([a.describe.remote() for a in actors], timeout=spec.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the host actors did not start within {spec.placement_timeout_s:g} s "
                               "(trainer.ray.placement_timeout_s)") from None
        order = rank_order(infos)
        self.actors = [actors[i] for i in order]
        self.infos = [infos[i] for i in order]
        for rank, info in enumerate(self.infos):
            print(f"{PREFIX} rank {rank} on {_where(info)}, Ray node {info['node_id']}", file=err, flush=True)
        ip, port = ray.get(self.actors[0].free_port.remote(), timeout=ANSWER_TIMEOUT_S)
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        runtime_env = ray.get_runtime_context().runtime_env or {}
        cwd = None if runtime_env.get("working_dir") else os.getcwd()
        world = spec.nnodes > 1
        args = [*spec.args, *spec.member_args, *extra_args]
        if world and spec.bind_key:
            args.append(f"{spec.bind_key}={address}")
        cmd = [sys.executable, "-m", spec.module, *args]
        drop = [RAY_ADDRESS_ENV, ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICE_COUNT]
        starts = []
        for rank, actor in enumerate(self.actors):
            env = {"PYTHONUNBUFFERED": "1"}
            if world:
                env.update({ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: str(spec.nnodes),
                            ENV_PROCESS_ID: str(rank)})
            if spec.local_device_count is not None:
                env[ENV_LOCAL_DEVICE_COUNT] = str(spec.local_device_count)
            starts.append(actor.start.remote(cmd, env, drop, cwd))
        for rank, ref in enumerate(starts):
            try:
                ray.get(ref, timeout=ANSWER_TIMEOUT_S)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
                raise RuntimeError(f"rank {rank} on {_where(self.infos[rank])} could not start its process: "
                                   f"{first[:500]}") from None
        print(f"{PREFIX} started {spec.nnodes} process(es)" + (f", coordinator {address}" if world else ""),
              file=err, flush=True)

    def _print(self, rank: int, lines) -> None:
        for stream, text in lines:
            f = self.out if stream == "out" else self.err
            f.write(f"[rank {rank}] {text}\n")
        if lines:
            self.out.flush()
            self.err.flush()

    def poll(self) -> _Failure | None:
        """Fetch and print every host's new output; the first failure seen, else None."""
        import ray

        refs = {rank: a.poll.remote() for rank, a in enumerate(self.actors) if rank not in self.dead}
        failure = None
        for rank, ref in refs.items():
            try:
                r = ray.get(ref, timeout=ANSWER_TIMEOUT_S)
            except ray.exceptions.RayActorError as e:
                self.dead.add(rank)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                failure = failure or _Failure(rank, 1, f"rank {rank}'s Ray actor on {_where(self.infos[rank])} "
                                                       f"died: {first[:300]}")
                continue
            except ray.exceptions.GetTimeoutError:
                failure = failure or _Failure(rank, 1, f"rank {rank}'s Ray actor on {_where(self.infos[rank])} did "
                                                       f"not answer within {ANSWER_TIMEOUT_S:g} s")
                continue
            self._print(rank, r["lines"])
            code = r["returncode"]
            self.codes[rank] = code
            if code not in (None, 0) and failure is None:
                last = r["tail"][-1].strip() if r["tail"] else "(no error output)"
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                failure = _Failure(rank, _status(code), f"rank {rank} on {_where(self.infos[rank])} {how}: "
                                                        f"{last[:500]}")
        return failure

    def done(self) -> bool:
        return all(c == 0 for c in self.codes)

    def signal_all(self, signum: int) -> None:
        import ray

        refs = [a.send_signal.remote(signum) for r, a in enumerate(self.actors) if r not in self.dead]
        ray.wait(refs, num_returns=len(refs), timeout=ANSWER_TIMEOUT_S)

    def end(self) -> None:
        """Kill every host's process, print what they still had to say, and kill the actors."""
        import ray

        live = [(r, a) for r, a in enumerate(self.actors) if r not in self.dead]
        refs = [a.stop.remote() for _, a in live]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for rank, actor in live:
            try:
                self._print(rank, ray.get(actor.poll.remote(), timeout=STOP_TIMEOUT_S)["lines"])
            except Exception:  # noqa: BLE001 - a dead or stuck actor has nothing more to print
                pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def run_group(spec: GroupSpec, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Place, start and supervise ``spec``'s group on the Ray cluster (module docstring); returns the exit status.

    Connects to ``RAY_ADDRESS`` (else a running local cluster) unless Ray is initialized already (then leaves it
    connected).

    Raises:
      ConfigError: a TPU slice whose host count is not ``spec.nnodes`` (or unknown topology / generation).
      jaxrl.ray_backend.pool.PlacementTimeoutError: the hosts were not placed in ``spec.placement_timeout_s``.
      ConnectionError: the cluster could not be reached.
    """
    import ray

    from jaxrl.ray_backend.pool import HostPool

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    joined = False
    if not ray.is_initialized():
        address = (os.environ.get(RAY_ADDRESS_ENV) or "").strip() or "auto"
        try:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        except Exception as e:  # noqa: BLE001 - Ray raises several types; one line says what failed
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConnectionError(f"cannot connect to the Ray cluster at {address} ({RAY_ADDRESS_ENV}): "
                                  f"{first[:300]}") from None
        joined = True
    signals: list[int] = []
    previous = {}
    if sys.platform != "win32":
        import threading

        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, lambda signum, _f: signals.append(signum))
                        for s in (signal.SIGTERM, signal.SIGINT)}
    pool = HostPool(spec.nnodes, spec.devices_per_host, spec.resource, tpu_topology=spec.tpu_topology,
                    tpu_accelerator=spec.tpu_accelerator)
    try:
        pool.reserve(spec.placement_timeout_s)
        print(f"{PREFIX} placed {pool.describe()}", file=err, flush=True)
        if signals:  # stopped while waiting for the cluster: nothing was started
            print(f"{PREFIX} stopped by signal {signals[0]} before the hosts started", file=err, flush=True)
            return 128 + signals[0]
        attempt, extra = 0, ()
        while True:
            failure = _supervise(_Group(spec, pool, out, err), extra, signals)
            if failure is None:
                return 0
            print(f"jaxrl: error: {failure.message}", file=err, flush=True)
            if signals or failure.status == 2 or attempt >= spec.max_restarts:
                if attempt:
                    print(f"{PREFIX} the group failed after {attempt} restart(s) (trainer.max_restarts="
                          f"{spec.max_restarts})", file=err, flush=True)
                return failure.status
            attempt += 1
            extra = tuple(spec.restart_args())
            print(f"{PREFIX} restarting the group ({attempt} of {spec.max_restarts}) from the newest checkpoint",
                  file=err, flush=True)
    finally:
        pool.release()
        for s, h in previous.items():
            signal.signal(s, h)
        if joined:
            ray.shutdown()


def _supervise(group: _Group, extra_args: Sequence[str], signals: list[int]) -> _Failure | None:
    """Run one attempt to its end: None when every process exited 0, else the first failure (the group ended)."""
    forwarded = 0
    try:
        group.launch(extra_args)
        while True:
            if len(signals) > forwarded:
                if forwarded == 0:
                    group.signal_all(signal.SIGTERM)
                else:
                    group.end()
                forwarded = len(signals)
            failure = group.poll()
            if failure is not None:
                return failure
            if group.done():
                return None
            time.sleep(POLL_S)
    finally:
        group.end()


def _restart_args(cfg) -> Callable[[], Sequence[str]]:
    """What a restart appends: resume from the newest checkpoint of this run's folder (``trainer.resume_mode=auto``);
    with ``resume_mode=resume_path`` only once this run has a checkpoint of its own there."""
    mode, root = cfg.trainer.resume_mode, cfg.trainer.default_local_dir

    def args() -> Sequence[str]:
        if mode == "auto":
            return ()
        if mode == "resume_path":
            from jaxrl.checkpoint import latest_complete_step

            try:
                if latest_complete_step(root) is None:
                    return ()
            except (OSError, ValueError):
                return ()
        return ("trainer.resume_mode=auto",)

    return args


def run_driver(cfg, argv: Sequence[str]) -> int:
    """``python -m jaxrl.train`` with ``trainer.launcher=ray``: run ``argv`` (its own arguments) on every host.

    Prints ``jaxrl: error: ...`` (or ``jaxrl: config error: ...``) and returns 2 for a config or usage error (Ray
    missing, a TPU slice of another size), 1 when the cluster cannot be reached or cannot hold the hosts in time,
    else :func:`run_group`'s status.
    """
    try:
        import ray  # noqa: F401
    except ImportError:
        print("jaxrl: error: trainer.launcher=ray needs Ray: pip install 'jaxrl[ray]' (or set "
              "trainer.launcher=local)", file=sys.stderr)
        return 2
    t = cfg.trainer
    local = (os.environ.get(ENV_LOCAL_DEVICE_COUNT) or "").strip()
    spec = GroupSpec(
        module="jaxrl.train", args=tuple(argv), nnodes=t.nnodes, devices_per_host=t.n_gpus_per_node,
        resource=t.ray.resource, tpu_topology=t.ray.tpu_topology, tpu_accelerator=t.ray.tpu_accelerator,
        placement_timeout_s=float(t.ray.placement_timeout_s), max_restarts=t.max_restarts,
        local_device_count=int(local) if local else None,
        member_args=("trainer.launcher=local", "trainer.max_restarts=0"),
        bind_key=None if t.distributed.coordinator_bind_address else "trainer.distributed.coordinator_bind_address",
        restart_args=_restart_args(cfg))
    return _group_status(spec)


def _group_status(spec: GroupSpec) -> int:
    """:func:`run_group`'s status, or (after one stderr line) 2 for a config error, 1 when the cluster cannot be
    reached or cannot hold the hosts in time."""
    from jaxrl.ray_backend.pool import PlacementTimeoutError

    try:
        return run_group(spec)
    except ConfigError as e:
        print(f"jaxrl: config error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, PlacementTimeoutError, RuntimeError) as e:
        print(f"jaxrl: error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrl.ray_backend.driver",
                                description="Run a module as one process per host of a Ray cluster (one JAX world).")
    p.add_argument("--nnodes", type=int, required=True, help="hosts: one process each, on distinct Ray nodes")
    p.add_argument("--devices-per-host", type=int, default=1, help="accelerators each host's bundle holds")
    p.add_argument("--resource", default="auto", choices=("auto", "GPU", "TPU", "CPU"))
    p.add_argument("--tpu-topology", default=None)
    p.add_argument("--tpu-accelerator", default=None)
    p.add_argument("--local-devices", type=int, default=None, help="JAXRL_LOCAL_DEVICE_COUNT for every host")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--placement-timeout", type=float, default=300.0, help="seconds")
    p.add_argument("--module", default="jaxrl.train")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxrl.ray_backend.driver [options] -- <module arguments>``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("jaxrl: error: put the module's arguments after '--'", file=sys.stderr)
        return 2
    cut = argv.index("--")
    try:
        a = _parser().parse_args(argv[:cut])
    except SystemExit as e:
        return int(e.code or 0)
    spec = GroupSpec(module=a.module, args=tuple(argv[cut + 1:]), nnodes=a.nnodes, devices_per_host=a.devices_per_host,
                     resource=a.resource, tpu_topology=a.tpu_topology, tpu_accelerator=a.tpu_accelerator,
                     placement_timeout_s=a.placement_timeout, max_restarts=a.max_restarts,
                     local_device_count=a.local_devices)
    return _group_status(spec)


if __name__ == "__main__":
    sys.exit(main())
