"""The typed jaxrl config: nested dataclasses, the single source of truth for keys and defaults.

Key names and defaults follow verl's ``verl/trainer/config/ppo_trainer.yaml`` (and the generated
``_generated_ppo_trainer.yaml``, ``actor/``, ``rollout/``, ``ref/`` yaml) so a verl command line
``a.b.c=value`` means the same thing here. Fields marked "jaxrl:" have no verl counterpart. Where a
default differs from verl's, the comment says why.

The loader (:mod:`jaxrl.config.loader`) builds an OmegaConf structured config from
:class:`JaxRLConfig`, merges YAML and ``key=value`` overrides, validates, and returns an instance of
:class:`JaxRLConfig`. Nothing here imports jax.

This module must not use ``from __future__ import annotations``: OmegaConf reads the real types.
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II

from jaxrl.algorithms import registry

# ---------------------------------------------------------------------------------------------
# Valid choices (kept here, beside the fields, so the loader and the docs read one list).
# The advantage-estimator and policy-loss names come from jaxrl.algorithms.registry (no jax import);
# these are the built-in ones: the loader checks a config against the registry itself, which also holds
# what algorithm.external_lib registered. The KL and loss-aggregation lists equal jaxrl.algorithms'
# KL_PENALTIES [+ straight-through + "full"] and LOSS_AGG_MODES (a test checks it); they are repeated so
# loading a config never imports jax.
# ---------------------------------------------------------------------------------------------
TRUNCATION_CHOICES: tuple[str, ...] = ("error", "left", "right")
DTYPE_CHOICES: tuple[str, ...] = ("float32", "bfloat16")
RECOMPUTE_GRANULARITY_CHOICES: tuple[str, ...] = ("full", "selective")  # jaxrl.models.decoder.REMAT_POLICIES
LR_SCHEDULER_CHOICES: tuple[str, ...] = ("constant", "cosine")
KL_PENALTY_CHOICES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# actor.kl_loss_type also takes the straight-through "+" variants (value of the estimator, gradient of
# k2), "full" (exact KL over the vocabulary) and the importance-weighted k3 (k3 x pi/pi_old: TRL's
# use_bias_correction_kl, DeepSeek-V3.2); algorithm.kl_penalty (no gradient) takes only the above.
KL_IMPORTANCE_WEIGHTED_CHOICES: tuple[str, ...] = ("low_var_kl_is", "k3_is")
KL_LOSS_TYPE_CHOICES: tuple[str, ...] = (
    KL_PENALTY_CHOICES + tuple(k + "+" for k in KL_PENALTY_CHOICES) + ("full",) + KL_IMPORTANCE_WEIGHTED_CHOICES
)
LOSS_AGG_MODE_CHOICES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
POLICY_LOSS_MODE_CHOICES: tuple[str, ...] = registry.BUILTIN_POLICY_LOSSES  # + user-registered ones
ROLLOUT_NAME_CHOICES: tuple[str, ...] = ("jax", "vllm", "jetstream")
ADV_ESTIMATOR_CHOICES: tuple[str, ...] = registry.BUILTIN_ADV_ESTIMATORS  # + user-registered ones
PREFERENCE_LOSS_CHOICES: tuple[str, ...] = registry.BUILTIN_PREFERENCE_LOSSES  # algorithm.dpo.loss_type (+ user's)
# built-in estimators that read the critic's values (the run builds a critic); registry.needs_critic(name) in general
CRITIC_ADV_ESTIMATORS: tuple[str, ...] = tuple(n for n in ADV_ESTIMATOR_CHOICES if registry.needs_critic(n))
FILTER_GROUPS_METRIC_CHOICES: tuple[str, ...] = ("acc", "score", "seq_reward", "seq_final_reward")
KL_CTRL_TYPE_CHOICES: tuple[str, ...] = ("fixed", "adaptive")
LOGGER_CHOICES: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb")
RESUME_MODE_CHOICES: tuple[str, ...] = ("auto", "disable", "resume_path")  # = jaxrl.checkpoint.RESUME_MODES
REWARD_MANAGER_CHOICES: tuple[str, ...] = ("naive", "prime", "dapo", "batch")  # = jaxrl.rewards.manager.REWARD_MANAGERS
MATH_VERIFIER_CHOICES: tuple[str, ...] = ("rule", "math_verify")  # = jaxrl.rewards.MATH_VERIFIERS
RM_COMBINE_CHOICES: tuple[str, ...] = ("replace", "sum")  # reward_model.combine
SANDBOX_ISOLATION_CHOICES: tuple[str, ...] = ("bwrap", "none")  # = jaxrl.sandbox.ISOLATIONS
CODE_SCORE_CHOICES: tuple[str, ...] = ("fraction", "all_pass")  # = jaxrl.rewards.code.CODE_SCORES
DISTRIBUTED_MODE_CHOICES: tuple[str, ...] = ("local", "env", "auto")  # = jaxrl.distributed.MODES
LAUNCHER_CHOICES: tuple[str, ...] = ("local", "ray")  # trainer.launcher = jaxrl.ray_backend.LAUNCHERS
RAY_RESOURCE_CHOICES: tuple[str, ...] = ("auto", "GPU", "TPU", "CPU")  # trainer.ray.resource
PLACEMENT_CHOICES: tuple[str, ...] = ("colocated", "split")  # = jaxrl.workers.placement.PLACEMENTS
MESH_AXIS_CHOICES: tuple[str, ...] = ("data", "fsdp", "tensor")  # = sharding.mesh.MESH_AXES
# Logical axis names the decoder / value model parameters carry, plus "batch" (= the rows of every batch array);
# the keys of sharding.rules.DEFAULT_RULES.
LOGICAL_AXIS_CHOICES: tuple[str, ...] = ("batch", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers")


# ------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """``data.*``: datasets, prompt/response lengths and batch sizes (in prompts)."""

    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"  # str or list[str] (parquet/jsonl/jaxrl://builtin)
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"  # str or list[str], or null = no validation set
    train_batch_size: int = 1024  # prompts per RL step (each gets rollout.n responses)
    gen_batch_size: Optional[int] = None  # DAPO: prompts per generation round; null = train_batch_size (filled)
    val_batch_size: Optional[int] = None  # prompts per validation generate call; null = whole val set in one pass
    val_max_samples: int = -1  # jaxrl: validate on the first N val prompts; -1 = all
    train_max_samples: int = -1  # use at most N train prompts (random subset, seeded); -1 = all
    max_prompt_length: int = 512  # prompt budget in tokens (prompts are left-padded to it)
    max_response_length: int = 512  # response budget in tokens (rollout generates up to this)
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length when loading
    truncation: str = "error"  # overlong prompt that was not filtered: "error" | "left" | "right"
    shuffle: bool = True  # shuffle the train set every epoch
    seed: Optional[int] = None  # shuffle/subset seed; null = trainer.seed (filled by the loader)
    prompt_key: str = "prompt"  # dataset column with the prompt (chat messages or plain text)
    skip_malformed: bool = False  # jaxrl: skip rows that fail to parse instead of raising
    # PRIME (algorithm.adv_estimator=prime; verl's recipe/prime keys and defaults). Each step generates for
    # oversample_factor x train_batch_size prompts, then keeps train_batch_size of them: first the prompts whose
    # mean outcome label (the PRM's label, jaxrl.algorithms.prime) lies in [accuracy_lower_bound,
    # accuracy_upper_bound] (filter_accuracy) and none of whose responses hit the length limit (filter_truncate),
    # then the others, in batch order. null = the recipe's value under prime (True / 4.0 / True), off otherwise.
    filter_accuracy: Optional[bool] = None
    accuracy_lower_bound: float = 0.2  # PRIME: lowest kept group accuracy, in [0, 1]
    accuracy_upper_bound: float = 0.8  # PRIME: highest kept group accuracy, in [accuracy_lower_bound, 1]
    oversample_factor: Optional[float] = None  # PRIME: prompts generated per kept prompt, >= 1; null = 4.0 (prime) / 1
    filter_truncate: Optional[bool] = None  # PRIME: deprioritise groups with a response of >= max_response_length - 1


# ------------------------------------------------------------------------ actor_rollout_ref
@dataclass
class ModelConfig:
    """``actor_rollout_ref.model.*``: the policy model (the reference model is its initial copy; with LoRA the base
    model with the adapters off, sharing its arrays)."""

    path: str = "~/models/deepseek-llm-7b-chat"  # HF dir, .gguf file, or alias (jaxrl.models.resolve)
    tokenizer_path: Optional[str] = None  # null = the tokenizer that ships with the model
    enable_gradient_checkpointing: bool = True  # jax.checkpoint (remat) each decoder layer in the actor update
    # what a rematerialised layer keeps (Megatron-Core's recompute_granularity): "full" = only its input, the whole
    # layer recomputed in the backward; "selective" = also the q/k/v/o and gate/up projection outputs, so only
    # attention, norms, RoPE and SwiGLU are recomputed (no projection matmul twice; more activation memory)
    recompute_granularity: str = "full"
    dtype: str = "bfloat16"  # compute/activation dtype: "float32" | "bfloat16"
    param_dtype: str = "float32"  # master parameter + optimizer dtype (verl FSDP mixed precision keeps fp32)
    # True = the actor, reference (and, unless critic.model.use_remove_padding says otherwise, the critic) run their
    # forward / backward on packed rows: several responses per row, no padding (jaxrl.workers.packing); exact
    use_remove_padding: bool = False
    # True = the actor update's LM head and log-softmax run in chunks of positions (verl's fused linear-for-PPO
    # kernel, as a rematerialised scan: jaxrl.algorithms.logprob.head_log_probs): the [B, R, V] logits and their
    # gradient are never held whole, for one more LM-head matmul in the backward; the same values. The no-grad
    # log-prob passes always run in chunks. Not with actor.kl_loss_type="full" (it needs the whole logits)
    use_fused_kernels: bool = False
    # LoRA (jaxrl.models.lora; verl's keys): rank > 0 trains only adapters on the base model's projections; the
    # reference is the base with adapters off (no copy), the rollout gets merged weights; 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 16  # adapter output scaled by lora_alpha / lora_rank (PEFT's scaling)
    # "all-linear" (q/k/v/o/gate/up/down of every layer), a regex matched against whole HF module names, or a list of
    # names / name suffixes (PEFT's target_modules semantics)
    target_modules: Any = "all-linear"
    exclude_modules: Any = None  # null, a regex or a list (as target_modules): modules removed from the targets


@dataclass
class OptimConfig:
    """``actor_rollout_ref.actor.optim.*``: AdamW and its learning-rate schedule."""

    lr: float = 1e-6  # peak learning rate (verl actor default)
    lr_warmup_steps_ratio: float = 0.0  # warm-up length as a fraction of total steps (used when lr_warmup_steps = -1)
    lr_warmup_steps: int = -1  # warm-up length in optimizer steps; -1 = use lr_warmup_steps_ratio
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam (beta1, beta2)
    eps: float = 1e-8  # jaxrl: Adam epsilon (torch.optim.AdamW default)
    min_lr_ratio: float = 0.0  # cosine schedule floor as a fraction of lr
    lr_scheduler_type: str = "constant"  # "constant" | "cosine" (verl's older name: warmup_style)


@dataclass
class PolicyLossConfig:
    """``actor_rollout_ref.actor.policy_loss.*``."""

    # vanilla (PPO clip, dual clip) | gspo | cispo | clip_cov | kl_cov | gpg | one algorithm.external_lib registers.
    # The keys below are options of particular losses (jaxrl.algorithms.registry): setting one the chosen loss does
    # not take to a value other than its default is a config error.
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of valid tokens whose gradient is cut, in (0, 1]
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance band of candidate tokens
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of that band (> clip_cov_lb)
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of valid tokens that get the KL penalty, in (0, 1]
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of the |log-ratio| penalty (verl PolicyLossConfig default)


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update (batch sizes in prompts, times rollout.n)."""

    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer section
    grad_clip: float = 1.0  # max global gradient norm; <= 0 disables clipping
    ppo_mini_batch_size: int = 256  # prompts per optimizer update (x rollout.n responses, / data-parallel size)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per device per forward/backward; null = whole mini-batch
    # True = micro-batches by a token budget instead of ppo_micro_batch_size_per_gpu: ceil(real tokens /
    # (ppo_max_token_len_per_gpu x data-parallel devices)) balanced micro-batches per mini-batch (verl's seq-len balancing)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # use_dynamic_bsz: real tokens per device per micro-batch (>= one sequence)
    # True = each prompt's forward runs once for all its responses in the actor's update, its old-log-prob pass and
    # the reference's (verl's PrefixGrouper): packed rows lay each distinct prompt once, its responses attend to that
    # one copy (exact). Implies the packed layout (model.use_remove_padding's), whatever that key says
    use_prefix_grouper: bool = False
    ppo_epochs: int = 1  # passes over each RL batch
    shuffle: bool = False  # shuffle responses before splitting into mini-batches
    # False = skip the old-log-prob forward pass: with one update per step (ppo_epochs 1, one mini-batch) the old
    # policy IS the current one, so the loss uses stop_gradient(current log-probs) as pi_old (ratio exactly 1, as
    # TRL/Tunix do with num_iterations=1 and NeMo-RL's force_on_policy_ratio). Saves one forward over the batch;
    # training/rollout_probs_diff_* and the old pass's actor/entropy are then not logged.
    recompute_old_log_prob: bool = True
    use_kl_loss: bool = False  # add kl_loss_coef * KL(pi || ref) to the loss (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    # kl/k1, abs, mse/k2, low_var_kl/k3, their "+" straight-through forms, full, and low_var_kl_is/k3_is (k3 x the
    # differentiable ratio pi/pi_old: the unbiased reverse-KL gradient off-policy; TRL's use_bias_correction_kl)
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0  # entropy bonus weight (loss -= entropy_coeff * entropy)
    clip_ratio: float = 0.2  # PPO clip epsilon (fallback for clip_ratio_low/high)
    clip_ratio_low: Optional[float] = 0.2  # lower clip epsilon; null = clip_ratio (filled by the loader)
    clip_ratio_high: Optional[float] = 0.2  # upper clip epsilon (DAPO clip-higher); null = clip_ratio
    # dual-clip constant for negative advantages, > 1: the loss of a token with A < 0 is capped at -A x clip_ratio_c.
    # verl's default 3.0 keeps the dual clip ON; TRL's GRPOTrainer and the GRPO paper have none: clip_ratio_c=1e9
    # turns it off exactly (the ratio is exp of a log-ratio clamped to [-20, 20], so it never exceeds e^20 < 1e9)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # policy-loss section
    tis_imp_ratio_cap: float = -1.0  # truncated importance sampling cap on pi_old/pi_rollout per token; -1 = off


