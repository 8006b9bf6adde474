"""verl keys with no JAX meaning: accepted, each with a one-line note saying what it maps to.

Three tables, all keyed by full dotted verl keys:

* :data:`NOTES` ``{key or fnmatch pattern: note}``. An exact key may also be a real
  :class:`~jaxrl.config.schema.JaxRLConfig` field (e.g. ``actor_rollout_ref.rollout.
  gpu_memory_utilization``): the value is kept and the note says who uses it. A key that is not a
  schema field is dropped after its note. Wildcard patterns (``*``) only ever match keys that are
  *not* schema fields, so a typo of a real key is never swallowed by a pattern.
* :data:`REQUIRED_VALUES` ``{key: allowed values}``: verl features jaxrl does not implement; the key
  is accepted only with verl's no-op value, anything else is a config error.
* :data:`RENAMES` ``{old verl key: jaxrl key}``: verl's older spellings; the value moves to the new key.

The loader applies the tables; ``python -m jaxrl.train`` prints one note line per key to stderr.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

_FSDP = (
    "JAX: params/optimizer sharded over the mesh `fsdp` axis (trainer.mesh, sharding issue); "
    "offload not applicable"
)
_COMPILE = "JAX always jit-compiles with XLA; torch.compile does not apply"
_STRATEGY = "JAX runs one jit-compiled SPMD program per step; verl's fsdp/megatron strategies do not apply"
_DYN_BSZ = (
    "token-budget micro-batches cover the actor, reference and critic; the reward model uses "
    "reward_model.micro_batch_size_per_gpu"
)
_SP = "Ulysses sequence parallelism is not implemented (a future mesh axis); only 1 is valid"
_ENTROPY_MEM = "torch memory tweak; XLA fuses the entropy computation"
_PROFILER = "verl's profiler settings do not apply; use jax.profiler / XProf"
_VLLM_TUNING = "vLLM/SGLang engine tuning; not used by jaxrl's rollout backends"
_KERNELS = "XLA fuses kernels; Liger/Triton/flash kernels do not apply"
_CRITIC_TOKENIZER = "the critic scores the actor's token ids; it loads no tokenizer of its own"
_CRITIC_ENABLE = "jaxrl builds and trains the critic exactly when algorithm.adv_estimator=gae"
_CRITIC_ROLLOUT_N = "the critic always uses actor_rollout_ref.rollout.n responses per prompt"
_REWARD_LOOP = (
    "reward managers are chosen by name (reward_model.reward_manager: naive, prime, dapo, batch); "
    "user-defined manager classes are not supported"
)
_RM_PLACE = "jaxrl runs the reward model as a jitted Flax model on the train mesh; no separate resource pool"
_RM_LOOP = ("verl's reward-loop server (vLLM/SGLang) settings; jaxrl scores the reward model in-process on the train "
            "mesh, as verl's RewardModelWorker does")
_RAY = ("verl's Ray worker-group / NCCL settings do not apply: jaxrl's Ray launcher (trainer.launcher=ray) runs one "
        "JAX process per host and has its own trainer.ray.* keys")
_LORA_ADAPTER = ("loading a pre-trained LoRA adapter is not supported; adapters start fresh (B = 0) with "
                 "lora_rank > 0, so only null is valid")
_DEPRECATED_MBS = "verl's deprecated global micro-batch size; use the *_per_gpu key instead"

NOTES: dict[str, str] = {
    # ---- schema fields kept for verl parity, meaningful only to some backends
    "actor_rollout_ref.rollout.gpu_memory_utilization": (
        "used by vLLM (rollout.name=vllm) for its KV-cache share; the jax sampler sizes its cache from shapes"
    ),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (
        "used by vLLM, and by the jax sampler / JetStream engine only when a mesh is on (trainer.mesh / "
        "trainer.placement=split): their tensor-parallel degree over the rollout devices"
    ),
    # ---- FSDP / torch engine settings
    "actor_rollout_ref.actor.fsdp_config.*": _FSDP,
    "actor_rollout_ref.ref.fsdp_config.*": _FSDP,
    "actor_rollout_ref.actor.strategy": _STRATEGY,
    "actor_rollout_ref.ref.strategy": _STRATEGY,
    "actor_rollout_ref.actor.use_torch_compile": _COMPILE,
    "actor_rollout_ref.ref.use_torch_compile": _COMPILE,
    "actor_rollout_ref.actor.use_remove_padding": (
        "verl derives it from actor_rollout_ref.model.use_remove_padding; jaxrl reads only that key (set it there)"
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _SP,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": _SP,
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": _ENTROPY_MEM,
    "actor_rollout_ref.actor.entropy_checkpointing": _ENTROPY_MEM,
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": _ENTROPY_MEM,
    "actor_rollout_ref.ref.entropy_checkpointing": _ENTROPY_MEM,
    "actor_rollout_ref.actor.ppo_micro_batch_size": _DEPRECATED_MBS,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _DEPRECATED_MBS,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": _DEPRECATED_MBS,
    "actor_rollout_ref.actor.checkpoint.*": "checkpoint contents are not configurable in jaxrl; ignored",
    "actor_rollout_ref.ref.model": "the reference policy is always the initial actor model",
    # ---- optimizer
    "actor_rollout_ref.actor.optim.total_training_steps": "set at run time from trainer.total_training_steps",
    "actor_rollout_ref.actor.optim.optimizer": "jaxrl's optimizer is optax.adamw; only AdamW is valid",
    "actor_rollout_ref.actor.optim.optimizer_impl": "jaxrl's optimizer is optax.adamw; torch modules do not apply",
    "actor_rollout_ref.actor.optim.override_optimizer_config": "no extra optimizer kwargs in jaxrl; only null is valid",
    "actor_rollout_ref.actor.optim.num_cycles": "jaxrl's cosine schedule is the half cosine; only 0.5 is valid",
    # ---- model loading
    "actor_rollout_ref.model.use_shm": (
        "models load from local files; no shared-memory copy (with LoRA the base model is read once and shared by "
        "the actor and the reference)"
    ),
    "actor_rollout_ref.model.trust_remote_code": "jaxrl runs its own Flax model code; no remote code is executed",
    "actor_rollout_ref.model.external_lib": "jaxrl runs its own Flax model code; no HF model classes are imported",
    "actor_rollout_ref.model.enable_activation_offload": (
        "use actor_rollout_ref.model.enable_gradient_checkpointing (jax.checkpoint); offload does not apply"
    ),
    "actor_rollout_ref.model.use_liger": _KERNELS,
    "actor_rollout_ref.model.fused_kernel_options.*": _KERNELS,
    "actor_rollout_ref.model.lora_adapter_path": _LORA_ADAPTER,
    # ---- rollout engine
    "actor_rollout_ref.rollout.mode": "verl's sync/async rollout-server mode; jaxrl calls its rollout backend directly",
    "actor_rollout_ref.rollout.enforce_eager": _VLLM_TUNING,
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": _VLLM_TUNING,
    "actor_rollout_ref.rollout.free_cache_engine": (
        "used by vLLM (rollout.name=vllm) on CUDA: sleep/wake around each rollout; the jax sampler and vLLM's CPU "
        "platform (no sleep mode) ignore it"
    ),
    "actor_rollout_ref.rollout.max_num_batched_tokens": _VLLM_TUNING,
    "actor_rollout_ref.rollout.max_model_len": _VLLM_TUNING,
    "actor_rollout_ref.rollout.disable_log_stats": _VLLM_TUNING,
    "actor_rollout_ref.rollout.enable_chunked_prefill": _VLLM_TUNING,
    "actor_rollout_ref.rollout.load_format": _VLLM_TUNING,
    "actor_rollout_ref.rollout.layered_summon": (
        "verl gathers FSDP shards layer by layer to sync (LoRA-merged) weights; jaxrl merges LoRA in one jitted "
        "program on the train mesh and its translator moves the merged weights"
    ),
    "actor_rollout_ref.rollout.multi_stage_wake_up": _VLLM_TUNING,
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": _VLLM_TUNING,
    "actor_rollout_ref.rollout.engine_kwargs.*": _VLLM_TUNING,
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": (
        "verl's interaction classes are not read; jaxrl's interactive turns come from multi_turn.env_class "
        "(a jaxrl.agent.env.Environment)"
    ),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": (
        "jaxrl always renders tool/user turns with the model's own chat template (apply_chat_template)"
    ),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": (
        "jaxrl keeps the model's generated ids as sampled (never re-tokenized), so there is nothing to check"
    ),
    "actor_rollout_ref.rollout.multi_turn.*": "verl multi-turn setting with no jaxrl meaning; ignored",
    "actor_rollout_ref.rollout.agent.*": "verl's agent-loop server settings; not used by jaxrl",
    "actor_rollout_ref.rollout.trace.*": "verl's rollout tracing (mlflow/weave); not used by jaxrl",
    "actor_rollout_ref.hybrid_engine": _RAY,
    "actor_rollout_ref.nccl_timeout": _RAY,
    # ---- data loading
    "data.dataloader_num_workers": "jaxrl's data pipeline runs in-process; the worker count is not used",
    "data.filter_overlong_prompts_workers": "overlong-prompt filtering runs in-process; the worker count is not used",
    "data.use_shm": "datasets load from local files; no shared-memory copy",
    "data.trust_remote_code": "jaxrl runs no remote tokenizer code",
    "data.return_raw_input_ids": (
        "jaxrl keeps the raw prompt with every sample; the reward model re-tokenizes from it "
        "(reward_model.model.input_tokenizer)"
    ),
    "data.return_raw_chat": "jaxrl keeps the raw prompt with every sample; nothing to switch on",
    "data.return_full_prompt": "jaxrl keeps the full prompt text with every sample; nothing to switch on",
    "data.return_multi_modal_inputs": "text-only data; multi-modal inputs are not supported",
    "data.image_key": "text-only data; multi-modal inputs are not supported",
    "data.video_key": "text-only data; multi-modal inputs are not supported",
    "data.validation_shuffle": "jaxrl never shuffles the validation set; only False is valid",
    # ---- trainer / cluster
    "trainer.balance_batch": "sequence-length balancing across data-parallel ranks is not implemented; batch order is kept",
    "trainer.device": "JAX picks the platform itself (set JAX_PLATFORMS=cpu|cuda|tpu to force one)",
    "trainer.default_hdfs_dir": "no HDFS upload; checkpoints stay in trainer.default_local_dir (only null is valid)",
    "trainer.del_local_ckpt_after_load": "jaxrl never deletes checkpoints after loading",
    "trainer.ray_wait_register_center_timeout": _RAY,
    "trainer.use_legacy_worker_impl": _RAY,
    "trainer.esi_redundant_time": "verl's elastic-server (ESI) checkpoint timing; not applicable",
    "ray_kwargs.*": _RAY,
    "ray_init.*": _RAY,
    "global_profiler.*": _PROFILER,
    "*.profiler.*": _PROFILER,
    "*._target_": "Hydra instantiate target; jaxrl builds its own dataclasses",
    "_target_": "Hydra instantiate target; jaxrl builds its own dataclasses",
    # ---- critic (explicit keys only: a wildcard over critic.* would swallow typos of its real keys)
    "critic.enable": _CRITIC_ENABLE,
    "critic.rollout_n": _CRITIC_ROLLOUT_N,
    "critic.strategy": _STRATEGY,
    "critic.model.fsdp_config.*": _FSDP,
    "critic.model.tokenizer_path": _CRITIC_TOKENIZER,
    "critic.model.external_lib": "jaxrl runs its own Flax model code; no HF model classes are imported",
    "critic.model.trust_remote_code": "jaxrl runs its own Flax model code; no remote code is executed",
    "critic.model.use_shm": "models load from local files; no shared-memory copy",
    "critic.model.enable_activation_offload": (
        "use critic.model.enable_gradient_checkpointing (jax.checkpoint); offload does not apply"
    ),
    "critic.model.override_config": "jaxrl builds the value model from its checkpoint's config; only {} is valid",
    "critic.model.lora_adapter_path": _LORA_ADAPTER,
    "critic.ppo_micro_batch_size": _DEPRECATED_MBS,
    "critic.forward_micro_batch_size": _DEPRECATED_MBS,
    "critic.ulysses_sequence_parallel_size": _SP,
    "critic.checkpoint.*": "checkpoint contents are not configurable in jaxrl; ignored",
    "critic.optim.total_training_steps": "set at run time from trainer.total_training_steps",
    "critic.optim.optimizer": "jaxrl's optimizer is optax.adamw; only AdamW is valid",
    "critic.optim.optimizer_impl": "jaxrl's optimizer is optax.adamw; torch modules do not apply",
    "critic.optim.override_optimizer_config": "no extra optimizer kwargs in jaxrl; only null is valid",
    "critic.optim.num_cycles": "jaxrl's cosine schedule is the half cosine; only 0.5 is valid",
    "critic.data_loader_seed": "the critic trains on the actor's batch; it has no data loader",
    # ---- model reward model (explicit keys: reward_model.model.path / input_tokenizer are real fields)
    "reward_model.strategy": _STRATEGY,
    "reward_model.model.trust_remote_code": "jaxrl runs its own Flax model code; no remote code is executed",
    "reward_model.model.external_lib": "jaxrl runs its own Flax model code; no HF model classes are imported",
    "reward_model.model.override_config": "jaxrl builds the reward model from its checkpoint's config; only {} is valid",
    "reward_model.model.use_shm": "models load from local files; no shared-memory copy",
    "reward_model.model.use_remove_padding": (
        "the reward model scores padded rows; packing (actor_rollout_ref.model.use_remove_padding) covers the actor, "
        "reference and critic"
    ),
    "reward_model.model.use_fused_kernels": _KERNELS,
    "reward_model.model.fsdp_config.*": _FSDP,
    "reward_model.micro_batch_size": _DEPRECATED_MBS,
    "reward_model.use_dynamic_bsz": _DYN_BSZ,
    "reward_model.forward_max_token_len_per_gpu": _DYN_BSZ,
    "reward_model.ulysses_sequence_parallel_size": _SP,
    "reward_model.enable_resource_pool": _RM_PLACE,
    "reward_model.n_gpus_per_node": _RM_PLACE,
    "reward_model.nnodes": _RM_PLACE,
    "reward_model.rollout.*": _RM_LOOP,
    "reward_model.launch_reward_fn_async": "reward scoring concurrency is reward_model.num_workers in jaxrl",
    "reward_model.use_reward_loop": (
        "jaxrl always scores in its own worker processes (reward_model.num_workers, reward_model.timeout_s)"
    ),
    "reward_model.reward_loop_source": _REWARD_LOOP,
    "reward_model.reward_loop_module_path": _REWARD_LOOP,
    "reward_model.reward_loop_class_name": _REWARD_LOOP,
    "data.reward_fn_key": "the data source is read from each row's data_source field (verl's default)",
    # ---- PRIME's implicit PRM (verl's recipe/prime keys with no JAX meaning)
    "reward_model.model.tokenizer_path": "the implicit PRM reads the policy's token ids; it loads no tokenizer",
    "reward_model.model.enable_gradient_checkpointing": (
        "the implicit PRM follows actor_rollout_ref.model.enable_gradient_checkpointing"
    ),
    "reward_model.model.fused_kernel_options.*": _KERNELS,
    "reward_model.model.optim.total_training_steps": "set at run time from trainer.total_training_steps",
    "reward_model.ppo_max_token_len_per_gpu": _DYN_BSZ,
    # ---- verl's fully-async recipe (recipe/fully_async_policy): jaxrl's pipeline is async_training.staleness
    "async_training.staleness_threshold": (
        "jaxrl bounds staleness in policy versions with async_training.staleness (k: a trained batch is at most k "
        "updates old); verl's fraction of stale samples has no effect"
    ),
    "async_training.trigger_parameter_sync_step": (
        "jaxrl syncs the rollout weights after every update (one mini-batch pass per step); only 1 is valid"
    ),
    "async_training.require_batches": "each step trains one data.train_batch_size batch; only 1 is valid",
    "async_training.use_rollout_log_probs": (
        "the actor recomputes the old log-probs (actor.recompute_old_log_prob) and corrects for the rollout policy "
        "with actor_rollout_ref.actor.tis_imp_ratio_cap"
    ),
    "async_training.compute_prox_log_prob": "the recomputed old log-probs are the proximal policy's",
}

REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (1,),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": (1,),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (None,),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (None,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (None,),
    "actor_rollout_ref.ref.model": (None,),
    "actor_rollout_ref.actor.optim.optimizer": ("AdamW", "adamw"),
    "actor_rollout_ref.actor.optim.override_optimizer_config": (None,),
    "actor_rollout_ref.actor.optim.num_cycles": (0.5,),
    "actor_rollout_ref.model.lora_adapter_path": (None,),
    "data.validation_shuffle": (False,),
    "data.reward_fn_key": ("data_source",),
    "reward_model.reward_loop_source": ("register",),
    "reward_model.reward_loop_module_path": (None,),
    "reward_model.reward_loop_class_name": (None,),
    "trainer.default_hdfs_dir": (None,),
    "critic.model.override_config": ({},),
    "critic.model.lora_adapter_path": (None,),
    "critic.ppo_micro_batch_size": (None,),
    "critic.forward_micro_batch_size": (None,),
    "critic.ulysses_sequence_parallel_size": (1,),
    "critic.optim.optimizer": ("AdamW", "adamw"),
    "critic.optim.override_optimizer_config": (None,),
    "critic.optim.num_cycles": (0.5,),
    "reward_model.model.override_config": ({},),
    "reward_model.micro_batch_size": (None,),
    "reward_model.use_dynamic_bsz": (False,),
    "reward_model.ulysses_sequence_parallel_size": (1,),
    "async_training.trigger_parameter_sync_step": (1,),
    "async_training.require_batches": (1,),
}

RENAMES: dict[str, str] = {
    "actor_rollout_ref.actor.optim.warmup_style": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    "data.tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "reward_model.model.optim.warmup_style": "reward_model.model.optim.lr_scheduler_type",
    "critic.optim.clip_grad": "critic.grad_clip",
    "rollout.nnodes": "actor_rollout_ref.rollout.nnodes",  # verl recipes' rollout pool (one_step_off_policy, fully_async)
    "rollout.n_gpus_per_node": "actor_rollout_ref.rollout.n_gpus_per_node",
}


@dataclass(frozen=True)
class CompatNote:
    """One accepted verl key: ``key`` (full dotted), the ``value`` given, and the ``note``."""

    key: str
    value: Any
    note: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.note}"


def _is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


def _same(value: Any, allowed: Any) -> bool:
    """``value == allowed`` without Python's ``False == 0`` / ``None`` confusions."""
    if allowed is None or isinstance(allowed, bool) or value is None or isinstance(value, bool):
        return value is allowed
    return value == allowed


