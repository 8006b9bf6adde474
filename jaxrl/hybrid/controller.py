"""The hybrid controller: the Ray driver runs the RL loop; a train group and a rollout group run its phases.

``python -m jaxrl.train ... trainer.launcher=ray actor_rollout_ref.rollout.nnodes=1
actor_rollout_ref.rollout.n_gpus_per_node=G`` calls :func:`run_hybrid` in the driver process:

1. connect to the cluster and start the groups (:mod:`jaxrl.hybrid.groups`): the train group on ``trainer.nnodes``
   x ``trainer.n_gpus_per_node`` devices, the rollout group on the rollout pool's, each member a Ray actor whose
   process is its own JAX world;
2. build the run (:func:`build_hybrid`): in the driver the run lock, the checkpoint to resume, the reward manager,
   the data (the fast checks first, as :func:`jaxrl.build.build`), the experience maker, the metrics logger and the
   checkpoint store; in the train group the policy, the actor, the reference and the critic on its train mesh; in
   the rollout group the engine, started on the train group's first weight copy;
3. run :class:`jaxrl.trainer.Trainer` over those components (:mod:`jaxrl.hybrid.proxies`): the same loop, each role
   call an RPC to a group, each weight sync a host copy through Ray's object store; the async pipeline
   (``async_training.staleness``) generates in the rollout group while the train group updates;
4. write the reward plot, let the train group export the final model, end both groups.

The driver writes the checkpoints (:class:`jaxrl.run_checkpoint.RunCheckpoints`, the arrays fetched from the train
group as host copies): the layout is a single-process run's, so ``jaxrl.export`` and a resume read it as any other.
A member that dies stops the run within seconds (:class:`~jaxrl.hybrid.groups.GroupFailure`): every group is killed,
the driver exits 1 naming the group and its host; the same command resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("jaxrl")

__all__ = ["build_hybrid", "hybrid_run", "run_hybrid", "start_groups"]


def start_groups(cfg, *, cwd: str | None = None):
    """Connect to the Ray cluster (``RAY_ADDRESS``, else a local one) unless connected, reserve both pools and place
    their members; returns :class:`~jaxrl.hybrid.groups.HybridGroups` (``["train"]``, ``["rollout"]``).

    Raises:
      ConnectionError: the cluster could not be reached.
      PlacementTimeoutError: a pool was not placed within ``trainer.ray.placement_timeout_s``.
    """
    import ray

    from jaxrl.hybrid.groups import HybridGroups, WorkerGroup
    from jaxrl.hybrid.worker import RolloutWorker, TrainWorker
    from jaxrl.ray_backend import RAY_ADDRESS_ENV

    if not ray.is_initialized():
        address = (os.environ.get(RAY_ADDRESS_ENV) or "").strip() or "auto"
        try:
            ray.init(address=address, logging_level="WARNING")
        except Exception as e:  # noqa: BLE001 - Ray raises several types; one line says what failed
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConnectionError(f"cannot connect to the Ray cluster at {address} ({RAY_ADDRESS_ENV}): "
                                  f"{first[:300]}") from None
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    env = {k: v for k, v in os.environ.items()
           if k in ("JAXRL_SHARED", "JAX_PLATFORMS", "XLA_FLAGS", "HF_HOME") or k.startswith("VLLM_")}
    cwd = os.getcwd() if cwd is None else cwd
    timeout = float(t.ray.placement_timeout_s)
    train = WorkerGroup("train", TrainWorker, nnodes=t.nnodes, devices_per_host=t.n_gpus_per_node,
                        resource=t.ray.resource, env=env, cwd=cwd)
    vllm = r.name == "vllm"  # vLLM per host: independent engines on the bundle's GPUs, JAX on the host CPU only
    rollout = WorkerGroup("rollout", RolloutWorker, nnodes=r.nnodes, devices_per_host=r.n_gpus_per_node,
                          resource=t.ray.resource, env={**env, "JAX_PLATFORMS": "cpu"} if vllm else env, cwd=cwd,
                          own_world=not vllm)
    groups = HybridGroups(train, rollout)
    try:
        train.start(timeout)
        rollout.start(timeout)
    except BaseException:
        groups.shutdown()
        raise
    log.info("hybrid: %s; %s", train.describe(), rollout.describe())
    return groups


def build_hybrid(cfg, start=start_groups):
    """``(components, groups)``: the run's :class:`~jaxrl.build.Components` with the roles in the groups that
    ``start(cfg)`` places (module docstring, step 2).

    The order of the failures a user sees is :func:`jaxrl.build.build`'s: the run lock, the checkpoint to resume,
    the custom reward, the data files and their data sources, the context length, then the groups are placed, the
    model loads (in the train group) and the engine starts (in the rollout group). If building fails, the groups are
    ended and the lock released before the error propagates.
    """
    import dataclasses

    from jaxrl import build as single
    from jaxrl.checkpoint import CheckpointStore, find_resume_checkpoint, max_to_keep_from_config
    from jaxrl.config.loader import config_to_dict
    from jaxrl.hybrid.proxies import (GroupMemory, HybridPlacement, RemoteActor, RemoteCritic, RemoteReference,
                                      RemoteRollout, RemoteWeightSync)
    from jaxrl.metrics import MetricsLogger
    from jaxrl.runlock import RunLock

    out_dir = Path(cfg.trainer.default_local_dir)
    lock = RunLock(out_dir).acquire()
    groups = None
    try:
        t = cfg.trainer
        resume_from = find_resume_checkpoint(t.resume_mode, out_dir, t.resume_from_path)
        reward = single._build_reward(cfg)
        train_rows, val_rows = single._read_rows(cfg.data)
        single._check_data_sources(cfg, train_rows, val_rows)
        single._check_context_lengths(cfg)
        groups = start(cfg)
        train, rollout = groups["train"], groups["rollout"]
        loaded = train.call("load", cfg)
        tokenizer, model_cfg = loaded["tokenizer"], loaded["model_cfg"]
        train_data, val_examples = single._prompt_pipelines(cfg.data, tokenizer, train_rows, val_rows,
                                                            dynamic_sampling=cfg.algorithm.filter_groups.enable)
        total = t.total_training_steps or t.total_epochs * train_data.steps_per_epoch
        built = train.call("build", total)
        actor = RemoteActor(train, lora=built["lora"])
        ref = RemoteReference(train) if "ref" in built["roles"] else None
        critic = RemoteCritic(train) if "critic" in built["roles"] else None
        first = actor.merged_params()
        starts = rollout.call_each("start", [(cfg, model_cfg, built["graphdef"], first.ref[0], tokenizer)]
                                   * len(rollout.members))
        started = starts[0]
        if not rollout.own_world:  # vLLM per host: every member's engine (the first one is logged below)
            for rank, s in enumerate(starts[1:], start=1):
                log.info("rollout group member %d: %s (%s)", rank, s["engine"], s["mesh"])
        engine = RemoteRollout(rollout, started)
        placement = HybridPlacement(train=loaded["placement"], rollout=started["mesh"])
        log.info("placement %s; rollout engine %s (initial weights: %.2f MB through the object store)",
                 placement.describe(), started["engine"], first.bytes / 1e6)
        experience = single._build_experience_maker(cfg, engine, tokenizer, reward, None)
        logger = MetricsLogger(t.logger, out_dir, project_name=t.project_name, experiment_name=t.experiment_name,
                               config=config_to_dict(cfg))
        store = CheckpointStore(out_dir, async_save=t.checkpoint_async, max_to_keep=max_to_keep_from_config(
            t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep, has_critic=critic is not None))
        try:
            store.save_tokenizer(tokenizer)
        except BaseException:
            store.close()
            raise
        from jaxrl.build import Components

        c = Components(cfg=cfg, tokenizer=tokenizer, model_cfg=model_cfg, actor=actor, ref=ref, rollout=engine,
                       reward=reward, experience=experience, train_data=train_data, val_rows=val_examples,
                       logger=logger, out_dir=out_dir, total_training_steps=total, store=store,
                       model_meta=built["model_meta"], critic=critic, placement=placement,
                       weight_sync=RemoteWeightSync(rollout, engine,
                                                    timeout_s=cfg.actor_rollout_ref.rollout.update_weights_timeout_s))
        return dataclasses.replace(c, lock=lock, resume_from=resume_from,
                                   memory_metrics=GroupMemory(train, rollout)), groups
    except BaseException:
        if groups is not None:
            groups.shutdown()
        lock.release()
        raise


@contextlib.contextmanager
def hybrid_run(cfg, start=start_groups):
    """``with hybrid_run(cfg) as (components, groups):`` :func:`build_hybrid`, and at the end of the block every
    member killed and the placement groups removed (nothing of the run left on the cluster), the checkpoint store
    closed and the run lock released, also on errors."""
    c, groups = build_hybrid(cfg, start)
    try:
        yield c, groups
    finally:
        groups.shutdown()
        c.store.close()
        c.lock.release()


def run_hybrid(cfg) -> dict[str, float]:
    """Start the groups, build, train, write the reward plot, export the final model (in the train group), end the
    groups; returns the last metrics.

    Raises:
      GroupFailure: a member of a group died or stopped answering (every group is killed first).
      and what :func:`jaxrl.trainer.run_training` raises (config, data, model, checkpoint, reward errors).
    """
    import jax

    # the driver computes nothing on devices (host work only) and must not take a GPU from the groups; this process
    # only: the members get the environment's JAX_PLATFORMS, if the user set one (start_groups)
    jax.config.update("jax_platforms", "cpu")
    from jaxrl.loop import setup_run_logging
    from jaxrl.metrics import plot_rewards
    from jaxrl.trainer import Trainer

    setup_run_logging()
    t0 = time.perf_counter()
    with hybrid_run(cfg) as (c, groups):
        log.info("run: %d steps, %d prompts x n=%d per step, output in %s", c.total_training_steps,
                 cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, c.out_dir)
        trainer = Trainer(c)
        try:
            c.reward.start()
            last = trainer.fit()
        finally:
            c.reward.close()
            c.logger.close()
        if c.logger.jsonl_path.exists():
            log.info("reward plot: %s", plot_rewards(c.logger.jsonl_path, c.out_dir / "reward.png"))
        groups["train"].call("export_final_model", str(c.out_dir))
        log.info("final model exported to %s (by the train group); done in %.1f s", c.out_dir / "hf_model",
                 time.perf_counter() - t0)
        return last
