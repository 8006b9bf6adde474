"""Construction of a run: every component built from a validated config (heavy imports happen here).

:func:`build` is what :func:`jaxrl.trainer.run_training` calls first; it returns :class:`Components`, which
:class:`jaxrl.trainer.Trainer` runs. The order is the order of the failures a user sees: the run folder is locked
first, the checkpoint to resume from located, then everything that fails fast (the custom reward file, the device
placement, the data files and their data sources, prompt + response lengths against the model's context from its
config alone) before the slow model load; the roles, the rollout engine, the experience maker, the metrics logger
and the checkpoint store come last.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from jaxrl import distributed
from jaxrl.algorithms.registry import needs_critic, needs_prm
from jaxrl.batch import RLBatch
from jaxrl.metrics import MetricsLogger

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class Components:
    """Everything a run is made of, built from the config by :func:`build`."""

    cfg: object
    tokenizer: object
    model_cfg: object
    actor: object
    ref: object | None
    rollout: object
    reward: object
    experience: object  # jaxrl.experience.ExperienceMaker over rollout + reward (+ reward_model): phases gen, reward
    train_data: object
    val_rows: list | None
    logger: MetricsLogger
    out_dir: Path
    total_training_steps: int
    store: object  # jaxrl.checkpoint.CheckpointStore over trainer.default_local_dir
    model_meta: dict  # what jaxrl.export needs to rebuild the policy from a checkpoint
    critic: object | None = None
    placement: object | None = None  # jaxrl.workers.placement.Placement; None = every role on one device
    weight_sync: object | None = None  # jaxrl.rollout.weight_sync.WeightSync: actor params -> the rollout engine
    reward_model: object | None = None  # jaxrl.workers.reward_model.RewardModelWorker (reward_model.enable)
    prm: object | None = None  # jaxrl.workers.prime_rm.ImplicitPRMWorker (PRIME: algorithm.adv_estimator=prime)
    lock: object | None = None  # jaxrl.runlock.RunLock on out_dir, held until run_training ends
    resume_from: tuple | None = None  # find_resume_checkpoint's answer: (root, step | None), or None = fresh start
    # the step's perf/*memory* metrics (None: jaxrl.metrics.memory_metrics of this process; the hybrid controller's
    # driver reads its groups' members: jaxrl.hybrid.proxies.GroupMemory)
    memory_metrics: object | None = None


def build(cfg) -> Components:
    """Construct every role of a run from a validated config (heavy imports happen here).

    First of all the run folder (``trainer.default_local_dir``) is locked (:class:`jaxrl.runlock.RunLock`: a
    second run there fails at once) and the checkpoint to resume from is located (a missing
    ``trainer.resume_from_path`` fails here). The custom reward file, the device placement (``trainer.mesh`` /
    ``placement``), the data files and their data sources, and the model's context length (from its config alone)
    are checked next, so a bad reward file, a mesh that does not fit the devices, a missing, empty or malformed
    file, a data source no reward function scores, or prompt + response lengths beyond the model's context fail
    before the (slow) model load. The lock is released by :func:`jaxrl.trainer.run_training` (or here, if
    building fails).

    With several processes (:mod:`jaxrl.distributed`) the primary takes the lock and finds the checkpoint, and
    shares the answer; every process must see the run folder (a shared filesystem).

    Raises:
      jaxrl.runlock.RunLockError: another run holds the folder.
      jaxrl.config.ConfigError: several processes do not see the same run folder.
    """
    from jaxrl.checkpoint import find_resume_checkpoint
    from jaxrl.runlock import RunLock

    out_dir = Path(cfg.trainer.default_local_dir)
    # before any write into the folder; several processes: the primary holds it, all raise its RunLockError
    lock = distributed.run_on_primary(lambda: RunLock(out_dir).acquire(), share=False)
    try:
        distributed.check_shared_dir(out_dir)  # several processes: all must see the one run folder
        t = cfg.trainer
        resume_from = distributed.run_on_primary(find_resume_checkpoint, t.resume_mode, out_dir, t.resume_from_path)
        return dataclasses.replace(_build_components(cfg, out_dir), lock=lock, resume_from=resume_from)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _build_components(cfg, out_dir: Path) -> Components:
    """:func:`build` after the lock: every role, the experience maker, the metrics logger and the checkpoint
    store."""
    from flax import nnx

    from jaxrl.checkpoint import CheckpointStore, max_to_keep_from_config, model_meta
    from jaxrl.config.loader import config_to_dict
    from jaxrl.workers.placement import placement_from_config

    arr = cfg.actor_rollout_ref
    reward = _build_reward(cfg)  # a bad custom reward file fails here, first (scoring processes start later)
    placement = placement_from_config(cfg)  # device counts checked before anything slow
    if placement is not None:
        log.info("placement %s", placement.describe())

    train_rows, val_rows = _read_rows(cfg.data)
    _check_data_sources(cfg, train_rows, val_rows)  # no built-in scorer and no custom reward: fail before the model
    _check_context_lengths(cfg)  # from the model's config alone (cheap), before its weights load
    pre, tokenizer = _load_policy(arr.model)
    _check_context_lengths(cfg, pre.config)  # GGUF: its context is known only now, still before any compile
    reward_model = None
    prime = needs_prm(cfg.algorithm.adv_estimator)  # the reward_model section then configures the implicit PRM
    if cfg.reward_model.enable and not prime:  # verl's RewardModelWorker, frozen, on the train mesh
        from jaxrl.workers.reward_model import build_reward_model_worker

        reward_model = build_reward_model_worker(cfg, pre.config, tokenizer, **_mesh_args(placement))
    graphdef, params = nnx.split(pre.model)
    train_data, val_examples = _prompt_pipelines(
        cfg.data, tokenizer, train_rows, val_rows, dynamic_sampling=cfg.algorithm.filter_groups.enable
    )
    total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * train_data.steps_per_epoch

    actor, ref = _build_actor_and_reference(cfg, graphdef, params, total, placement)
    critic = _build_critic(cfg, pre, total, placement) if needs_critic(cfg.algorithm.adv_estimator) else None
    prm = _build_prm(cfg, pre, graphdef, params, ref, total, placement) if prime else None
    rollout, weight_sync = _build_rollout(cfg, pre.config, actor.base_graphdef, params, tokenizer, actor, placement)
    experience = _build_experience_maker(cfg, rollout, tokenizer, reward, reward_model)
    logger = MetricsLogger(
        cfg.trainer.logger, out_dir, project_name=cfg.trainer.project_name,
        experiment_name=cfg.trainer.experiment_name, config=config_to_dict(cfg),
        writer=distributed.is_primary(),  # one writer: the other processes' logger has no sink
    )
    store = CheckpointStore(
        out_dir, async_save=cfg.trainer.checkpoint_async,
        max_to_keep=max_to_keep_from_config(
            cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep, has_critic=critic is not None
        ),
    )
    try:
        distributed.run_on_primary(store.save_tokenizer, tokenizer, share=False)
    except BaseException:
        store.close()  # ends orbax's background threads before the error propagates
        raise
    return Components(
        cfg=cfg, tokenizer=tokenizer, model_cfg=pre.config, actor=actor, ref=ref, rollout=rollout, reward=reward,
        experience=experience, train_data=train_data, val_rows=val_examples, logger=logger, out_dir=out_dir,
        total_training_steps=total, store=store,
        model_meta=model_meta(pre.config, path=arr.model.path, param_dtype=arr.model.param_dtype,
                              lora=_lora_meta(actor.lora), scan_layout=actor.scan_layout),
        critic=critic, placement=placement, weight_sync=weight_sync, reward_model=reward_model, prm=prm,
    )


def _read_rows(d):
    """Raw train / validation rows as ``LoadedRows`` (``data.*_max_samples`` applied); a split without a usable row
    raises ``DataFileError``."""
    from jaxrl.data.sources import load_split

    common = dict(skip_malformed=d.skip_malformed, prompt_key=d.prompt_key)
    train = load_split(d.train_files, split="train", max_samples=d.train_max_samples, **common)
    val = load_split(d.val_files, split="val", max_samples=d.val_max_samples, **common) if d.val_files else None
    return train, val


def _check_context_lengths(cfg, policy_config=None) -> None:
    """Prompt + response lengths must fit the policy's (and a separate critic's) context; raises ``ConfigError``
    naming the model's limit. Without ``policy_config`` (before any load) only configs that are cheap to read
    (``config.json``, a llama2.c header; not GGUF) are checked; with it, the loaded policy's."""
    from jaxrl.config.loader import check_context_length
    from jaxrl.models.files import read_model_config

    path = cfg.actor_rollout_ref.model.path
    if policy_config is not None:
        check_context_length(cfg, policy_config.max_position_embeddings,
                             model=f"actor_rollout_ref.model.path={path!r}")
        return
    paths = [("actor_rollout_ref.model.path", path)]
    if needs_critic(cfg.algorithm.adv_estimator) and cfg.critic.model.path:
        paths.append(("critic.model.path", cfg.critic.model.path))
    for key, p in paths:
        found = read_model_config(p, cheap_only=True)
        if found is not None:
            check_context_length(cfg, found[0].get("max_position_embeddings"), model=f"{key}={p!r} ({found[1]})")


