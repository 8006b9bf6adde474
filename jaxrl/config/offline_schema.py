"""The typed configs of the offline trainers: ``python -m jaxrl.sft`` (:class:`SFTConfig`) and ``python -m jaxrl.dpo``
(:class:`DPOConfig`).

Keys and defaults follow verl's ``verl/trainer/config/sft_trainer.yaml`` (sections ``data``, ``model``, ``optim``,
``trainer``), so a verl ``fsdp_sft_trainer`` command line means the same thing here; the DPO config shares the
layout and adds ``algorithm.dpo`` (TRL ``DPOConfig``'s names) and the preference columns (TRL's ``prompt`` /
``chosen`` / ``rejected``). Fields marked "jaxrl:" have no verl counterpart. Nothing here imports jax.

This module must not use ``from __future__ import annotations``: OmegaConf reads the real types.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from jaxrl.config.schema import MeshConfig, PreferenceLossConfig

OFFLINE_LR_SCHEDULER_CHOICES: tuple[str, ...] = ("cosine", "constant")  # verl's SFT also has wsd (not supported)


# ------------------------------------------------------------------------------------- data
@dataclass
class MultiturnConfig:
    """``data.multiturn.*``: conversations (verl's ``MultiTurnSFTDataset``): the loss is on the assistant turns."""

    enable: bool = False  # True = each row holds a list of chat messages (messages_key), not a prompt / response
    messages_key: str = "messages"  # the column with the [{"role", "content"}, ...] conversation


@dataclass
class SFTDataConfig:
    """``data.*`` of ``python -m jaxrl.sft``: prompt / response rows (or conversations) and their batching."""

    train_batch_size: int = 256  # sequences per optimizer step (over all devices)
    micro_batch_size_per_gpu: int = 4  # sequences per device per forward/backward; also the validation batch
    train_files: Any = "~/data/gsm8k/train.parquet"  # str or list[str] (parquet / jsonl / json)
    val_files: Any = "~/data/gsm8k/test.parquet"  # str or list[str], or null = no validation
    train_max_samples: int = -1  # use the first N train rows; -1 = all
    val_max_samples: int = -1  # use the first N validation rows; -1 = all
    prompt_key: str = "question"  # the prompt column (a string, or a list of chat messages)
    response_key: str = "answer"  # the response column (a string)
    prompt_dict_keys: Optional[list[str]] = None  # keys into a nested prompt column (e.g. [question] of extra_info)
    response_dict_keys: Optional[list[str]] = None  # keys into a nested response column (e.g. [answer])
    multiturn: MultiturnConfig = field(default_factory=MultiturnConfig)  # conversations section
    max_length: int = 1024  # tokens of one sequence (prompt + response / the whole conversation)
    truncation: str = "error"  # a longer sequence: "error" | "left" (keep the end) | "right" (keep the start)
    filter_overlong: bool = False  # jaxrl: drop sequences longer than max_length (counted in the log) instead
    chat_template: Optional[str] = None  # a Jinja chat template replacing the tokenizer's; null = the tokenizer's
    shuffle: bool = True  # jaxrl: a new seeded order of the train rows every epoch
    seed: Optional[int] = None  # jaxrl: shuffle seed; null = trainer.seed
    skip_malformed: bool = False  # jaxrl: skip rows that fail to parse instead of raising


@dataclass
class DPODataConfig:
    """``data.*`` of ``python -m jaxrl.dpo``: preference pairs (TRL's columns) and their batching."""

    train_batch_size: int = 32  # pairs per optimizer step (over all devices)
    micro_batch_size_per_gpu: int = 2  # pairs per device per forward/backward (each pair is two sequences)
    train_files: Any = "~/data/preference/train.parquet"  # str or list[str] (parquet / jsonl / json)
    val_files: Any = None  # str or list[str], or null = no validation
    train_max_samples: int = -1  # use the first N train pairs; -1 = all
    val_max_samples: int = -1  # use the first N validation pairs; -1 = all
    # TRL's formats: prompt + chosen + rejected as text, or as chat messages (conversational; prompt = the turns
    # before the answer, chosen / rejected = the assistant turn(s)); without a prompt column, chosen and rejected are
    # whole conversations sharing their first turns (TRL's implicit prompt)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_length: int = 1024  # tokens of one sequence (prompt + chosen, prompt + rejected)
    truncation: str = "error"  # a longer sequence: "error" | "left" (keep the end) | "right" (keep the start)
    filter_overlong: bool = False  # drop pairs with a sequence longer than max_length (counted) instead
    chat_template: Optional[str] = None  # a Jinja chat template replacing the tokenizer's; null = the tokenizer's
    shuffle: bool = True  # a new seeded order of the train pairs every epoch
    seed: Optional[int] = None  # shuffle seed; null = trainer.seed
    skip_malformed: bool = False  # skip rows that fail to parse instead of raising


# ------------------------------------------------------------------------------------ model
@dataclass
class OfflineModelConfig:
    """``model.*``: the model to fine-tune (DPO: also the frozen reference, its initial copy)."""

    partial_pretrain: str = "~/models/gemma-1.1-7b-it"  # HF dir, .gguf file, llama2.c file or alias (verl's key)
    tokenizer_path: Optional[str] = None  # jaxrl: null = the tokenizer that ships with the model
    enable_gradient_checkpointing: bool = True  # jax.checkpoint (remat) each decoder layer
    # what a rematerialised layer keeps: "full" (its input) | "selective" (+ its projection outputs; as
    # actor_rollout_ref.model.recompute_granularity of the RL trainer)
    recompute_granularity: str = "full"
    dtype: str = "bfloat16"  # jaxrl: compute dtype "float32" | "bfloat16" (verl: fsdp mixed precision)
    param_dtype: str = "float32"  # jaxrl: master parameter + optimizer dtype (verl: fsdp_config.model_dtype fp32)


@dataclass
class OfflineOptimConfig:
    """``optim.*``: AdamW and its learning-rate schedule (verl's SFT optim keys)."""

    lr: float = 1e-5  # peak learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam (beta1, beta2)
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    lr_warmup_steps_ratio: float = 0.1  # warm-up as a fraction of the training steps (used when lr_warmup_steps=-1)
    lr_warmup_steps: int = -1  # warm-up in steps; -1 = lr_warmup_steps_ratio
    clip_grad: float = 1.0  # max global gradient norm; <= 0 disables clipping
    lr_scheduler: str = "cosine"  # "cosine" | "constant" after the warm-up
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    eps: float = 1e-8  # jaxrl: Adam epsilon (torch.optim.AdamW default)


# ---------------------------------------------------------------------------------- trainer
@dataclass
class OfflineTrainerConfig:
    """``trainer.*``: loop length, validation / checkpoint cadence, logging, the device mesh."""

    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # checkpoints + logs
    project_name: str = "gsm8k-sft"  # experiment group name
    experiment_name: str = "test"  # run name
    total_epochs: int = 4  # passes over the train set
    total_training_steps: Optional[int] = None  # null = total_epochs x steps per epoch; else stops at this step
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console|jsonl|tensorboard|wandb
    seed: int = 1  # shuffle seed (data.seed) default
    save_freq: int = -1  # checkpoint every N steps (and at the end when > 0); -1 = off
    test_freq: int = -1  # validation loss every N steps (and at the last step); -1 = only at the last step
    val_before_train: bool = True  # jaxrl: the validation loss of the model before the first step
    nnodes: int = 1  # hosts; the offline trainers run in one process (only 1 is valid)
    max_ckpt_to_keep: Optional[int] = None  # keep the newest N checkpoints; null = keep all
    resume_mode: str = "auto"  # "auto" (latest checkpoint in default_local_dir, if any) | "disable" | "resume_path"
    resume_from_path: Optional[str] = None  # resume_path: a run's checkpoint dir or one of its global_step_<N> dirs
    max_nonfinite_steps: int = 3  # jaxrl: abort after N consecutive steps with a non-finite loss or grad norm
    checkpoint_async: bool = True  # jaxrl: write checkpoints in a background thread
    # jaxrl: JAX's persistent compilation cache (jaxrl.compilation_cache); null = off; JAX_COMPILATION_CACHE_DIR wins
    jax_compilation_cache_dir: Optional[str] = "~/.cache/jaxrl/jax_compilation_cache"
    mesh: MeshConfig = field(default_factory=MeshConfig)  # jaxrl: the train mesh (all null = one device)
    sharding_rules: Optional[dict[str, Any]] = None  # jaxrl: logical-axis rule overrides (as in jaxrl.train)


# --------------------------------------------------------------------------------- top level
@dataclass
class SFTConfig:
    """``python -m jaxrl.sft``'s config (verl's ``sft_trainer.yaml`` sections)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)
    optim: OfflineOptimConfig = field(default_factory=OfflineOptimConfig)
    trainer: OfflineTrainerConfig = field(default_factory=OfflineTrainerConfig)


@dataclass
class DPOAlgorithmConfig:
    """``algorithm.*`` of ``python -m jaxrl.dpo``."""

    dpo: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)  # the preference loss section


@dataclass
class DPOConfig:
    """``python -m jaxrl.dpo``'s config: the SFT layout with preference data and ``algorithm.dpo``."""

    data: DPODataConfig = field(default_factory=DPODataConfig)
    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)
    optim: OfflineOptimConfig = field(default_factory=lambda: OfflineOptimConfig(lr=1e-6))  # TRL's DPO lr
    trainer: OfflineTrainerConfig = field(
        default_factory=lambda: OfflineTrainerConfig(project_name="dpo", total_epochs=1))
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)