@dataclass(frozen=True)
class CompatTable:
    """One schema's three tables (see the module docstring): ``notes``, ``required_values``, ``renames``.

    :data:`RL` holds the tables above (``python -m jaxrl.train``); the offline trainers have their own
    (:mod:`jaxrl.config.offline_compat`).
    """

    notes: dict
    required_values: dict
    renames: dict

    def lookup_note(self, key: str, *, schema_field: bool) -> str | None:
        """The compat note for a full dotted ``key``, or None when the table has none.

        An exact entry wins; otherwise, for a key that is not a schema field (``schema_field=False``),
        the longest (most specific) matching wildcard pattern. Renamed keys are handled by
        :meth:`rename_note`, not here.
        """
        if key in self.notes:
            return self.notes[key]
        if schema_field:
            return None
        matches = [p for p in self.notes if _is_pattern(p) and fnmatch.fnmatchcase(key, p)]
        if not matches:
            return None
        return self.notes[max(matches, key=len)]

    def rename_note(self, old_key: str) -> str:
        """The note for a key in ``renames`` (raises KeyError for any other key)."""
        return f"verl's older name for {self.renames[old_key]}; the value is used there"

    def unsupported_value(self, key: str, value: Any) -> str | None:
        """An error message when ``key`` is in ``required_values`` and ``value`` is not allowed, else None."""
        allowed = self.required_values.get(key)
        if allowed is None:
            return None
        if any(_same(value, a) for a in allowed):
            return None
        valid = ", ".join(repr(a) for a in allowed)
        return f"{key}={value!r} is not supported: {self.notes[key]} (valid: {valid})"


RL = CompatTable(NOTES, REQUIRED_VALUES, RENAMES)


def lookup_note(key: str, *, schema_field: bool) -> str | None:
    """:meth:`CompatTable.lookup_note` of the RL config's tables."""
    return RL.lookup_note(key, schema_field=schema_field)


def rename_note(old_key: str) -> str:
    """:meth:`CompatTable.rename_note` of the RL config's tables."""
    return RL.rename_note(old_key)


def unsupported_value(key: str, value: Any) -> str | None:
    """:meth:`CompatTable.unsupported_value` of the RL config's tables."""
    return RL.unsupported_value(key, value)