def _check_data_sources(cfg, train_rows, val_rows) -> None:
    """``jaxrl.rewards.check_data_sources`` on the first rows of the train and validation files; rows scored by
    running code need a working sandbox (``jaxrl.rewards.factory.check_sandbox``)."""
    from jaxrl.rewards import CHECKED_ROWS, check_data_sources
    from jaxrl.rewards.factory import check_sandbox

    custom = bool(cfg.custom_reward_function.path)
    # with a reward model that replaces the rule reward, rows marked style="model" never reach a rule function
    rm_only = (cfg.reward_model.enable and not needs_prm(cfg.algorithm.adv_estimator)
               and cfg.reward_model.combine == "replace")
    for key, loaded in (("train_files", train_rows), ("val_files", val_rows)):
        rows = loaded.rows if loaded is not None else []
        sources = [r.get("data_source") for r in rows[:CHECKED_ROWS]
                   if not (rm_only and (r.get("reward_model") or {}).get("style") == "model")]
        check_data_sources(sources, custom_reward=custom, origin=f"data.{key}={getattr(cfg.data, key)!r}")
        check_sandbox(cfg, sources)


def _load_policy(model_cfg):
    """The pretrained policy and its tokenizer (``model.tokenizer_path`` overrides the model's own)."""
    from jaxrl.models import load_pretrained, remat_setting

    pre = load_pretrained(
        model_cfg.path, param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype,
        remat=remat_setting(model_cfg),
    )
    tokenizer = pre.tokenizer
    if model_cfg.tokenizer_path:
        from jaxrl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_cfg.tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for model {model_cfg.path!r}; set actor_rollout_ref.model.tokenizer_path")
    return pre, tokenizer


