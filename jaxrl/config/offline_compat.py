"""verl SFT-trainer keys with no JAX meaning, for ``python -m jaxrl.sft`` / ``jaxrl.dpo`` (the tables
:mod:`jaxrl.config.compat` describes, for :mod:`jaxrl.config.offline_schema`): accepted with a one-line note, only
with verl's no-op value, or under their newer name."""

from __future__ import annotations

from typing import Any

from jaxrl.config.compat import CompatTable

_FSDP = "JAX: params/optimizer sharded over the mesh `fsdp` axis (trainer.mesh); offload not applicable"
_KERNELS = "XLA fuses kernels; Liger/Triton kernels do not apply"
_SHM = "files are read from their path; no shared-memory copy"
_LORA = "LoRA is not supported yet (full fine-tuning only); only lora_rank=0 is valid"
_PACKING = ("rows are padded to the split's longest sequence (bucketed); the loss is the same with or without "
            "padding removal, which the offline trainers do not implement")

NOTES: dict[str, str] = {
    "data.micro_batch_size": "verl's deprecated global micro-batch size; use data.micro_batch_size_per_gpu",
    "data.balance_dp_token": "every data-parallel device takes the same number of rows; no token balancing",
    "data.custom_cls.path": "custom dataset classes are not supported; rows are read by jaxrl.data.sft",
    "data.custom_cls.name": "custom dataset classes are not supported; rows are read by jaxrl.data.sft",
    "data.use_shm": _SHM,
    "data.apply_chat_template_kwargs": "extra chat-template arguments are not supported",
    "data.multiturn.tools_key": "tool schemas in SFT rows are not read (the chat template renders no tools)",
    "data.multiturn.enable_thinking_key": "a per-row enable_thinking flag is not read",
    "model.fsdp_config.*": _FSDP,
    "model.external_lib": "model classes come from jaxrl.models (Llama / Qwen2 / Qwen3); no external library",
    "model.trust_remote_code": "no remote code runs: jaxrl builds the model from its config",
    "model.lora_rank": _LORA,
    "model.lora_alpha": _LORA,
    "model.target_modules": _LORA,
    "model.use_liger": _KERNELS,
    "model.strategy": "JAX runs one jit-compiled SPMD program per step; verl's fsdp/fsdp2 strategies do not apply",
    "model.use_shm": _SHM,
    "optim.optimizer": "AdamW (optax.adamw) is the only optimizer",
    "optim.optimizer_impl": "AdamW comes from optax",
    "optim.total_training_steps": "the schedule's horizon is the run's (trainer.total_training_steps or epochs)",
    "optim.num_cycles": "the cosine schedule makes half a cycle",
    "optim.lr_scheduler_type": "verl's SFT trainer reads optim.lr_scheduler (as jaxrl.sft does); ignored",
    "optim.warmup_style": "verl's deprecated name of the scheduler; use optim.lr_scheduler",
    "optim.override_optimizer_config": "no optimizer overrides (AdamW from optax)",
    "ulysses_sequence_parallel_size": "Ulysses sequence parallelism is not implemented; only 1 is valid",
    "use_remove_padding": _PACKING,
    "trainer.default_hdfs_dir": "checkpoints are written to trainer.default_local_dir only",
    "trainer.checkpoint.*": "a checkpoint always holds the model, the optimizer state and the data position",
    "trainer.device": "jax picks the platform (JAX_PLATFORMS=cpu|cuda|tpu)",
    "trainer.n_gpus_per_node": "the offline trainers use trainer.mesh over all of jax.devices() (one device when unset)",
}

REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "data.micro_batch_size": (None,),
    "data.custom_cls.path": (None,),
    "data.custom_cls.name": (None,),
    "data.apply_chat_template_kwargs": ({},),
    "model.external_lib": (None,),
    "model.lora_rank": (0,),
    "optim.optimizer": ("AdamW", "adamw"),
    "optim.optimizer_impl": ("torch.optim",),
    "optim.num_cycles": (0.5,),
    "optim.warmup_style": (None,),
    "optim.override_optimizer_config": (None,),
    "ulysses_sequence_parallel_size": (1,),
    "trainer.default_hdfs_dir": (None,),
}

RENAMES: dict[str, str] = {
    "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
}

OFFLINE = CompatTable(NOTES, REQUIRED_VALUES, RENAMES)
