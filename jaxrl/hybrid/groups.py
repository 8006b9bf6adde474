"""Worker groups: one Ray actor per host of a resource pool, each group its own JAX world, called by the driver.

A :class:`WorkerGroup` reserves its pool (:class:`jaxrl.ray_backend.pool.HostPool`: ``nnodes`` bundles of
``n_gpus_per_node`` accelerators on distinct nodes, named ``jaxrl-<group>``), places one member (a
:mod:`jaxrl.hybrid.worker` class as a Ray actor) on each bundle and calls them the way verl's
``RayWorkerGroup`` does:

* :meth:`WorkerGroup.call`: one-to-all (every member runs the same SPMD phase on its shard of the world; the
  primary's result is returned, the others' are waited for);
* :meth:`WorkerGroup.call_each`: each member its own arguments, every result returned (verl's split by
  data-parallel rank), for a group of independent members (``own_world=False``: vLLM per host, each member its own
  engine and its own one-process world);
* a call waits in short slices and, between them, checks that every member of every group of the run still answers
  (:meth:`HybridGroups.check_alive`: each member answers ``ping`` from a second thread), so a member that dies, in
  this group or in the other one, ends the call within seconds with a :class:`GroupFailure` naming the group, its
  rank, node and process;
* an exception raised inside a member comes back as itself (a ``ConfigError`` stays a config error), not wrapped.

:meth:`HybridGroups.shutdown` kills every member and removes the placement groups: nothing of the run is left on
the cluster. Only this module and :mod:`jaxrl.hybrid.controller` import Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

log = logging.getLogger("jaxrl")

__all__ = ["GroupFailure", "GroupTimeout", "HybridGroups", "WorkerGroup"]

POLL_S = 0.5  # how often a waiting call wakes up to check the members
PING_EVERY_S = 2.0  # how often the members are pinged while a call waits
PING_TIMEOUT_S = 10.0  # a member that does not answer a ping this long counts as lost


class GroupFailure(RuntimeError):
    """A member of a worker group died (killed, out of memory, its node lost) or stopped answering.

    Attributes:
      group: ``"train"`` or ``"rollout"``; rank: the member's rank in its group; where: its node and process.
    """

    def __init__(self, group: str, rank: int, where: str, reason: str):
        self.group, self.rank, self.where, self.reason = group, rank, where, reason
        super().__init__(f"the {group} group's member {rank} ({where}) {reason}; every group was stopped")


class GroupTimeout(TimeoutError):
    """A call to a group did not finish within its time limit (the members answer pings: they are alive, busy)."""


@dataclasses.dataclass
class _Member:
    handle: Any
    info: dict

    def where(self) -> str:
        i = self.info
        return (f"node {i.get('node_ip', '?')} ({str(i.get('node_id', '?'))[:12]}), host {i.get('hostname', '?')}, "
                f"actor pid {i.get('pid', '?')}")


class WorkerGroup:
    """The members of one group, in rank order.

    Args:
      name: ``"train"`` or ``"rollout"`` (messages, the placement group's name).
      worker_cls: the member's class (:class:`~jaxrl.hybrid.worker.TrainWorker` / ``RolloutWorker``).
      nnodes, devices_per_host, resource: the pool (see :class:`~jaxrl.ray_backend.pool.HostPool`).
      env: environment every member applies before jax starts (``JAXRL_LOCAL_DEVICE_COUNT`` on CPU clusters).
      cwd: the members' working directory (the driver's).
      own_world: the members of several hosts form one JAX world (True: SPMD over all their devices) or each member
        is a world of its own (False: independent engines, called with :meth:`call_each`).
    """

    def __init__(self, name: str, worker_cls, *, nnodes: int, devices_per_host: int, resource: str = "auto",
                 env: dict[str, str] | None = None, cwd: str | None = None, own_world: bool = True):
        from jaxrl.ray_backend.pool import HostPool

        self.name, self.worker_cls, self.own_world = name, worker_cls, own_world
        self.pool = HostPool(nnodes, devices_per_host, resource, name=f"jaxrl-{name}")
        self.env, self.cwd = dict(env or {}), cwd
        self.members: list[_Member] = []
        self.peers: HybridGroups | None = None

    def start(self, timeout_s: float) -> None:
        """Reserve the pool and place one member per bundle (each with its bundle's CPU and accelerators; on a CPU
        cluster each simulates ``devices_per_host`` CPU devices).

        Raises:
          PlacementTimeoutError: the cluster did not hold the pool within ``timeout_s``.
          GroupFailure: a member did not start.
        """
        import ray

        from jaxrl.ray_backend.pool import rank_order

        self.pool.reserve(timeout_s)
        env = dict(self.env)
        if self.pool.resource == "CPU":
            env.setdefault("JAXRL_LOCAL_DEVICE_COUNT", str(self.pool.devices_per_host))
        remote = ray.remote(self.worker_cls)
        handles = [remote.options(**self.pool.actor_options(i), max_concurrency=2, name=None)
                   .remote(env, self.cwd) for i in range(self.pool.nnodes)]
        infos = self._wait([h.describe.remote() for h in handles], timeout_s)
        order = rank_order(infos)  # node IP, then node id (as the Ray launcher's hosts): stable across reruns
        self.members = [_Member(handles[i], infos[i]) for i in order]
        for rank, m in enumerate(self.members):
            log.info("hybrid: %s group member %d on %s", self.name, rank, m.where())
        self._wait([m.handle.set_rank.remote(rank) for rank, m in enumerate(self.members)], timeout_s)
        if len(self.members) > 1 and self.own_world:  # one JAX world of several hosts: rank 0 runs its coordinator
            ip, port = self._wait([self.members[0].handle.free_port.remote()], timeout_s)[0]
            coordinator = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            self._wait([m.handle.set_world.remote(coordinator, len(self.members), rank)
                        for rank, m in enumerate(self.members)], timeout_s)
            log.info("hybrid: %s group world of %d processes, coordinator %s", self.name, len(self.members),
                     coordinator)

    def describe(self) -> str:
        return f"{self.name} group: {self.pool.describe()}"

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        """Run ``method(*args, **kwargs)`` on every member (one-to-all); the primary's (rank 0) result.

        Args:
          timeout_s: seconds the call may take (None: no limit; the members' liveness is checked meanwhile).

        Raises:
          GroupFailure: a member of any group died or stopped answering meanwhile.
          GroupTimeout: ``timeout_s`` passed first (the members may still be running it).
          Exception: what the method raised in a member (its own type).
        """
        refs = [getattr(m.handle, method).remote(*args, **kwargs) for m in self.members]
        return self._wait(refs, call_timeout_s=timeout_s, what=method)[0]

    def call_each(self, method: str, args: list[tuple], timeout_s: float | None = None) -> list[Any]:
        """Run ``method(*args[k])`` on member ``k`` for each ``k`` with arguments (``len(args)`` <= members; the
        rest are not called); every result, in rank order. Raises as :meth:`call`."""
        if len(args) > len(self.members):
            raise ValueError(f"{len(args)} argument sets for the {self.name} group's {len(self.members)} members")
        refs = [getattr(m.handle, method).remote(*a) for m, a in zip(self.members, args)]
        return self._wait(refs, call_timeout_s=timeout_s, what=method)

    def _wait(self, refs: list, timeout_s: float | None = None, *, call_timeout_s: float | None = None,
              what: str = "") -> list:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        t0 = last_ping = time.monotonic()
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise GroupFailure(self.name, 0, "starting", f"did not start within {timeout_s:g} s")
            if pending and call_timeout_s is not None and time.monotonic() - t0 > call_timeout_s:
                raise GroupTimeout(f"the {self.name} group's {what} did not finish within {call_timeout_s:g} s")
            if pending and self.peers is not None and time.monotonic() - last_ping > PING_EVERY_S:
                self.peers.check_alive()
                last_ping = time.monotonic()
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except RayActorError as e:
                where = self.members[rank].where() if rank < len(self.members) else f"bundle {rank}"
                raise GroupFailure(self.name, rank, where, f"died: {_first_line(e)}") from None
            except RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
                if cause is None:
                    raise
                raise cause from None
        return out

    def ping_refs(self) -> list[tuple[int, Any]]:
        return [(rank, m.handle.ping.remote()) for rank, m in enumerate(self.members)]

    def kill(self) -> None:
        """Kill every member (no restart) and remove the placement group. Idempotent."""
        import ray

        for m in self.members:
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.members = []
        self.pool.release()


class HybridGroups:
    """The run's groups (``train``, ``rollout``), so a call to one notices a dead member of the other."""

    def __init__(self, *groups: WorkerGroup):
        self.groups = {g.name: g for g in groups}
        for g in groups:
            g.peers = self

    def __getitem__(self, name: str) -> WorkerGroup:
        return self.groups[name]

    def check_alive(self) -> None:
        """Ping every member of every group; raises :class:`GroupFailure` for the first that died or did not answer
        within :data:`PING_TIMEOUT_S`."""
        import ray
        from ray.exceptions import RayActorError

        pings = [(g, rank, ref) for g in self.groups.values() for rank, ref in g.ping_refs()]
        if not pings:  # no group has its members yet (both still starting)
            return
        ready, _ = ray.wait([r for _, _, r in pings], num_returns=len(pings), timeout=PING_TIMEOUT_S)
        ready = set(ready)
        for g, rank, ref in pings:
            if ref not in ready:
                raise GroupFailure(g.name, rank, g.members[rank].where(),
                                   f"did not answer for {PING_TIMEOUT_S:g} s")
            try:
                ray.get(ref)
            except RayActorError as e:
                raise GroupFailure(g.name, rank, g.members[rank].where(), f"died: {_first_line(e)}") from None

    def shutdown(self) -> None:
        for g in self.groups.values():
            g.kill()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