def _prompt_pipelines(d, tokenizer, train_rows, val_rows, *, dynamic_sampling: bool = False):
    """The training prompt pipeline and the tokenised validation examples (``{"prompt_ids", "row"}``) from the
    ``LoadedRows`` of each split.

    With DAPO dynamic sampling each generation round reads ``data.gen_batch_size`` prompts; with PRIME
    ``data.oversample_factor`` x ``data.train_batch_size`` (1 x otherwise).
    """
    from jaxrl.data.pipeline import PromptPipeline

    common = dict(
        max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
        filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation, seed=d.seed,
    )
    batch_size = (d.gen_batch_size or d.train_batch_size) if dynamic_sampling else int(
        d.train_batch_size * d.oversample_factor)
    train = PromptPipeline(train_rows.rows, tokenizer, batch_size=batch_size, shuffle=d.shuffle,
                           origins=train_rows.origins, split="train", **common)
    if val_rows is None:
        return train, None
    val = PromptPipeline(val_rows.rows, tokenizer, batch_size=1, shuffle=False, origins=val_rows.origins,
                         split="val", **common)
    examples = [
        {"prompt_ids": ids, "row": row}
        for b in val.iter_batches_once(batch_size=64)
        for ids, row in zip(b.prompt_ids, b.rows)
    ]
    return train, examples


