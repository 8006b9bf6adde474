"""Checks that tie sections together: verl's batch arithmetic, the device mesh, the options of the chosen
advantage estimator / policy loss, and the context length. The batch sizes come from one
:class:`~jaxrl.config.batch_plan.BatchPlan`. No jax import (device counts are checked by
:mod:`jaxrl.workers.placement`, which calls :func:`check_mesh_batch_sizes` once the mesh is known).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Iterable, Optional

from jaxrl.algorithms import registry
from jaxrl.config import compat, schema
from jaxrl.config.batch_plan import BatchPlan, RolePlan, online_dpo_plan, prime_plan, token_budgets
from jaxrl.config.checks import Checks, get, is_int
from jaxrl.config.errors import ConfigError
from jaxrl.config.schema import JaxRLConfig

__all__ = ["batch_mesh_axes", "check_context_length", "check_declared_options", "check_mesh_batch_sizes",
           "mesh_enabled", "mesh_sizes", "uneven_mini_batch_notes", "validate_cross", "validate_mesh"]


def validate_cross(cfg: JaxRLConfig) -> None:
    """verl's batch arithmetic (``ray_trainer._validate_config``, ``fsdp_workers``, ``ActorConfig.validate``)
    and other rules that tie two sections together."""
    d, t = cfg.data, cfg.trainer
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    world = t.n_gpus_per_node * t.nnodes
    world_s = f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes}"
    n = rollout.n
    plan = BatchPlan.from_config(cfg)
    _validate_program_budget(cfg)
    if not actor.recompute_old_log_prob:
        off_policy = []
        if actor.ppo_epochs != 1:
            off_policy.append(f"actor_rollout_ref.actor.ppo_epochs={actor.ppo_epochs} (needs 1)")
        if actor.ppo_mini_batch_size != d.train_batch_size:
            off_policy.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} (needs "
                              f"data.train_batch_size={d.train_batch_size}: one mini-batch per step)")
        if cfg.algorithm.use_kl_in_reward:
            off_policy.append("algorithm.use_kl_in_reward=True (the reward's KL needs the old log-probs)")
        if off_policy:
            raise ConfigError(
                "actor_rollout_ref.actor.recompute_old_log_prob=False is only exact when every update is on-policy; "
                f"got {'; '.join(off_policy)}. Set recompute_old_log_prob=True or change those keys"
            )
    if plan.rows_per_step % world:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} x actor_rollout_ref.rollout.n={n} = "
            f"{plan.rows_per_step} responses must split evenly over {world_s} = {world} devices"
        )
    if not cfg.algorithm.dpo.enable:  # online DPO's actor counts pairs: _validate_online_dpo
        _check_mini_batches(cfg, plan.actor)
    if registry.needs_critic(cfg.algorithm.adv_estimator):
        _check_mini_batches(cfg, plan.critic)
    if d.gen_batch_size != d.train_batch_size:
        if not cfg.algorithm.filter_groups.enable:
            raise ConfigError(
                f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size} "
                "but algorithm.filter_groups.enable=False; generation rounds of a different size only make "
                "sense with DAPO group filtering: set algorithm.filter_groups.enable=True or data.gen_batch_size=null"
            )
        if plan.gen_rows_per_round % world:
            raise ConfigError(
                f"data.gen_batch_size={d.gen_batch_size} x actor_rollout_ref.rollout.n={n} = "
                f"{plan.gen_rows_per_round} responses must split evenly over {world_s} = {world} devices"
            )
    if rollout.max_new_tokens > d.max_response_length:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_new_tokens={rollout.max_new_tokens} is invalid; expected "
            f"<= data.max_response_length={d.max_response_length} (the response buffer)"
        )
    longest = d.max_prompt_length + rollout.max_new_tokens
    critic_on = registry.needs_critic(cfg.algorithm.adv_estimator)
    for key, budget in token_budgets(cfg).items():
        if budget is not None and budget < longest and (critic_on or not key.startswith("critic.")):
            raise ConfigError(
                f"{key}={budget} is below the longest sequence, data.max_prompt_length={d.max_prompt_length} + "
                f"actor_rollout_ref.rollout.max_new_tokens={rollout.max_new_tokens} = {longest} tokens; valid: >= "
                f"{longest} (a token-budget micro-batch holds at least one whole sequence per device)"
            )
    # (a rollout pool of its own is checked against its own devices: jaxrl.ray_backend.check_rollout_pool)
    if rollout.name == "vllm" and not rollout.nnodes and world % rollout.tensor_model_parallel_size:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must "
            f"divide the {world} devices ({world_s}) for rollout.name={rollout.name!r}"
        )
    if rollout.name == "jetstream" and rollout.dtype not in (None, cfg.actor_rollout_ref.model.dtype):
        raise ConfigError(
            f"actor_rollout_ref.rollout.dtype={rollout.dtype!r} differs from actor_rollout_ref.model.dtype="
            f"{cfg.actor_rollout_ref.model.dtype!r}, which rollout.name='jetstream' computes in; set "
            "rollout.dtype=null or use rollout.name=jax (or vllm)"
        )
    if d.val_files is None and (t.val_before_train or t.test_freq > 0):
        raise ConfigError(
            f"data.val_files=None but validation is on (trainer.val_before_train={t.val_before_train}, "
            f"trainer.test_freq={t.test_freq}); set data.val_files, or trainer.val_before_train=False "
            "and trainer.test_freq=-1"
        )
    if cfg.actor_rollout_ref.model.use_fused_kernels and actor.use_kl_loss and actor.kl_loss_type == "full":
        raise ConfigError(
            "actor_rollout_ref.model.use_fused_kernels=True computes the update's log-probs without the whole logits, "
            "but actor_rollout_ref.actor.kl_loss_type='full' needs them; set use_fused_kernels=False or another "
            "kl_loss_type"
        )
    if cfg.algorithm.dpo.enable:
        _validate_online_dpo(cfg)
    _validate_prime(cfg)
    _validate_async(cfg)
    vk = rollout.val_kwargs
    if vk.do_sample and vk.temperature <= 0:
        raise ConfigError(
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True needs "
            f"actor_rollout_ref.rollout.val_kwargs.temperature > 0; got {vk.temperature!r}"
        )


def _validate_prime(cfg: JaxRLConfig) -> None:
    """PRIME (an estimator that reads the implicit PRM's ``rm_scores``, ``algorithm.adv_estimator=prime``): the
    accuracy filter is PRIME's only; what PRIME does not combine with; the PRM's batch arithmetic
    (:func:`~jaxrl.config.batch_plan.prime_plan`)."""
    arr, alg, d = cfg.actor_rollout_ref, cfg.algorithm, cfg.data
    if not registry.needs_prm(alg.adv_estimator):
        used = [text for on, text in (
            (d.filter_accuracy, f"data.filter_accuracy={d.filter_accuracy}"),
            (d.oversample_factor != 1.0, f"data.oversample_factor={d.oversample_factor}"),
            (d.filter_truncate, f"data.filter_truncate={d.filter_truncate}"),
        ) if on]
        if used:
            raise ConfigError(f"{'; '.join(used)} filter prompts for PRIME only (verl's recipe/prime); set "
                              f"algorithm.adv_estimator=prime, or leave them null (now {alg.adv_estimator!r})")
        return
    why = f"algorithm.adv_estimator={alg.adv_estimator!r} (PRIME)"
    rm = cfg.reward_model
    tok = rm.model.input_tokenizer
    refused = [
        (alg.use_kl_in_reward, "algorithm.use_kl_in_reward=True (PRIME's advantage reads the outcome scores and the "
         "PRM's process rewards; use actor_rollout_ref.actor.use_kl_loss for a KL term)"),
        (alg.dpo.enable, "algorithm.dpo.enable=True"),
        (alg.filter_groups.enable, "algorithm.filter_groups.enable=True (PRIME filters groups with "
         "data.filter_accuracy / accuracy_lower_bound / accuracy_upper_bound)"),
        (arr.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=True"),
        (tok is not None and tok != arr.model.path, f"reward_model.model.input_tokenizer={tok!r} (the implicit PRM "
         "reads the policy's token ids: null or the policy's path)"),
    ]
    bad = [text for on, text in refused if on]
    if bad:
        raise ConfigError(f"{why} does not combine with {'; '.join(bad)}; set those keys off")
    kept = d.train_batch_size * d.oversample_factor
    if int(kept) != kept:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} x data.oversample_factor={d.oversample_factor} "
                          "must be a whole number of prompts (generated per step)")
    try:
        prime_plan(cfg).check()
    except ValueError as e:
        raise ConfigError(f"{why}: {e}") from None


def _validate_program_budget(cfg: JaxRLConfig) -> None:
    """``trainer.max_compiled_prompt_widths`` (:mod:`jaxrl.program_budget`): null or an int >= 1, and not with the
    asynchronous pipeline, whose generation thread compiles and runs programs while the update runs."""
    mcw = cfg.trainer.max_compiled_prompt_widths
    if mcw is None:
        return
    if isinstance(mcw, bool) or not isinstance(mcw, int) or mcw < 1:
        raise ConfigError(f"trainer.max_compiled_prompt_widths={mcw!r} is invalid; valid: null (keep every compiled "
                          "program) or an int >= 1")
    if cfg.async_training.staleness:
        raise ConfigError(f"trainer.max_compiled_prompt_widths={mcw} does not work with async_training.staleness="
                          f"{cfg.async_training.staleness} (the generation thread compiles and runs programs while the "
                          "update runs); set it to null")


def _validate_async(cfg: JaxRLConfig) -> None:
    """``async_training``: a non-negative ``staleness``; the pipeline runs the in-process JAX engines (the embedded
    sampler, JetStream: its thread shares the process's devices with the trainer; vLLM runs its own engine loop, in a
    worker process under split placement, and is refused); partial rollouts need
    staleness >= 2 stages and single-round, single-turn generation."""
    a = cfg.async_training
    if a.staleness < 0:
        raise ConfigError(f"async_training.staleness={a.staleness} is invalid; valid: 0 (synchronous) or k >= 1 (a "
                          "trained batch is at most k policy versions old)")
    name = cfg.actor_rollout_ref.rollout.name
    if a.partial_rollout:
        width = cfg.actor_rollout_ref.rollout.max_new_tokens or cfg.data.max_response_length
        why = "async_training.partial_rollout=True"
        if a.staleness < 2:
            raise ConfigError(f"{why} generates each batch in async_training.staleness stages, one per step; it needs "
                              f"staleness >= 2 (got {a.staleness}; with 1 a batch is generated within one step)")
        if width < a.staleness:
            raise ConfigError(f"{why}: {width} response tokens cannot be cut into async_training.staleness="
                              f"{a.staleness} stages; valid: staleness <= {width}")
        refused = [
            (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=True (DAPO's rounds are generated "
             "until the batch is full)"),
            (cfg.actor_rollout_ref.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=True"),
            (registry.needs_prm(cfg.algorithm.adv_estimator), f"algorithm.adv_estimator="
             f"{cfg.algorithm.adv_estimator!r} (PRIME oversamples and filters its rounds)"),
        ]
        bad = [text for on, text in refused if on]
        if bad:
            raise ConfigError(f"{why} does not combine with {'; '.join(bad)}; set those keys off")
    if a.staleness and name not in ("jax", "jetstream"):
        raise ConfigError(f"async_training.staleness={a.staleness} needs an in-process JAX engine, "
                          f"actor_rollout_ref.rollout.name='jax' (the embedded sampler) or 'jetstream'; got {name!r}. "
                          "Use one of those or async_training.staleness=0")


# ------------------------------------------------------------------------------ device mesh
def _validate_online_dpo(cfg: JaxRLConfig) -> None:
    """``algorithm.dpo.enable``: what online DPO needs (several samples per prompt, mini-batches of whole pairs) and
    what it replaces (the critic, the KL terms, DAPO's filter) or does not support (packed rows, token budgets,
    multi-turn rollouts, LoRA)."""
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    a = arr.actor
    why = "algorithm.dpo.enable=True"
    if arr.rollout.n < 2:
        raise ConfigError(f"{why} pairs the best and the worst of each prompt's samples: "
                          f"actor_rollout_ref.rollout.n={arr.rollout.n} must be >= 2")
    refused = [
        (registry.needs_critic(alg.adv_estimator), f"algorithm.adv_estimator={alg.adv_estimator!r} (a critic: DPO "
         "computes no advantages)"),
        (a.use_kl_loss, "actor_rollout_ref.actor.use_kl_loss=True (DPO's beta is its KL term)"),
        (alg.use_kl_in_reward, "algorithm.use_kl_in_reward=True (DPO's beta is its KL term)"),
        (alg.filter_groups.enable, "algorithm.filter_groups.enable=True (DPO skips groups without a preference)"),
        (arr.model.use_remove_padding, "actor_rollout_ref.model.use_remove_padding=True (pairs run on padded rows)"),
        (a.use_dynamic_bsz, "actor_rollout_ref.actor.use_dynamic_bsz=True (pairs run on fixed micro-batches)"),
        (a.use_prefix_grouper, "actor_rollout_ref.actor.use_prefix_grouper=True (pairs run on padded rows)"),
        (arr.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=True"),
        (arr.model.lora_rank > 0, f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank} (the preference role "
         "trains the full model: LoRA is for the GRPO / PPO actor; lora_rank=0 is valid)"),
    ]
    bad = [text for on, text in refused if on]
    if bad:
        raise ConfigError(f"{why} does not combine with {'; '.join(bad)}; set those keys off")
    mini, micro = a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu
    if micro is not None and mini % micro:
        raise ConfigError(
            f"{why}: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} counts pairs and must divide "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} (pairs per update); valid: {_divisors(mini)}")


def mesh_enabled(cfg: JaxRLConfig) -> bool:
    """True when the run trains on a device mesh: any ``trainer.mesh`` axis is set, or ``trainer.placement`` is
    ``"split"``. False = every role on one device (the single-device run)."""
    m = cfg.trainer.mesh
    return cfg.trainer.placement == "split" or any(v is not None for v in (m.data, m.fsdp, m.tensor))


def mesh_sizes(cfg: JaxRLConfig) -> dict[str, int]:
    """``trainer.mesh`` with unset axes filled: ``{"data": d, "fsdp": f, "tensor": t}``.

    Unset (null) axes are 1, except ``fsdp``, which is -1 (fill the remaining devices) unless another axis is -1.
    """
    m = cfg.trainer.mesh
    data = 1 if m.data is None else m.data
    tensor = 1 if m.tensor is None else m.tensor
    fsdp = m.fsdp if m.fsdp is not None else (1 if -1 in (data, tensor) else -1)
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


_DEFAULT_BATCH_AXES: tuple[str, ...] = ("data", "fsdp")  # sharding.rules.DEFAULT_RULES["batch"]


def batch_mesh_axes(cfg: JaxRLConfig) -> tuple[str, ...]:
    """The mesh axes that split batch rows: ``trainer.sharding_rules["batch"]`` if given, else ``(data, fsdp)``."""
    rules = cfg.trainer.sharding_rules or {}
    if "batch" not in rules:
        return _DEFAULT_BATCH_AXES
    v = rules["batch"]
    return () if v is None else ((v,) if isinstance(v, str) else tuple(v))


def check_mesh_batch_sizes(cfg: JaxRLConfig, sizes: dict[str, int]) -> None:
    """verl's per-device batch arithmetic on the train mesh's data-parallel devices.

    As in verl, a ``*_micro_batch_size_per_gpu`` value is the rows each data-parallel device takes per
    micro-batch; on a mesh the data-parallel devices are its batch shards (the axes the ``"batch"`` rule splits rows
    over, ``data x fsdp`` by default), so one micro-batch is ``value x shards`` rows
    (:func:`jaxrl.config.batch_plan.micro_rows`). ``ppo_mini_batch_size`` stays global (prompts per optimizer
    update); as verl's ``fsdp_workers`` normalise it, each trained role's mini-batch must split evenly over the
    shards and the per-device micro-batch must divide each device's share. An unset size stands for a global row
    count (the whole mini-batch, a whole step, ...), which must split over the shards too. The sizes are the
    :class:`~jaxrl.config.batch_plan.BatchPlan`'s for these shards (:meth:`BatchPlan.micro_batches`).

    Args:
      cfg: the loaded config.
      sizes: resolved mesh sizes ``{"data", "fsdp", "tensor"}`` (no -1).

    Raises:
      ConfigError: names the key, its per-device value, the data-parallel size (and the mesh axes behind it), the
        global rows and the valid values.
    """
    axes = batch_mesh_axes(cfg)
    shards = math.prod(sizes[a] for a in axes)
    if shards <= 1:
        return
    critic = registry.needs_critic(cfg.algorithm.adv_estimator)
    prime = registry.needs_prm(cfg.algorithm.adv_estimator)
    plan = BatchPlan.from_config(cfg, batch_shards=shards)
    dp_s = f"{shards} data-parallel devices (trainer.mesh " + " x ".join(f"{a}={sizes[a]}" for a in axes) + ")"
    n = plan.rollout_n
    dpo = cfg.algorithm.dpo.enable
    actor = online_dpo_plan(cfg, batch_shards=shards) if dpo else plan.actor
    for role in [actor] + ([plan.critic] if critic else []):
        mini_s = (f"{role.section}.ppo_mini_batch_size={role.mini_batch_size} pairs" if role is actor and dpo else
                  f"{role.section}.ppo_mini_batch_size={role.mini_batch_size} x actor_rollout_ref.rollout.n={n} = "
                  f"{role.mini_batch_rows} responses")
        if role.mini_batch_rows % shards:
            raise ConfigError(
                f"{mini_s} per mini-batch do not split over the {dp_s}; ppo_mini_batch_size counts prompts over all "
                f"devices, each device takes mini-batch / {shards}: valid: ppo_mini_batch_size x rollout.n a multiple "
                f"of {shards}"
            )
        per_gpu, per_device = role.micro_batch_size_per_gpu, role.per_device_mini_batch_rows
        if per_gpu is not None and role.max_token_len is None and per_device % per_gpu:
            raise ConfigError(
                f"{role.micro_key}={per_gpu} (rows per device, as in verl) must divide the per-device mini-batch: "
                f"{mini_s} / {dp_s} = {per_device}; a micro-batch is {per_gpu} x {shards} = {per_gpu * shards} rows "
                f"on the mesh; valid: a divisor of {per_device}"
            )
    if prime:
        try:
            prime_plan(cfg, batch_shards=shards).check()
        except ValueError as e:
            raise ConfigError(f"algorithm.adv_estimator=prime on {dp_s}: {e}") from None
    for mb in plan.micro_batches(critic=critic, reward_model=cfg.reward_model.enable and not prime):
        if mb.rows % shards:  # only an unset value's fallback can miss: a set one is per device
            raise ConfigError(
                f"{mb.key}=null stands for {mb.unset_means}: {mb.rows} rows per call, which do not split over the "
                f"{dp_s}; set {mb.key} (rows per device; a call then takes that x {shards} rows)"
            )


def validate_mesh(cfg: JaxRLConfig, c: Checks) -> None:
    """``trainer.mesh``, ``trainer.placement``, ``trainer.rollout_devices``, ``trainer.sharding_rules``: the checks
    that need no devices (device counts are checked when the run is built, by ``jaxrl.workers.placement``)."""
    t = cfg.trainer
    c.choice("trainer.placement", schema.PLACEMENT_CHOICES)
    for axis in schema.MESH_AXIS_CHOICES:
        c.int_at_least(f"trainer.mesh.{axis}", 1, off=-1, nullable=True)
    sizes = mesh_sizes(cfg)
    if sum(v == -1 for v in sizes.values()) > 1:
        raise ConfigError(
            f"trainer.mesh {sizes} (unset axes filled) has more than one axis set to -1; at most one axis may fill "
            "the remaining devices"
        )
    if t.placement == "split":
        v = t.rollout_devices
        if not (is_int(v) and v >= 1):
            c.fail("trainer.rollout_devices", "an int >= 1 with trainer.placement='split' (how many devices, taken "
                   "from the end of jax.devices(), the rollout engine gets)")
    elif t.rollout_devices is not None:
        c.fail("trainer.rollout_devices", "null unless trainer.placement='split' (colocated rollout uses the train "
               "devices)")
    validate_sharding_rules(t.sharding_rules)
    if mesh_enabled(cfg) and all(sizes[a] != -1 for a in batch_mesh_axes(cfg)):
        check_mesh_batch_sizes(cfg, sizes)


def validate_sharding_rules(rules: Any) -> None:
    """``trainer.sharding_rules``: a mapping of known logical axes to mesh axes (raises ConfigError)."""
    key = "trainer.sharding_rules"
    if rules is None:
        return
    if not isinstance(rules, dict):
        raise ConfigError(f"{key}={rules!r} is invalid; expected a mapping {{logical axis: mesh axis | [mesh axes] "
                          "| null}}, e.g. {embed: null}")
    axes = ", ".join(repr(a) for a in schema.MESH_AXIS_CHOICES)
    for name, value in rules.items():
        if name not in schema.LOGICAL_AXIS_CHOICES:
            guess = difflib.get_close_matches(str(name), schema.LOGICAL_AXIS_CHOICES, n=1)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ConfigError(f"{key} has an unknown logical axis {name!r}; {hint}valid: "
                              + ", ".join(repr(a) for a in schema.LOGICAL_AXIS_CHOICES))
        items = [] if value is None else ([value] if isinstance(value, str) else value)
        if not isinstance(items, list) or any(a not in schema.MESH_AXIS_CHOICES for a in items) \
                or len(set(items)) != len(items):
            raise ConfigError(f"{key}.{name}={value!r} is invalid; expected null (replicated), a mesh axis "
                              f"({axes}) or a list of distinct mesh axes")

def _check_mini_batches(cfg: JaxRLConfig, role: RolePlan) -> None:
    """verl's mini/micro-batch arithmetic for one trained role (``actor_rollout_ref.actor`` or ``critic``)."""
    d, t = cfg.data, cfg.trainer
    section, mini, micro, n = role.section, role.mini_batch_size, role.micro_batch_size_per_gpu, role.rollout_n
    world = t.n_gpus_per_node * t.nnodes
    world_s = f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes}"
    if d.train_batch_size < mini:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini} is invalid; expected "
            f"<= data.train_batch_size={d.train_batch_size} (both count prompts)"
        )
    per_device = role.mini_batch_rows // world
    if per_device < 1:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini} x "
            f"actor_rollout_ref.rollout.n={n} = {role.mini_batch_rows} responses per mini-batch is fewer "
            f"than the {world} devices ({world_s}); expected at least one response per device"
        )
    if micro is not None and role.max_token_len is None and per_device % micro:  # unused under a token budget
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu={micro} must divide the per-device mini-batch "
            f"{section}.ppo_mini_batch_size={mini} x "
            f"actor_rollout_ref.rollout.n={n} / {world} devices = {per_device} responses; "
            f"valid: a divisor of {per_device}"
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def uneven_mini_batch_notes(cfg: JaxRLConfig) -> list[compat.CompatNote]:
    """One note per trained role whose ``ppo_mini_batch_size`` does not divide ``data.train_batch_size``.

    verl's FSDP actor/critic accept it (``DataProto.split`` leaves a smaller last mini-batch; verl's own
    Qwen3-1.7B GSM8K recipe uses 1024 / 80), its Megatron workers refuse it (``DataProto.make_iterator`` asserts
    divisibility). jaxrl runs it like verl's FSDP workers but says so: the last update of every step is made from
    fewer prompts. The note lists the mini-batch sizes that split the batch evenly and pass the micro-batch rules.
    """
    notes = []
    plan = BatchPlan.from_config(cfg)
    roles = [plan.actor] + ([plan.critic] if registry.needs_critic(cfg.algorithm.adv_estimator) else [])
    tbs = plan.train_batch_size
    for role in roles:
        section, mini = role.section, role.mini_batch_size
        if tbs % mini == 0:
            continue
        valid = []
        for k in _divisors(tbs):
            try:
                _check_mini_batches(cfg, role.with_mini_batch_size(k))
            except ConfigError:
                continue
            valid.append(k)
        fix = (f"for equal updates use one of {valid}" if valid else
               f"no divisor of {tbs} also fits {role.micro_key}={role.micro_batch_size_per_gpu}; change it too")
        notes.append(compat.CompatNote(
            f"{section}.ppo_mini_batch_size", mini,
            f"does not divide data.train_batch_size={tbs}: each step makes {tbs // mini} update(s) of {mini} prompts "
            f"and a last one of {tbs % mini} (as verl's FSDP workers do; its Megatron workers refuse this); {fix}",
        ))
    return notes