@dataclass
class SamplingKwargs:
    """``actor_rollout_ref.rollout.val_kwargs.*``: sampling for validation (greedy by default)."""

    n: int = 1  # responses per validation prompt
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 (or 0) = off
    do_sample: bool = False  # False = greedy argmax


@dataclass
class MultiTurnConfig:
    """``actor_rollout_ref.rollout.multi_turn.*``: multi-turn rollouts with tools (jaxrl.agent; verl's keys)."""

    enable: bool = False  # True = the model's tool calls run and their results go back through the chat template
    max_assistant_turns: Optional[int] = None  # model turns per response; null = only the response budget limits
    max_user_turns: Optional[int] = None  # environment (user) messages per response; null = unlimited
    max_parallel_calls: int = 1  # tool calls run per model turn
    max_tool_response_length: int = 256  # characters of one tool result kept
    tool_response_truncate_side: str = "middle"  # left (keep the start) | right (keep the end) | middle
    tool_config_path: Optional[str] = None  # verl's tool-config YAML (tools: [{class_name, config, tool_schema}])
    format: str = "hermes"  # tool-call format: <tool_call>{"name", "arguments"}</tool_call>
    env_class: Optional[str] = None  # jaxrl: import path of a jaxrl.agent.env.Environment subclass (interactive task)
    env_config: dict = field(default_factory=dict)  # jaxrl: passed to env_class(config)


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout.*``: response generation."""

    name: str = "jax"  # backend: "jax" = embedded JAX sampler | "vllm" | "jetstream" (verl has no default)
    n: int = 1  # responses per prompt (GRPO group size, >= 2 for grpo)
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 (or 0) = off
    do_sample: bool = True  # False = greedy argmax
    max_new_tokens: Optional[int] = None  # jaxrl: generation cap; null = data.max_response_length (filled)
    prompt_length: int = II("data.max_prompt_length")  # prompt width seen by the rollout
    response_length: int = II("data.max_response_length")  # response width seen by the rollout
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per device per log-prob forward; null = all
    log_prob_use_dynamic_bsz: Optional[bool] = None  # log-prob forward by a token budget; null = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # its real tokens per device; null = actor.ppo_max_token_len_per_gpu
    micro_batch_size: Optional[int] = None  # jaxrl: max sequences per generate call; null = no cap
    # jaxrl, rollout.name=jax without a mesh: prefill only the prompts' real tokens, packed end to end in one row
    # (as vLLM does); false = the left-padded [prompts, prompt width] batch, one compiled prefill per width (the packed
    # row's length adds a few more shapes, each a compiled program of ~35 MB for SmolLM2-135M)
    packed_prefill: bool = True
    # jaxrl, rollout.name=jax: decode a long response (>= 2 x 128 new tokens) in at most this many segments, each
    # attending over a cache just long enough for it, grown between segments, instead of reading every slot of the
    # full cache on every step (SmolLM2-135M, 32 rows, 512 new tokens, 2 CPU cores: see bench/results/summary.md);
    # each segment is one more compiled decode program. 1 = one loop over the whole cache
    max_decode_segments: int = 4
    # jaxrl, rollout.name=jax without a mesh: once at most half of a generate batch is still generating, gather the
    # live rows (state and KV-cache rows) into a batch of half the size or less and decode on with it (down to 4
    # rows), so rows that stopped cost nothing more, as in vLLM's continuous batching; each smaller batch is one more
    # compiled decode program, built when a compaction first needs it. false = every row runs to the longest's end
    compact_finished_rows: bool = True
    # the rollout's compute dtype: "bfloat16" | "float32"; null = actor_rollout_ref.model.dtype (verl's default is
    # bfloat16). jax sampler, bfloat16 for a float32 model: weight matrices copied to bfloat16 per generate call and
    # every projection a bfloat16 x bfloat16 -> float32 matmul, activations / attention / KV cache float32 (SmolLM2 on
    # a CPU with AMX: 1.1-1.5x the decode tokens/s at 8-64 rows, slower at 1); the old-log-prob pass rescores the
    # samples in the policy's dtype. vLLM: its
    # dtype (null: float32 on CPU, the params' dtype on GPU). JetStream: only null or the model's dtype.
    dtype: Optional[str] = None
    # JetStream: most decode slots (sequences decoded at once, continuous batching); it uses one slot per row of a
    # generate call (data.gen_batch_size or train_batch_size, x n) up to this; null = no cap. vLLM keeps its default.
    max_num_seqs: Optional[int] = None
    # Tensor-parallel degree of the rollout engine: vLLM/JetStream, and the jax sampler when a mesh is on
    # (trainer.mesh / trainer.placement=split): the sampler's weights are split tensor-parallel over groups of this
    # many rollout devices and the remaining factor of the rollout devices splits the generated rows
    # (data-parallel replicas). Without a mesh the jax sampler runs on one device and ignores it.
    tensor_model_parallel_size: int = 2
    # The rollout's own resource pool (verl's standalone rollout / one-step-off-policy recipes; the recipes' top-level
    # rollout.nnodes / rollout.n_gpus_per_node are read as these): with trainer.launcher=ray and nnodes >= 1 the
    # rollout runs as its own worker group (its own JAX world) on nnodes hosts x n_gpus_per_node devices, apart from
    # the train group (trainer.nnodes x trainer.n_gpus_per_node); the Ray driver is the controller (jaxrl.hybrid).
    # 0 = no pool of its own: the rollout shares the trainer's processes (colocated or trainer.placement=split).
    nnodes: int = 0
    n_gpus_per_node: int = 0
    gpu_memory_utilization: float = 0.5  # vLLM: fraction of GPU memory for weights + KV cache
    update_weights_timeout_s: float = 600.0  # jaxrl: seconds one weight sync may take before it fails (vLLM; the
    # hybrid controller's sync across worlds)
    # vLLM on CUDA: sleep after each rollout (KV cache freed, weights offloaded to host) so the trainer's update has
    # the memory, wake before the next sync/rollout. vLLM's CPU platform has no sleep mode: there only the prefix
    # cache is reset after each sync. The jax sampler allocates its KV cache per call and ignores it.
    free_cache_engine: bool = True
    stop_token_ids: list[int] = field(default_factory=list)  # jaxrl: extra ids that end a response (besides eos)
    ignore_eos: bool = False  # True = eos does not end a response (every response runs to max_new_tokens)
    seed: Optional[int] = None  # jaxrl: sampling PRNG seed; null = trainer.seed (filled by the loader)
    val_kwargs: SamplingKwargs = field(default_factory=SamplingKwargs)  # validation sampling section
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tools / multi-turn section


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref.*``: the frozen reference policy (for the KL loss / KL reward)."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per device per ref forward; null = all
    log_prob_use_dynamic_bsz: Optional[bool] = None  # ref forward by a token budget; null = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # its real tokens per device; null = actor.ppo_max_token_len_per_gpu


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: model, actor update, rollout and reference."""

    model: ModelConfig = field(default_factory=ModelConfig)  # policy model section
    actor: ActorConfig = field(default_factory=ActorConfig)  # actor update section
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation section
    ref: RefConfig = field(default_factory=RefConfig)  # reference-policy section