def _mesh_args(placement) -> dict:
    """``mesh=`` / ``rules=`` for a trained role: the train mesh and rules, or nothing (one device)."""
    return {} if placement is None else {"mesh": placement.train_mesh, "rules": placement.rules}


def _batch_plan(cfg, placement):
    """The run's :class:`~jaxrl.config.batch_plan.BatchPlan` for its data-parallel devices: the train mesh's batch
    shards (``*_micro_batch_size_per_gpu`` are per device, as in verl), 1 without a mesh."""
    from jaxrl.config.batch_plan import BatchPlan

    return BatchPlan.from_config(cfg, batch_shards=1 if placement is None else placement.batch_shards)


def lora_spec(model_section):
    """The :class:`jaxrl.models.lora.LoraSpec` of a model config section (``actor_rollout_ref.model`` /
    ``critic.model``), or None when ``lora_rank`` is 0."""
    from jaxrl.models.lora import LoraSpec

    if not model_section.lora_rank:
        return None
    return LoraSpec(rank=model_section.lora_rank, alpha=model_section.lora_alpha,
                    target_modules=model_section.target_modules,
                    exclude_modules=getattr(model_section, "exclude_modules", None))


def _apply_lora(model, spec, *, seed: int, key: str):
    """``jaxrl.models.lora.apply_lora`` with a target pattern that selects nothing (or the embedding) as a
    ConfigError (the pattern is checked against the loaded model's layers)."""
    from jaxrl.config import ConfigError
    from jaxrl.models.lora import apply_lora

    try:
        return apply_lora(model, spec, seed=seed, key=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _lora_meta(info) -> dict | None:
    """The checkpoint meta's LoRA entry (:func:`jaxrl.checkpoint.model_meta`), or None without LoRA."""
    if info is None:
        return None
    return {"rank": info.spec.rank, "alpha": info.spec.alpha, "targets": list(info.targets)}


def _build_actor_and_reference(cfg, graphdef, params, total_training_steps, placement=None):
    """The actor, and the frozen reference (a copy of the initial params) when a KL term needs it.

    With a placement both live on the train mesh; the reference's params take the actor's shardings. With LoRA
    (``actor_rollout_ref.model.lora_rank > 0``) the actor trains adapters on the frozen base ``params`` and the
    reference is that base with the adapters off: the actor's own frozen arrays, no copy.
    """
    import jax
    from flax import nnx

    from jaxrl.models.scan_layout import stack_layers
    from jaxrl.workers.actor import ActorWorker, LogProbComputer

    arr = cfg.actor_rollout_ref
    rollout_cfg = arr.rollout
    online_dpo = cfg.algorithm.dpo.enable
    needs_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or online_dpo
    spec = lora_spec(arr.model)  # with online DPO refused by the config checks (the preference role has no LoRA)
    plan = _batch_plan(cfg, placement)
    common = dict(plan=plan.actor, temperature=rollout_cfg.temperature, total_training_steps=total_training_steps,
                  seed=cfg.trainer.seed, fused_lm_head=arr.model.use_fused_kernels, **_mesh_args(placement))
    ref_params = None
    if spec is not None:
        model = nnx.merge(graphdef, params)  # the same arrays: the base stays shared, never copied
        adapters, info = _apply_lora(model, spec, seed=cfg.trainer.seed, key="actor_rollout_ref.model")
        lora_graphdef = nnx.graphdef(model)
        actor = ActorWorker(lora_graphdef, adapters, arr.actor, frozen=params, lora=info, **common)
        log.info("LoRA r=%d alpha=%g on %d modules: %d adapter parameters train, the %d base parameters are frozen",
                 spec.rank, spec.alpha, len(info.targets), sum(x.size for x in jax.tree.leaves(adapters)),
                 sum(x.size for x in jax.tree.leaves(params)))
        if needs_ref:
            ref_params = actor.frozen  # the base model with the adapters off (as verl's disable_adapter)
    else:
        if needs_ref:
            ref_params = jax.tree.map(lambda x: x.copy(), params)  # frozen copy: the actor's buffers are updated
        if online_dpo:
            actor = _build_preference_actor(cfg, graphdef, params, total_training_steps, placement)
        else:
            actor = ActorWorker(graphdef, params, arr.actor, ref_params=ref_params, **common)
    ref_graphdef = actor.base_graphdef
    if ref_params is not None and spec is None and actor.scan_layout:
        # the reference in the actor's layout (jaxrl.models.scan_layout): without a mesh the old-log-prob pass and
        # the reference's then run one compiled program
        ref_graphdef, ref_params = stack_layers(actor.base_graphdef, ref_params)
    if ref_params is not None and spec is None and placement is not None:
        from sharding import shard_state

        ref_params = shard_state(ref_params, actor.param_shardings if ref_graphdef == actor.graphdef
                                 else actor.base_param_shardings)
    actor.init_optimizer()  # now, so a checkpoint always has its state
    if ref_params is None:
        return actor, None
    ref = _Reference(LogProbComputer(ref_graphdef, micro_batch_size=plan.ref_log_prob_rows,
                                     temperature=rollout_cfg.temperature, remove_padding=plan.actor.remove_padding,
                                     share_prompts=plan.actor.share_prompts,
                                     max_token_len=plan.ref_max_token_len,
                                     max_token_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                                     **_mesh_args(placement)), ref_params)
    return actor, ref


def dpo_plan(cfg, placement):
    """Online DPO's batch sizes on the placement's data-parallel devices
    (:func:`jaxrl.config.batch_plan.online_dpo_plan`), checked."""
    from jaxrl.config import ConfigError
    from jaxrl.config.batch_plan import online_dpo_plan

    plan = online_dpo_plan(cfg, batch_shards=1 if placement is None else placement.batch_shards)
    try:
        plan.check()
    except ValueError as e:  # sizes that do not split over the train mesh's data-parallel devices
        raise ConfigError(f"algorithm.dpo.enable=True: {e}") from None
    return plan


def _build_preference_actor(cfg, graphdef, params, total_training_steps, placement):
    """Online DPO's actor (``algorithm.dpo.enable``): the policy trained with the preference loss on the best vs
    worst samples of each group (:class:`jaxrl.workers.preference.PreferenceWorker`, metrics under ``actor/``)."""
    from jaxrl.workers.preference import PreferenceWorker

    a = cfg.actor_rollout_ref.actor
    return PreferenceWorker(
        graphdef, params, cfg.algorithm.dpo, plan=dpo_plan(cfg, placement), optim=a.optim, grad_clip=a.grad_clip,
        temperature=cfg.actor_rollout_ref.rollout.temperature, total_training_steps=total_training_steps,
        name="actor", shuffle=a.shuffle, seed=cfg.trainer.seed, **_mesh_args(placement),
    )


def _build_rollout(cfg, model_cfg, graphdef, params, tokenizer, actor, placement):
    """The rollout engine and the ``WeightSync`` that feeds it (:func:`jaxrl.rollout.factory.start_rollout`): with a
    placement the engine starts on the actor's params (the JAX sampler: translated onto the rollout mesh by the
    initial sync), without one on the policy's own single-device params. ``graphdef`` is the model without LoRA
    adapters: engines get merged weights (:meth:`ActorWorker.merged_params`)."""
    from jaxrl.rollout.factory import start_rollout

    weight_sync = start_rollout(
        cfg, model_cfg, graphdef, _initial_rollout_params(actor, params, placement), tokenizer,
        mesh=placement.rollout_mesh if placement else None, rules=placement.rollout_rules if placement else None,
        split=placement is not None and placement.kind == "split",
    )
    engine = weight_sync.engine
    log.info("rollout engine %s: %s", cfg.actor_rollout_ref.rollout.name,
             getattr(engine, "engine_name", None) or type(engine).__name__)
    return engine, weight_sync


def _initial_rollout_params(actor, params, placement):
    """The weights the engine starts on: with a placement the actor's (translated by the initial sync); without one
    the actor's own arrays when it holds them in the scan layout (:meth:`ActorWorker.rollout_params`: the loaded
    per-layer ``params`` are then no longer referenced and freed), else ``params``."""
    if placement is not None:
        return actor.merged_params()
    return actor.rollout_params() if actor.scan_layout else params


def _build_critic(cfg, policy, total_training_steps, placement=None):
    """PPO's critic: a value model from ``critic.model.path`` or, when unset, from the policy's weights; with
    ``critic.model.lora_rank > 0`` LoRA adapters on its backbone (trained with the value head, the backbone frozen)."""
    from flax import nnx

    from jaxrl.models import remat_setting
    from jaxrl.models.value_model import build_value_model
    from jaxrl.workers.critic import CriticWorker

    cc = cfg.critic
    model = build_value_model(
        cc.model.path, policy, param_dtype=cc.model.param_dtype, dtype=cc.model.dtype,
        remat=remat_setting(cc.model), seed=cfg.trainer.seed,
    )
    frozen = None
    spec = lora_spec(cc.model)
    if spec is None:
        graphdef, params = nnx.split(model)
    else:  # adapters on the backbone; adapters and the value head train (PEFT's TOKEN_CLS modules_to_save)
        _apply_lora(model.backbone, spec, seed=cfg.trainer.seed, key="critic.model")
        head = nnx.Any(nnx.PathContains("value_head"), nnx.PathContains("value_bias"))
        graphdef, params, frozen = nnx.split(model, nnx.Any(nnx.LoRAParam, head), ...)
    critic = CriticWorker(
        graphdef, params, cc, plan=_batch_plan(cfg, placement).critic, total_training_steps=total_training_steps,
        seed=cfg.trainer.seed, frozen=frozen, **_mesh_args(placement),  # the critic follows the actor's mesh
    )
    critic.init_optimizer()
    return critic


def _build_reward(cfg):
    """The reward manager (``reward_model.reward_manager``) around the custom ``compute_score`` (imported and its
    signature checked now) or the built-in dispatcher; its scoring processes start with :meth:`start`."""
    from jaxrl.rewards import default_compute_score
    from jaxrl.rewards.factory import build_reward_manager

    return build_reward_manager(cfg, default_compute_score)


def _build_experience_maker(cfg, rollout, tokenizer, reward, reward_model):
    """The experience maker of the step's ``gen`` / ``reward`` phases, over the run's engine and reward."""
    from jaxrl.experience import ExperienceMaker

    rollout_cfg = cfg.actor_rollout_ref.rollout
    return ExperienceMaker(
        rollout=rollout, tokenizer=tokenizer, reward=reward, rollout_cfg=rollout_cfg,
        max_new_tokens=rollout_cfg.max_new_tokens or cfg.data.max_response_length, algorithm_cfg=cfg.algorithm,
        train_batch_size=cfg.data.train_batch_size, reward_model=reward_model,
        reward_model_combine=cfg.reward_model.combine, prompt_key=cfg.data.prompt_key,
        agent=_build_agent_loop(cfg, rollout, tokenizer) if rollout_cfg.multi_turn.enable else None,
        prime_filter=_prime_filter(cfg) if needs_prm(cfg.algorithm.adv_estimator) else None,
    )


def _prime_filter(cfg):
    """PRIME's prompt filter from ``data.*`` (:class:`jaxrl.experience.PrimeFilter`)."""
    from jaxrl.experience import PrimeFilter

    d = cfg.data
    return PrimeFilter(keep=d.train_batch_size, filter_accuracy=bool(d.filter_accuracy),
                       lower=d.accuracy_lower_bound, upper=d.accuracy_upper_bound,
                       filter_truncate=bool(d.filter_truncate))


def _build_prm(cfg, policy, graphdef, params, ref, total_training_steps, placement=None):
    """PRIME's implicit PRM (:class:`jaxrl.workers.prime_rm.ImplicitPRMWorker`): a causal LM from
    ``reward_model.model.path`` (null or the policy's path: a copy of the policy's initial weights), its frozen
    reference from ``reward_model.model.ref_path`` (null: the PRM's initial weights; when those are the policy's and
    the actor has a reference, its very arrays, no copy). Both must share the policy's vocabulary (they read its
    token ids). The sizes that do not fit the train mesh fail as a ConfigError."""
    import jax
    from flax import nnx

    from jaxrl.config import ConfigError
    from jaxrl.config.batch_plan import prime_plan
    from jaxrl.workers.prime_rm import ImplicitPRMWorker

    rm, arr = cfg.reward_model, cfg.actor_rollout_ref

    def load(path, key):
        if path is None or path == arr.model.path:
            return None
        from jaxrl.models import load_pretrained, remat_setting

        other = load_pretrained(path, param_dtype=arr.model.param_dtype, dtype=arr.model.dtype,
                                remat=remat_setting(arr.model), load_tokenizer=False)
        if other.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(f"{key}={path!r} has a vocabulary of {other.config.vocab_size} tokens but the policy "
                              f"{arr.model.path!r} has {policy.config.vocab_size}; the implicit PRM reads the policy's "
                              "token ids: use a model with the policy's tokenizer")
        return nnx.split(other.model)

    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)  # noqa: E731  (the actor's buffers are donated)
    loaded = load(rm.model.path, "reward_model.model.path")
    prm_graphdef, prm_params = (graphdef, copy(params)) if loaded is None else loaded
    if rm.model.ref_path is not None:
        ref_loaded = load(rm.model.ref_path, "reward_model.model.ref_path")
        ref_graphdef, ref_params = (graphdef, copy(params)) if ref_loaded is None else ref_loaded
    elif loaded is None and ref is not None and ref.log_prob.graphdef is not None:
        ref_graphdef, ref_params = ref.log_prob.graphdef, ref.params  # the actor's reference: the same weights
    else:
        ref_graphdef, ref_params = prm_graphdef, copy(prm_params)
    try:
        prm = ImplicitPRMWorker(
            prm_graphdef, prm_params, ref_graphdef, ref_params, rm,
            plan=prime_plan(cfg, batch_shards=1 if placement is None else placement.batch_shards),
            total_training_steps=total_training_steps, seed=cfg.trainer.seed, **_mesh_args(placement))
    except ValueError as e:  # sizes that do not split over the train mesh's data-parallel devices
        raise ConfigError(f"algorithm.adv_estimator=prime: {e}") from None
    prm.init_optimizer()  # now, so a checkpoint always has its state
    return prm


def _build_agent_loop(cfg, rollout, tokenizer):
    """The multi-turn loop (``rollout.multi_turn.enable``): the YAML's tools, the optional environment class."""
    from jaxrl.agent.loop import build_agent_loop

    return build_agent_loop(cfg.actor_rollout_ref.rollout.multi_turn, rollout, tokenizer,
                            max_prompt_length=cfg.data.max_prompt_length)


@dataclasses.dataclass
class _Reference:
    """The frozen reference policy: a :class:`LogProbComputer` bound to the initial params."""

    log_prob: object
    params: object

    def compute_log_probs(self, batch: RLBatch):
        return self.log_prob(self.params, batch)

