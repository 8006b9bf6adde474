"""The Ray launcher: one run of ``python -m jaxrl.train`` over the nodes of a Ray cluster (``trainer.launcher=ray``).

verl users run multi-node jobs on a Ray cluster (``ray start --head``, ``ray start --address=...`` on the other
nodes, then ``ray job submit -- python3 -m verl.trainer.main_ppo ... trainer.nnodes=N trainer.n_gpus_per_node=G``).
The same command with ``jaxrl.train`` runs jaxrl there. The process ``ray job submit`` starts becomes a thin
driver: it places and supervises, it never trains.

* :mod:`jaxrl.ray_backend.pool`: the resource pool. One bundle per host (``trainer.nnodes`` of them), each on a
  distinct node, holding ``trainer.n_gpus_per_node`` of the host's accelerator (GPU; TPU through Ray's TPU slice
  placement, ``ray.util.tpu``; or, on CPU clusters, one CPU), and the rank order of the hosts (TPU worker id, else
  node IP, then node id: stable across restarts while the nodes stay).
* :mod:`jaxrl.ray_backend.host`: :class:`~jaxrl.ray_backend.host.HostAgent`, the actor on each host: it starts
  ``python -m jaxrl.train <the same arguments>`` as that host's process of the JAX world with the
  :mod:`jaxrl.distributed` env contract (``JAXRL_COORDINATOR_ADDRESS`` / ``JAXRL_NUM_PROCESSES`` /
  ``JAXRL_PROCESS_ID``), buffers its output and reports its exit (JAX's layout: one process per host holding all
  of its accelerators, where verl puts one actor per GPU).
* :mod:`jaxrl.ray_backend.driver`: the driver. Rank 0's actor picks the coordinator address (its node IP and a free
  port); the driver streams every line to its own stdout / stderr prefixed ``[rank i]``, ends the whole group on the
  first failure and exits non-zero naming the rank, its node and its error; ``trainer.max_restarts`` restarts the
  group from the newest checkpoint.

This module is the part the config loader needs: which launcher a config asks for (:func:`resolve_launcher`) and what
the Ray launcher requires of the config (:func:`check_ray_launch`). Nothing here imports Ray (an optional extra:
``pip install 'jaxrl[ray]'``); only the driver, the pool and the actor do, when the launcher is ``ray``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from jaxrl.config.errors import ConfigError

__all__ = ["LAUNCHERS", "RAY_ADDRESS_ENV", "check_ray_launch", "check_rollout_pool", "resolve_launcher",
           "uses_rollout_pool"]

LAUNCHERS: tuple[str, ...] = ("local", "ray")  # = jaxrl.config.schema.LAUNCHER_CHOICES
RAY_ADDRESS_ENV = "RAY_ADDRESS"


def resolve_launcher(launcher: str | None, environ: Mapping[str, str] | None = None, *,
                     member: bool = False) -> str:
    """The launcher a run uses: ``trainer.launcher`` when set, else ``"ray"`` when ``RAY_ADDRESS`` is set (``ray
    job submit`` sets it for its entrypoint, so verl's command line needs no new key), else ``"local"``.

    Args:
      launcher: ``trainer.launcher`` (None = decide from the environment).
      environ: the environment (default ``os.environ``).
      member: this process was given a world to join (``trainer.distributed`` / ``JAXRL_*`` describe one, e.g. it
        was started by ``python -m jaxrl.launch``): it is one process of a run, never a driver, so an unset launcher
        is ``"local"`` whatever ``RAY_ADDRESS`` says.

    Raises:
      ConfigError: ``launcher`` is not one of :data:`LAUNCHERS` (one line).
    """
    if launcher is None:
        env = os.environ if environ is None else environ
        return "ray" if (env.get(RAY_ADDRESS_ENV) or "").strip() and not member else "local"
    if launcher not in LAUNCHERS:
        raise ConfigError(f"trainer.launcher={launcher!r} is invalid; expected one of "
                          f"{', '.join(map(repr, LAUNCHERS))} or null (ray when {RAY_ADDRESS_ENV} is set)")
    return launcher


def check_ray_launch(cfg, spec, environ: Mapping[str, str] | None = None) -> None:
    """What the launcher settings require of a config (no Ray, no jax).

    ``cfg.trainer.launcher`` must already be resolved (:func:`resolve_launcher`). With ``local``,
    ``trainer.max_restarts`` must be 0 (only the Ray driver restarts a group). With ``ray``, the driver forms the
    world itself, so ``trainer.distributed`` must not describe one (no mode, address, count or id, and no
    ``JAXRL_*`` world in the environment), and the world it will form (``trainer.nnodes`` processes of
    ``trainer.n_gpus_per_node`` devices) is checked now with :func:`jaxrl.distributed.check_world`, before anything
    is placed.

    Args:
      cfg: the config (:class:`jaxrl.config.schema.JaxRLConfig`).
      spec: the :class:`jaxrl.distributed.WorldSpec` of this process (``resolve_world``).
      environ: the environment (default ``os.environ``).

    Raises:
      ConfigError: one line naming the key, its value and the fix.
    """
    from jaxrl.distributed import (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, WorldSpec,
                                   check_world)

    t = cfg.trainer
    check_rollout_pool(cfg)
    if t.launcher != "ray":
        if t.max_restarts:
            raise ConfigError(f"trainer.max_restarts={t.max_restarts} needs trainer.launcher=ray (the Ray driver "
                              "restarts the group from the newest checkpoint); with trainer.launcher="
                              f"{t.launcher!r} rerun the same command to resume, or set trainer.max_restarts=0")
        check_world(cfg, spec)
        return
    env = os.environ if environ is None else environ
    d = t.distributed
    given = [f"trainer.distributed.{k}={getattr(d, k)!r}" for k in ("mode", "coordinator_address", "num_processes",
                                                                     "process_id") if getattr(d, k) is not None]
    given += [f"{e}={env[e]!r}" for e in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
              if (env.get(e) or "").strip()]
    if given:
        raise ConfigError(f"trainer.launcher=ray forms the world itself (one process per Ray node), but "
                          f"{', '.join(given)} describe(s) one too; drop them, or use trainer.launcher=local")
    if uses_rollout_pool(cfg):  # two worlds: each group's, with the config it runs (the driver is no process of them)
        from jaxrl.hybrid.worker import group_config

        for group in ("train", "rollout"):
            g = group_config(cfg, group)  # (vLLM per host: each rollout member is a world of one process)
            n = g.trainer.nnodes
            check_world(g, WorldSpec(mode="env" if n > 1 else "local", num_processes=n, process_id=0))
        return
    planned = WorldSpec(mode="env", num_processes=t.nnodes, process_id=0,
                        local_device_count=spec.local_device_count)
    check_world(cfg, planned)


def uses_rollout_pool(cfg) -> bool:
    """True when the rollout has a resource pool of its own (``actor_rollout_ref.rollout.nnodes`` >= 1): the run is
    then the hybrid controller of :mod:`jaxrl.hybrid` (a train group and a rollout group, each its own JAX world,
    driven by this process), not the replicated SPMD run of :mod:`jaxrl.ray_backend.driver`."""
    return cfg.actor_rollout_ref.rollout.nnodes > 0


# what the hybrid controller does not run yet: (key, its value in cfg -> offending?, why)
_HYBRID_REFUSALS = (
    ("reward_model.enable", lambda c: bool(c.reward_model.enable),
     "the reward model (and PRIME's implicit PRM) run on the train mesh of a single world; not built for the train "
     "group yet"),
    ("algorithm.dpo.enable", lambda c: bool(c.algorithm.dpo.enable), "online DPO is not built for the groups yet"),
    ("algorithm.adv_estimator", lambda c: c.algorithm.adv_estimator == "prime",
     "PRIME's implicit PRM is not built for the train group yet"),
    ("actor_rollout_ref.rollout.multi_turn.enable", lambda c: bool(c.actor_rollout_ref.rollout.multi_turn.enable),
     "multi-turn rollouts are not built for the rollout group yet"),
    ("trainer.max_restarts", lambda c: bool(c.trainer.max_restarts),
     "the hybrid driver does not restart its groups; rerun the same command to resume from the newest checkpoint"),
)


def check_rollout_pool(cfg) -> None:
    """What a rollout pool of its own (``actor_rollout_ref.rollout.nnodes`` / ``n_gpus_per_node``, verl's
    split-placement keys) requires of a config (no Ray, no jax).

    Raises:
      ConfigError: one line naming the key, its value and what is valid: a negative size; a pool without the Ray
        launcher; ``trainer.placement=split`` or
        ``trainer.rollout_devices`` together with a pool (the pool is the split); a setting the groups do not run.
    """
    r, t = cfg.actor_rollout_ref.rollout, cfg.trainer
    if r.nnodes < 0 or r.n_gpus_per_node < 0:
        raise ConfigError(f"actor_rollout_ref.rollout.nnodes={r.nnodes} / n_gpus_per_node={r.n_gpus_per_node} must "
                          ">= 0 (0 = the rollout shares the trainer's processes)")
    if not r.nnodes:
        return
    where = f"actor_rollout_ref.rollout.nnodes={r.nnodes} (a rollout pool of its own)"
    if r.n_gpus_per_node < 1:
        raise ConfigError(f"{where} needs actor_rollout_ref.rollout.n_gpus_per_node >= 1 (devices per rollout host); "
                          f"got {r.n_gpus_per_node}")
    if t.launcher != "ray":
        raise ConfigError(f"{where} needs the Ray launcher: set trainer.launcher=ray (or run under ray job submit), "
                          "or set actor_rollout_ref.rollout.nnodes=0 to roll out in the trainer's processes")
    if t.placement != "colocated" or t.rollout_devices is not None:
        raise ConfigError(f"trainer.placement={t.placement!r} / trainer.rollout_devices={t.rollout_devices!r} with "
                          f"{where}: the pool already splits rollout from training; leave trainer.placement="
                          "colocated and trainer.rollout_devices unset (trainer.mesh lays out the train group)")
    if r.name == "vllm" and r.tensor_model_parallel_size > r.n_gpus_per_node:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} with "
                          f"rollout.name=vllm and {where}: each rollout host runs its own vLLM engine over its "
                          f"n_gpus_per_node={r.n_gpus_per_node} devices; use a tensor-parallel size <= "
                          f"{r.n_gpus_per_node}")
    for key, offending, why in _HYBRID_REFUSALS:
        if offending(cfg):
            value = functools.reduce(getattr, key.split("."), cfg)
            raise ConfigError(f"{key}={value!r} with {where}: {why}")