# ------------------------------------------------------------------------------ estimator / loss options
# Where each kind's options live in the config: the option name is the key's last segment.
_OPTION_SECTIONS = (
    # (registry, the key that selects the function, the section of its options, the option keys)
    (registry.ADV_ESTIMATORS, "algorithm.adv_estimator", "algorithm",
     ("norm_adv_by_std_in_grpo", "adv_std_epsilon", "gamma", "lam", "reward_dpo_coef", "reward_gt_coef")),
    (registry.POLICY_LOSSES, "actor_rollout_ref.actor.policy_loss.loss_mode", "actor_rollout_ref.actor.policy_loss",
     tuple(f.name for f in dataclasses.fields(schema.PolicyLossConfig) if f.name != "loss_mode")),
    (registry.PREFERENCE_LOSSES, "algorithm.dpo.loss_type", "algorithm.dpo", ("label_smoothing",)),
)


def check_declared_options(cfg: JaxRLConfig, given: Iterable[str], *, option_sections=None) -> None:
    """A configured option the chosen estimator / policy loss does not take is an error (it would be ignored).

    The options of each function are declared in :mod:`jaxrl.algorithms.registry`. An option key counts as
    configured when the YAML file or an override sets it (``given``) to a value other than the schema default: a
    value equal to the default changes nothing, and a full dumped config (``--print-config``) loads back.

    Args:
      cfg: the validated config.
      given: the dotted keys the file and the overrides set.
      option_sections: ``(registry, select key, options section, option keys)`` tuples to check (default: the RL
        config's estimator, policy loss and preference loss); the defaults are read from ``type(cfg)()``.

    Raises:
      ConfigError: names the option, its value, the chosen function and the options it takes (and which registered
        functions take that option); or a registered function declares an option that is no config key.
    """
    given = set(given)
    for reg, select_key, section, option_keys in (_OPTION_SECTIONS if option_sections is None else option_sections):
        name = get(cfg, select_key)
        entry = reg.entry(name)
        unknown = [o for o in entry.options if o not in option_keys]
        if unknown:
            raise ConfigError(
                f"{select_key}={name!r}: the {reg.kind} declares the option {unknown[0]!r}, which is no key under "
                f"{section}; registered options must be among: {', '.join(option_keys)}"
            )
        defaults = _section_defaults(section, type(cfg))
        for option in option_keys:
            key = f"{section}.{option}"
            value = get(cfg, key)
            if key not in given or option in entry.options or value == defaults[option]:
                continue
            takes = ", ".join(reg.takes(option)) or "none"
            own = ", ".join(entry.options) or "none"
            raise ConfigError(
                f"{key}={value!r} is set, but {select_key}={name!r} does not take it (the options of {name!r}: {own}); "
                f"remove it, or pick one that takes it ({takes})"
            )