# -------------------------------------------------------------------------------- algorithm
@dataclass
class KLControlConfig:
    """``algorithm.kl_ctrl.*``: KL-in-reward coefficient controller (used when use_kl_in_reward)."""

    type: str = "fixed"  # "fixed" | "adaptive" (Ziegler et al. 2019 adaptive controller)
    kl_coef: float = 0.001  # (initial) KL coefficient
    target_kl: float = 0.1  # adaptive: target KL per step
    horizon: int = 10000  # adaptive: controller horizon in samples


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups.*``: DAPO dynamic sampling (drop prompt groups whose responses all score alike)."""

    enable: bool = False  # keep generating until data.train_batch_size prompts with a non-constant metric remain
    metric: str = "acc"  # acc | score | seq_reward | seq_final_reward ("acc" uses score when the reward has no acc)
    max_num_gen_batches: int = 0  # give up after this many generation rounds per step; 0 = unlimited


@dataclass
class PreferenceLossConfig:
    """``algorithm.dpo.*`` of ``python -m jaxrl.dpo`` (and, with ``enable``, of online DPO in ``jaxrl.train``): the
    preference loss (jaxrl.algorithms.preference; TRL DPOConfig's names)."""

    # sigmoid (DPO; with label_smoothing: cDPO) | ipo | hinge | robust | one algorithm.external_lib registers
    loss_type: str = "sigmoid"
    beta: float = 0.1  # strength of the implicit KL to the reference (IPO: its tau), > 0 (TRL's default)
    label_smoothing: float = 0.0  # sigmoid / robust: probability a pair's label is flipped, in [0, 0.5]


@dataclass
class OnlineDPOConfig(PreferenceLossConfig):
    """``algorithm.dpo.*`` of ``python -m jaxrl.train``: online DPO (jaxrl). With ``enable`` each step's rollout.n
    samples per prompt are scored by the reward, the best and the worst of each group become a chosen / rejected
    pair (groups whose scores are all equal give none), and the actor takes the preference loss against the frozen
    reference (the initial policy) instead of a policy-gradient loss: ppo_mini_batch_size counts prompts (= pairs)
    and ppo_micro_batch_size_per_gpu pairs per device."""

    enable: bool = False  # True = online DPO instead of the policy-gradient update (no advantages are computed)


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantage estimation, KL-in-reward and DAPO group filtering."""

    # gae (PPO: needs the critic) | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax |
    # grpo_passk | opo | gpg | one external_lib registers. verl defaults to gae; jaxrl keeps grpo so critic-free
    # runs need no critic section. norm_adv_by_std_in_grpo, adv_std_epsilon, gamma and lam are options of particular
    # estimators (jaxrl.algorithms.registry): setting one the chosen estimator does not take (to a non-default value)
    # is an error.
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide group-centred scores by the group std (False = Dr. GRPO)
    # jaxrl (verl has no key; its estimators' epsilon): grpo / grpo_passk divide by (group std + this), > 0.
    # 1e-6 as verl; TRL's GRPOTrainer uses 1e-4
    adv_std_epsilon: float = 1e-6
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(pi || ref) from token rewards
    gamma: float = 1.0  # discount (GAE/returns)
    lam: float = 1.0  # GAE lambda
    kl_penalty: str = "kl"  # KL estimator for the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # KL controller section
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling section
    dpo: OnlineDPOConfig = field(default_factory=OnlineDPOConfig)  # jaxrl: online DPO section
    # PRIME (adv_estimator=prime; verl's recipe/prime keys and defaults): weights of the leave-one-out returns of the
    # implicit process rewards (reward_dpo_coef) and of the outcome rewards (reward_gt_coef) in the advantage
    reward_dpo_coef: float = 5.0
    reward_gt_coef: float = 5.0
    # jaxrl (verl's model.external_lib, for algorithms): module name(s) or .py file(s) imported when the config
    # loads, so the estimators / policy losses they register (@register_adv_estimator / @register_policy_loss from
    # jaxrl.algorithms.registry) are valid adv_estimator / policy_loss.loss_mode choices; str or list, null = none
    external_lib: Any = None


# ----------------------------------------------------------------------------------- critic
@dataclass
class CriticModelConfig:
    """``critic.model.*``: the value model (a decoder backbone plus a scalar value head)."""

    path: Optional[str] = None  # null = backbone initialised from the actor's model (verl needs an explicit path)
    enable_gradient_checkpointing: Optional[bool] = None  # null = actor_rollout_ref.model's value (filled)
    recompute_granularity: Optional[str] = None  # "full" | "selective"; null = actor_rollout_ref.model's (filled)
    dtype: Optional[str] = None  # compute dtype "float32" | "bfloat16"; null = actor_rollout_ref.model.dtype (filled)
    param_dtype: Optional[str] = None  # master param dtype; null = actor_rollout_ref.model.param_dtype (filled)
    # packed rows for the value forward / backward; null = actor_rollout_ref.model.use_remove_padding (filled; verl's
    # own default is false, so a verl command line that sets only the model key packs the critic here too)
    use_remove_padding: Optional[bool] = None
    # LoRA on the value model's backbone (verl's critic keys): adapters and the value head train, the backbone is
    # frozen; 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 16  # adapter output scaled by lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # as actor_rollout_ref.model.target_modules


@dataclass
class CriticConfig:
    """``critic.*``: the PPO value function (used when algorithm.adv_estimator=gae); batch sizes in prompts."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # value model section
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # optimizer section (verl critic lr 1e-5)
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic update (x rollout.n); null = actor's (filled)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per device per fwd/bwd; null = whole mini-batch
    forward_micro_batch_size_per_gpu: Optional[int] = None  # responses/device per value forward; null = the above (filled)
    use_dynamic_bsz: Optional[bool] = None  # micro-batches by a token budget (update and forward); null = the actor's
    ppo_max_token_len_per_gpu: int = 32768  # use_dynamic_bsz: real tokens per device per update micro-batch
    forward_max_token_len_per_gpu: Optional[int] = None  # the value forward's; null = ppo_max_token_len_per_gpu (filled)
    ppo_epochs: Optional[int] = None  # passes over each RL batch; null = actor's (filled)
    shuffle: bool = False  # shuffle responses before splitting into mini-batches
    cliprange_value: float = 0.5  # value clipping half-width around the rollout-time values, >= 0
    grad_clip: float = 1.0  # max global gradient norm; <= 0 disables clipping
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm


# ---------------------------------------------------------------------------------- trainer
@dataclass
class MeshConfig:
    """``trainer.mesh.*``: the TRAIN device mesh, axes ``(data, fsdp, tensor)`` (jaxrl; verl has FSDP configs).

    All three null (the default) and ``trainer.placement=colocated``: no mesh, every role runs on one device
    (jax's default device), exactly as a single-device run. Set any axis (or ``trainer.placement=split``) and the
    actor, reference and critic run SPMD on the mesh: parameters and optimizer state sharded by
    ``trainer.sharding_rules``, batch rows split over ``data x fsdp``. Then an unset axis is 1, except ``fsdp``,
    which is -1 (fill) unless another axis is -1. At most one axis may be -1: it takes the train devices left
    over by the others. The product must equal the train device count (all of ``jax.devices()`` with
    colocated placement, all but ``trainer.rollout_devices`` with split). As in verl, every
    ``*_micro_batch_size_per_gpu`` counts the rows of one micro-batch on each data-parallel device: with a mesh
    those are its batch shards (``data x fsdp`` under the default rules), so one micro-batch on the mesh is
    ``value x data x fsdp`` rows; ``ppo_mini_batch_size x rollout.n`` must split evenly over them and the
    per-device micro-batch must divide each device's share (``jaxrl.config.batch_plan``).
    """

    data: Optional[int] = None  # data-parallel size: params replicated, rows split; null = 1
    fsdp: Optional[int] = None  # fully-sharded data parallel: rows split and params sharded (ZeRO-3); null = -1 (fill)
    tensor: Optional[int] = None  # tensor parallel: heads / mlp / vocab split; null = 1


@dataclass
class DistributedConfig:
    """``trainer.distributed.*``: how the processes of a multi-process run (one per host) form one JAX world
    (jaxrl; verl places its workers with Ray). See :mod:`jaxrl.distributed` and the README's "Multi-host".

    ``mode``: ``local`` (one process), ``env`` (the explicit world: ``JAXRL_COORDINATOR_ADDRESS``,
    ``JAXRL_NUM_PROCESSES``, ``JAXRL_PROCESS_ID``, optional ``JAXRL_LOCAL_DEVICE_COUNT``, or the keys below; what
    ``python -m jaxrl.launch`` sets) or ``auto`` (``jax.distributed.initialize()`` detects Cloud TPU, SLURM,
    Open MPI, GKE). null: ``env`` when ``JAXRL_COORDINATOR_ADDRESS`` or ``coordinator_address`` is set, else
    ``local``. A value given both as an environment variable and as a key must agree.
    """

    mode: Optional[str] = None  # local | env | auto; null = env when a coordinator address is set, else local
    coordinator_address: Optional[str] = None  # host:port of process 0's coordinator (JAXRL_COORDINATOR_ADDRESS)
    num_processes: Optional[int] = None  # processes in the world (JAXRL_NUM_PROCESSES)
    process_id: Optional[int] = None  # this process's index, 0 = the primary (JAXRL_PROCESS_ID)
    local_device_count: Optional[int] = None  # CPU only: devices each process simulates (JAXRL_LOCAL_DEVICE_COUNT)
    # where process 0's coordinator listens; null = its own address when that is loopback (127.0.0.1 / localhost /
    # ::1: never all interfaces), else jax's default (all interfaces, [::]:port)
    coordinator_bind_address: Optional[str] = None
    heartbeat_timeout_s: int = 10  # a process silent this long is dead: the others stop (jax's default: 100)
    shutdown_timeout_s: int = 30  # how long a finishing process waits for the others at exit (jax's: 300)
    initialization_timeout_s: int = 300  # how long a process waits for all others to join at start


@dataclass
class RayConfig:
    """``trainer.ray.*``: how the Ray launcher (``trainer.launcher=ray``) places the run's hosts on a Ray cluster
    (jaxrl). One bundle per host, each on a distinct node, one actor per bundle holding all of that host's
    accelerators; see :mod:`jaxrl.ray_backend` and the README's "Ray cluster".
    """

    # the Ray resource each host's bundle holds trainer.n_gpus_per_node of: GPU | TPU (one TPU slice, placed with
    # ray.util.tpu) | CPU (a bundle of 1 CPU per node, devices from the platform or trainer.distributed.
    # local_device_count); auto = TPU when the cluster has TPUs, else GPU when it has GPUs, else CPU
    resource: str = "auto"
    tpu_topology: Optional[str] = None  # TPU: the slice topology, e.g. 2x2x2; null = the TPU nodes' label
    tpu_accelerator: Optional[str] = None  # TPU: the generation, e.g. v4, v5p, v6e; null = the TPU nodes' label
    placement_timeout_s: int = 300  # how long the driver waits for the cluster to hold every host (then exit 1)


@dataclass
class TrainerConfig:
    """``trainer.*``: loop length, validation/checkpoint cadence, logging, world size."""

    total_epochs: int = 30  # passes over the train set
    total_training_steps: Optional[int] = None  # null = total_epochs x steps per epoch; else stops at this step
    test_freq: int = -1  # validate every N steps; -1 = off
    save_freq: int = -1  # checkpoint every N steps; -1 = off
    val_before_train: bool = True  # validate once before the first step
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console|jsonl|tensorboard|wandb
    project_name: str = "verl_examples"  # experiment group name
    experiment_name: str = "gsm8k"  # run name
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # checkpoints + logs
    # accelerator devices per host (data-parallel world = this x nnodes); with several processes it must equal each
    # process's device count
    n_gpus_per_node: int = 8
    nnodes: int = 1  # hosts = processes of the run (jaxrl.distributed); must equal the process count
    # steps at the start that update only the critic (verl's actor starts at step == critic_warmup, one step earlier)
    critic_warmup: int = 0
    seed: int = 1  # jaxrl: global seed (data shuffle and sampling default to it)
    log_val_generations: int = 0  # number of validation samples (prompt, response, score) to log
    resume_mode: str = "auto"  # "auto" (latest checkpoint in default_local_dir, if any) | "disable" | "resume_path"
    resume_from_path: Optional[str] = None  # resume_path: a run's checkpoint dir or one of its global_step_<N> dirs
    max_actor_ckpt_to_keep: Optional[int] = None  # keep the newest N checkpoints; null (or 0) = keep all
    max_critic_ckpt_to_keep: Optional[int] = None  # same for the critic (both live in one step dir: the max applies)
    max_nonfinite_steps: int = 3  # jaxrl: abort after N consecutive steps with a non-finite loss or grad norm
    checkpoint_async: bool = True  # jaxrl: write checkpoints in a background thread (training goes on meanwhile)
    # jaxrl: JAX's persistent compilation cache (jaxrl.compilation_cache): a rerun or resume loads the compiled
    # programs instead of compiling them; null = off. The env var JAX_COMPILATION_CACHE_DIR, when set, wins.
    jax_compilation_cache_dir: Optional[str] = "~/.cache/jaxrl/jax_compilation_cache"
    # jaxrl: the most prompt widths whose compiled programs stay in host memory (jaxrl.program_budget): past it, every
    # compiled program is dropped before the update and compiled (or loaded from the cache above) again when met;
    # null = keep every program. Synchronous single-controller runs only (not with async_training, not hybrid).
    max_compiled_prompt_widths: Optional[int] = None
    mesh: MeshConfig = field(default_factory=MeshConfig)  # jaxrl: the train mesh section (all null = one device)
    # jaxrl: where the rollout engine runs when a mesh is on. "colocated": on the train devices, the weights
    # re-laid-out for it (tensor-parallel over rollout.tensor_model_parallel_size, replicas over the rest);
    # "split": on its own trainer.rollout_devices devices (the last ones of jax.devices()), the train mesh on the
    # rest; weights move device to device at every sync. split turns the mesh on even when trainer.mesh is unset;
    # with rollout.name=vllm, vLLM runs as a worker process on those devices (it places its own weights).
    placement: str = "colocated"
    rollout_devices: Optional[int] = None  # jaxrl: split only: devices the rollout engine gets (>= 1); null otherwise
    # jaxrl: overrides of the logical-axis rules, {logical name: mesh axis | [mesh axes] | null (replicated)}, on top
    # of sharding.rules.DEFAULT_RULES: batch->[data, fsdp], vocab->tensor, embed->fsdp, heads->tensor,
    # kv_heads->tensor, head_dim->null, mlp->tensor, layers->null. E.g. {embed: null} = no FSDP weight sharding.
    # A dimension its mesh axes do not divide is replicated. Give it as a mapping:
    # 'trainer.sharding_rules={embed: null}' (a dotted trainer.sharding_rules.embed=... is not a key).
    sharding_rules: Optional[dict[str, Any]] = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # jaxrl: the processes' world
    # jaxrl: who starts the run's processes. "local": this process is (one process of) the run; "ray": this
    # process is a thin driver that places one actor per host on the Ray cluster at RAY_ADDRESS (trainer.nnodes
    # hosts x trainer.n_gpus_per_node accelerators), each running this same command as one process of the world.
    # null = "ray" when RAY_ADDRESS is set (`ray job submit` sets it for its entrypoint) and this process was given
    # no world to join (JAXRL_* / trainer.distributed: a process of a run is never a driver), else "local".
    launcher: Optional[str] = None
    # jaxrl, Ray launcher only: times the driver restarts the whole group after a failure, each restart resuming from
    # the newest checkpoint in trainer.default_local_dir (0 = the first failure ends the run)
    max_restarts: int = 0
    ray: RayConfig = field(default_factory=RayConfig)  # jaxrl: trainer.launcher=ray placement


# ------------------------------------------------------------------------------ rewards
@dataclass
class OverlongBufferConfig:
    """``reward_model.overlong_buffer.*``: DAPO soft overlong punishment.

    A response of ``L`` tokens gets ``min(0, -(L - (max_response_length - len)) / len * penalty_factor)``
    added to its score: 0 up to ``max_response_length - len`` tokens, then linearly down to
    ``-penalty_factor`` at ``max_response_length``.
    """

    enable: bool = False  # add the overlong penalty to every score
    # len / penalty_factor defaults are the DAPO recipe's (verl's yaml has placeholders 0 / 0.0).
    len: int = 4096  # buffer length in tokens; in [1, data.max_response_length] when enabled
    penalty_factor: float = 1.0  # penalty at the full response length, >= 0
    log: bool = False  # also log reward/overlong_ratio (the fraction of responses penalised)


@dataclass
class SandboxFusionConfig:
    """``reward_model.sandbox_fusion.*`` (verl): a Sandbox Fusion server for code rewards."""

    url: Optional[str] = None  # its run_code endpoint (http://HOST:PORT/run_code); null = jaxrl's local sandbox
    max_concurrent: int = 64  # requests in flight at most (jaxrl: caps the scoring processes while url is set)
    memory_limit_mb: int = 1024  # memory of each code run, in MiB (also for jaxrl's local sandbox)


@dataclass
class SandboxConfig:
    """``reward_model.sandbox.*`` (jaxrl): how code rewards run model-written code on this machine (jaxrl.sandbox)
    and how its test cases make a score. The memory limit is reward_model.sandbox_fusion.memory_limit_mb."""

    # "bwrap": in bubblewrap (no network, read-only system and Python, private /tmp; refuses to start when bubblewrap
    # does not work here). "none": unisolated, with this user's rights, network and files: ONLY FOR TRUSTED CODE
    isolation: str = "bwrap"
    # "fraction": the fraction of the first 10 test cases that pass (verl's continuous score); "all_pass": 1.0 when
    # every test case passes, else 0.0
    score: str = "fraction"
    wall_s: float = 10.0  # wall seconds of one test case (verl: 10); a response's cases share 80% of timeout_s
    cpu_s: float = 10.0  # CPU seconds of one test case
    max_processes: int = 64  # processes and threads at once
    max_output_bytes: int = 4194304  # stdout + stderr of one run, bytes; the run is killed past it
    tmp_mb: int = 64  # size of the private writable /tmp, MiB


@dataclass
class PRMOptimConfig(OptimConfig):
    """``reward_model.model.optim.*``: PRIME's implicit PRM optimizer (verl's recipe: lr 1e-6, no weight decay,
    grad_clip 10)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 10.0  # max global gradient norm; <= 0 disables clipping


@dataclass
class RewardModelModelConfig:
    """``reward_model.model.*``: the reward model checkpoint (used when ``reward_model.enable``)."""

    # a Hugging Face Llama/Qwen2/Qwen3 *ForSequenceClassification directory (safetensors); required when enabled
    path: Optional[str] = None
    # tokenizer of the policy's ids; set = decode each response and re-tokenize it with the RM's own tokenizer and
    # chat template (verl's default: the policy path); null = the RM reads the policy's token ids as they are
    input_tokenizer: Optional[str] = "${actor_rollout_ref.model.path}"
    # ---- PRIME's implicit PRM (algorithm.adv_estimator=prime; verl's recipe/prime keys). There path is a causal LM
    # (null = the policy's initial weights) that reads the policy's token ids, trained online every step.
    ref_path: Optional[str] = None  # PRIME: the PRM's frozen reference; null = the PRM's initial weights (verl)
    ref_type: str = "freeze"  # PRIME: the reference stays frozen (verl's only value)
    # PRIME: "before" = update the PRM on the step's responses, then score them with it (verl's default);
    # "after" = score with the PRM as it was before this step's update, then update; "none" = never update
    update: str = "before"
    beta_train: float = 0.05  # PRIME: beta of the implicit reward beta * log(pi_phi / pi_ref), > 0
    loss_type: str = "ce"  # PRIME: the PRM's loss: "ce" (cross-entropy on the sequence implicit reward)
    optim: "PRMOptimConfig" = field(default_factory=lambda: PRMOptimConfig())  # PRIME: the PRM's optimizer


@dataclass
class RewardModelConfig:
    """``reward_model.*``: reward scoring: rule-based (reward manager) and, with ``enable``, a reward model."""

    enable: bool = False  # True = also score every response with the model at reward_model.model.path
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)  # reward model checkpoint
    micro_batch_size_per_gpu: Optional[int] = None  # responses per device per RM forward (PRIME: and update); null = all
    # PRIME: responses per PRM optimizer update (verl counts responses here); null = actor.ppo_mini_batch_size's value
    mini_batch_size: Optional[int] = None
    prime_granularity: str = "token"  # PRIME: "token" (a reward per token) | "whole" (their sum on the last token)
    prime_norm: str = "batch_norm"  # PRIME: "batch_norm" (divide by the largest |return-to-go|) | "none"
    max_length: Optional[int] = None  # re-tokenized RM input width (longer: cut on the right); null = prompt+response
    # jaxrl: how the RM score and the rule score make the reward. "replace" (verl: its reward managers return the
    # RM's scores and skip the rule function): reward = RM score; rows whose reward_model.style is "rule" are still
    # rule-scored, for the log only. "sum": reward = RM score + rule score (every row rule-scored).
    combine: str = "replace"
    # "naive" (one call per response), "prime" (= naive: calls already run in parallel processes), "dapo"
    # (naive + verl's DAPO overlong buffer from reward_kwargs), "batch" (one call with whole lists)
    reward_manager: str = "naive"
    # manager arguments (verl's +reward_model.reward_kwargs.*): dapo reads overlong_buffer_cfg.{enable,len,
    # penalty_factor,log} and max_resp_len; batch passes them to the function as keyword arguments
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0  # jaxrl: seconds one reward call may run (batch: the whole call); its process is killed
    num_workers: Optional[int] = None  # scoring processes; null = min(8, CPUs); 0 = in the trainer's thread (debug)
    # jaxrl: stop the run (exit 1) when more than this fraction of a batch's reward calls fail (errors +
    # timeouts); null = only when all of them fail
    max_error_fraction: Optional[float] = None
    # jaxrl: how the built-in MATH scorer (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500)
    # compares answers: "rule" (last \boxed{} + Hendrycks string normalisation, verl's default) or "math_verify"
    # (symbolic equivalence with the math-verify package)
    math_verifier: str = "rule"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO overlong section
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # jaxrl: code rewards on this machine
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)  # verl: a Sandbox Fusion server


@dataclass
class CustomRewardFunctionConfig:
    """``custom_reward_function.*``: a user ``compute_score`` in a Python file."""

    path: Optional[str] = None  # .py file holding the function; null = built-in scorer by data_source
    name: str = "compute_score"  # function name inside that file
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for every call


# ---------------------------------------------------------------------------- async training
@dataclass
class AsyncTrainingConfig:
    """``async_training.*``: generation ahead of training (verl's one-step-off-policy and fully-async recipes).

    ``staleness`` k >= 1 turns the pipeline on (:mod:`jaxrl.async_rollout`): while the trainer updates on step b's
    batch, the rollout engine generates the batch of step b + k with the weights of step b - 1 (version b - 1: the
    updates applied so far), so every trained batch is at most k policy versions old (verl's one-step-off-policy
    is k = 1). Each row carries the version that generated it (``RLBatch.policy_version``); the actor's PPO ratio is
    against its recomputed log-probs and ``actor_rollout_ref.actor.tis_imp_ratio_cap`` corrects for the rollout
    policy (verl's rollout correction). 0 = synchronous (every batch from the current weights).
    """

    staleness: int = 0  # jaxrl: the most policy versions a trained batch may lag the trainer; 0 = synchronous
    # verl: a response unfinished at a weight sync continues under the new weights. jaxrl: each batch is generated in
    # `staleness` stages of ceil(R / staleness) tokens, one per step, each with the latest weights (staleness >= 2)
    partial_rollout: bool = False


# ------------------------------------------------------------------------------- top level
@dataclass
class JaxRLConfig:
    """The whole run config (verl's top-level sections)."""

    data: DataConfig = field(default_factory=DataConfig)  # datasets and lengths
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)  # policy side
    critic: CriticConfig = field(default_factory=CriticConfig)  # value function (PPO / gae)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantage + KL-in-reward
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # loop, cadence, logging
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)  # reward scoring
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # generation ahead of training


# ------------------------------------------------------------------------- key inventory
def _walk(cls: type, prefix: str, leaves: dict[str, Any], sections: dict[str, type]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sections[key] = tp
            _walk(tp, key, leaves, sections)
        else:
            leaves[key] = tp


def schema_keys(root: Optional[type] = None) -> tuple[dict[str, Any], dict[str, type]]:
    """Return ``(leaves, sections)`` of the schema rooted at ``root`` (default :class:`JaxRLConfig`).

    ``leaves`` maps every full dotted leaf key (``"actor_rollout_ref.actor.optim.lr"``) to its
    annotated type (``float``, ``Optional[int]``, ``list[str]``, ``Any`` ...); ``sections`` maps
    every dotted section key (``"actor_rollout_ref.actor"``) to its dataclass.
    """
    leaves: dict[str, Any] = {}
    sections: dict[str, type] = {}
    _walk(JaxRLConfig if root is None else root, "", leaves, sections)
    return leaves, sections


def valid_keys() -> list[str]:
    """All valid full dotted leaf keys of :class:`JaxRLConfig`, in declaration order."""
    return list(schema_keys()[0])
