"""The resource pool of a Ray-launched run: one bundle per host, each on a distinct node, and the hosts' rank order.

A run of ``trainer.nnodes`` hosts asks the cluster for ``nnodes`` bundles of ``{CPU: 1, <accelerator>:
trainer.n_gpus_per_node}`` in one placement group:

* ``GPU`` (and ``CPU``, a bundle of one CPU for clusters without accelerators): strategy ``STRICT_SPREAD``, so
  every bundle lands on its own node and the whole group is reserved at once (gang scheduling);
* ``TPU``: one TPU slice through Ray's TPU support (:class:`ray.util.tpu.SlicePlacementGroup`): Ray reserves the
  slice's head (the node labelled ``ray.io/tpu-worker-id=0`` with the ``TPU-<pod type>-head`` resource) and places
  one bundle on each host of that slice (the ``ray.io/tpu-slice-name`` label), so the run never straddles two
  slices. The slice must have exactly ``trainer.nnodes`` hosts.

An actor placed on each bundle reports its node (:meth:`jaxrl.ray_backend.host.HostAgent.describe`); the ranks
follow :func:`rank_order` (TPU worker id, else node IP, then node id), as verl sorts its placement groups by node
IP, so a restarted group on the same nodes gets the same ranks.

Only this module, :mod:`jaxrl.ray_backend.host` and :mod:`jaxrl.ray_backend.driver` import Ray.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.config.errors import ConfigError

__all__ = ["HostPool", "PlacementTimeoutError", "bundle_for", "pick_resource", "rank_order", "tpu_slice_of"]

TPU_WORKER_ID_LABEL = "ray.io/tpu-worker-id"
TPU_TOPOLOGY_LABEL = "ray.io/tpu-topology"
TPU_POD_TYPE_LABEL = "ray.io/tpu-pod-type"


class PlacementTimeoutError(RuntimeError):
    """The cluster did not hold the run's hosts within ``trainer.ray.placement_timeout_s``."""


def pick_resource(resource: str, cluster_resources: Mapping[str, float]) -> str:
    """The accelerator resource of each host's bundle: ``resource`` unless ``"auto"``, which picks ``"TPU"`` when the
    cluster has TPUs, else ``"GPU"`` when it has GPUs, else ``"CPU"``.

    Args:
      resource: ``trainer.ray.resource``.
      cluster_resources: the cluster's totals (``ray.cluster_resources()``).
    """
    if resource != "auto":
        return resource
    for name in ("TPU", "GPU"):
        if cluster_resources.get(name, 0) > 0:
            return name
    return "CPU"


def bundle_for(resource: str, devices_per_host: int) -> dict[str, float]:
    """One host's bundle (GPU / CPU): ``{"CPU": 1, "GPU": devices_per_host}`` or ``{"CPU": 1}``."""
    if resource == "GPU":
        return {"CPU": 1.0, "GPU": float(devices_per_host)}
    if resource == "CPU":
        return {"CPU": 1.0}
    raise ValueError(f"no plain bundle for resource {resource!r} (TPU hosts come from a slice placement group)")


def _ip_key(ip: str) -> tuple:
    try:
        a = ipaddress.ip_address(ip)
        return (a.version, int(a))
    except ValueError:
        return (9, ip)


def rank_order(hosts: Sequence[Mapping[str, Any]]) -> list[int]:
    """The order of ``hosts`` as ranks: ``result[rank]`` is the index of that rank's host.

    Args:
      hosts: one mapping per bundle with ``node_ip`` (str), ``node_id`` (str) and ``tpu_worker_id`` (int or None),
        as :meth:`jaxrl.ray_backend.host.HostAgent.describe` reports them.

    Returns:
      indices sorted by TPU worker id when every host has one (a TPU slice's process ids follow its workers), else
      by node IP (numerically), then node id: the same ranks for the same nodes, whatever order Ray placed them in.
    """
    tpu = all(h.get("tpu_worker_id") is not None for h in hosts)

    def key(i: int) -> tuple:
        h = hosts[i]
        return ((h["tpu_worker_id"],) if tpu else ()) + (_ip_key(h["node_ip"]), h["node_id"])

    return sorted(range(len(hosts)), key=key)


def tpu_slice_of(nodes: Sequence[Mapping[str, Any]], topology: str | None,
                 accelerator: str | None) -> tuple[str, str]:
    """The TPU slice to place: ``(topology, accelerator version)`` from the keys, the unset ones read from the alive
    TPU nodes' labels (``ray.io/tpu-topology``, ``ray.io/tpu-pod-type`` e.g. ``v4-16`` -> ``v4``).

    Args:
      nodes: ``ray.nodes()``.
      topology, accelerator: ``trainer.ray.tpu_topology`` / ``tpu_accelerator`` (None = from the labels).

    Raises:
      ConfigError: a value is unset and the TPU nodes do not label exactly one (names the keys and what was seen).
    """
    seen_topologies, seen_versions = set(), set()
    for n in nodes:
        labels = n.get("Labels") or {}
        if not n.get("Alive") or TPU_TOPOLOGY_LABEL not in labels:
            continue
        seen_topologies.add(labels[TPU_TOPOLOGY_LABEL])
        if labels.get(TPU_POD_TYPE_LABEL):
            seen_versions.add(labels[TPU_POD_TYPE_LABEL].split("-")[0])
    if topology is None:
        if len(seen_topologies) != 1:
            raise ConfigError(f"trainer.ray.tpu_topology is null and the cluster's TPU nodes label "
                              f"{sorted(seen_topologies) or 'no'} topologies ({TPU_TOPOLOGY_LABEL}); set "
                              "trainer.ray.tpu_topology (e.g. 2x2x2) and trainer.ray.tpu_accelerator (e.g. v4)")
        topology = next(iter(seen_topologies))
    if accelerator is None:
        if len(seen_versions) != 1:
            raise ConfigError(f"trainer.ray.tpu_accelerator is null and the cluster's TPU nodes label "
                              f"{sorted(seen_versions) or 'no'} generations ({TPU_POD_TYPE_LABEL}); set "
                              "trainer.ray.tpu_accelerator (e.g. v4, v5p, v6e)")
        accelerator = next(iter(seen_versions))
    return topology.strip().lower(), accelerator.strip().lower()