def _section_defaults(section: str, root: type = schema.JaxRLConfig) -> dict[str, Any]:
    """The schema defaults of a config section's fields (``"algorithm"`` -> :class:`AlgorithmConfig`'s)."""
    obj: Any = root()
    for part in section.split("."):
        obj = getattr(obj, part)
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def check_context_length(cfg: JaxRLConfig, max_position_embeddings: Optional[int], *, model: str) -> None:
    """Prompt + generated tokens must fit the model's context.

    A sequence is at most ``data.max_prompt_length + actor_rollout_ref.rollout.max_new_tokens`` tokens
    (``max_new_tokens`` is filled from ``data.max_response_length``); a model is trained for
    ``max_position_embeddings`` positions (vLLM refuses a longer ``max_model_len`` for the same reason).

    Args:
      cfg: the validated config.
      max_position_embeddings: the model's context length (from its ``config.json`` / GGUF / llama2.c header);
        None skips the check.
      model: how to name the model in the message (its key, path and config file).

    Raises:
      ConfigError: the sum exceeds ``max_position_embeddings`` (names both keys, their values and the limit).
    """
    if max_position_embeddings is None:
        return
    d, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    new = rollout.max_new_tokens
    new_key = ("data.max_response_length" if new == d.max_response_length
               else "actor_rollout_ref.rollout.max_new_tokens")
    total = d.max_prompt_length + new
    if total > max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length={d.max_prompt_length} + {new_key}={new} = {total} tokens exceed the model's "
            f"context of {max_position_embeddings} tokens (max_position_embeddings of {model}); lower them so the "
            f"sum is at most {max_position_embeddings}"
        )