class HostPool:
    """The reserved bundles of one run (a placement group; a TPU slice placement group for TPUs).

    Args:
      nnodes: hosts (``trainer.nnodes``).
      devices_per_host: accelerators per host (``trainer.n_gpus_per_node``).
      resource: ``trainer.ray.resource`` (``auto`` / ``GPU`` / ``TPU`` / ``CPU``).
      tpu_topology, tpu_accelerator: ``trainer.ray.tpu_*`` (TPU only; None = the nodes' labels).
      name: the placement group's name (shows in ``ray status`` / the dashboard).

    Attributes (after :meth:`reserve`):
      resource: the resolved resource; bundle: one bundle's resources; placement_group: the Ray placement group.
    """

    def __init__(self, nnodes: int, devices_per_host: int, resource: str = "auto", *, tpu_topology: str | None = None,
                 tpu_accelerator: str | None = None, name: str = "jaxrl-hosts"):
        self.nnodes, self.devices_per_host = nnodes, devices_per_host
        self.requested, self.tpu_topology, self.tpu_accelerator = resource, tpu_topology, tpu_accelerator
        self.name = name
        self.resource: str | None = None
        self.bundle: dict[str, float] = {}
        self.placement_group = None
        self._slice = None

    def describe(self) -> str:
        """``2 hosts x {CPU: 1, GPU: 8}`` (for messages)."""
        res = ", ".join(f"{k}: {v:g}" for k, v in self.bundle.items())
        return f"{self.nnodes} host(s) x {{{res}}}" + (f" (TPU {self.tpu_accelerator} {self.tpu_topology} slice)"
                                                         if self.resource == "TPU" else "")

    def reserve(self, timeout_s: float) -> None:
        """Create the placement group and wait until every bundle is placed.

        Raises:
          ConfigError: a TPU slice whose host count is not ``nnodes``, or an unknown TPU topology / generation.
          PlacementTimeoutError: not placed within ``timeout_s`` (names what was asked and what the cluster has).
        """
        import ray
        from ray.util.placement_group import placement_group

        self.resource = pick_resource(self.requested, ray.cluster_resources())
        if self.resource == "TPU":
            self._reserve_tpu_slice(timeout_s)
        else:
            self.bundle = bundle_for(self.resource, self.devices_per_host)
            self.placement_group = placement_group([dict(self.bundle) for _ in range(self.nnodes)],
                                                   strategy="STRICT_SPREAD", name=self.name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            have = "; ".join(f"{n.get('NodeManagerAddress')}: " + ", ".join(
                f"{k}={v:g}" for k, v in sorted(n.get("Resources", {}).items())
                if k in ("CPU", "GPU", "TPU")) for n in ray.nodes() if n.get("Alive"))
            self.release()
            raise PlacementTimeoutError(
                f"the Ray cluster did not place {self.describe()} on distinct nodes within {timeout_s:g} s "
                f"(trainer.ray.placement_timeout_s); its alive nodes: {have or 'none'}")
        if self._slice is not None:
            self._slice.release_head_pgs()  # the worker bundles now hold the slice; its head reservation is done

    def _reserve_tpu_slice(self, timeout_s: float) -> None:
        import ray
        from ray.util.tpu import SlicePlacementGroup

        topology, version = tpu_slice_of(ray.nodes(), self.tpu_topology, self.tpu_accelerator)
        self.tpu_topology, self.tpu_accelerator = topology, version
        try:
            self._slice = SlicePlacementGroup(topology=topology, accelerator_version=version, name=self.name,
                                              head_reservation_timeout_s=timeout_s)
        except TimeoutError as e:
            raise PlacementTimeoutError(f"the Ray cluster did not reserve a TPU {version} {topology} slice within "
                                        f"{timeout_s:g} s (trainer.ray.placement_timeout_s): "
                                        f"{str(e).splitlines()[0][:300]}") from None
        except ValueError as e:  # an unknown generation or topology
            raise ConfigError(f"trainer.ray.tpu_topology={topology!r} / tpu_accelerator={version!r}: "
                              f"{str(e).splitlines()[0]}") from None
        if self._slice.num_hosts != self.nnodes:
            hosts = self._slice.num_hosts
            self.release()
            raise ConfigError(f"trainer.nnodes={self.nnodes} but a TPU {version} {topology} slice has {hosts} "
                              f"host(s); set trainer.nnodes={hosts} (one process per TPU host)")
        self.bundle = dict(self._slice.bundle_resources)
        self.placement_group = self._slice.placement_group

    def actor_options(self, index: int) -> dict:
        """Ray actor options that make an actor hold all of bundle ``index`` (its CPU and accelerators)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        return dict(num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0), resources=extra,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=index))

    def release(self) -> None:
        """Remove the placement group (and a TPU slice's head reservation). Idempotent."""
        from ray.util.placement_group import remove_placement_group

        if self._slice is not None:
            self._slice.shutdown()
            self._slice = None
        elif self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - the cluster may be gone already; nothing left to free then
                pass
        self.placement_group = None
