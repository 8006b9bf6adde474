"""Tiny models, configs and batches that many tests build (import: ``from tests.helpers import ...``).

Everything here is built from the real classes (the schema dataclasses, :class:`~jaxrl.models.config.ModelConfig`,
:class:`~jaxrl.batch.RLBatch`), so a test that uses it exercises what the trainer uses.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.config.schema import ActorConfig, CriticConfig, JaxRLConfig, OptimConfig, PolicyLossConfig
from jaxrl.models.config import ModelConfig

# ---------------------------------------------------------------------------------------------- models
# Model-type specific switches of the tiny decoders: Qwen2 has q/k/v biases, Qwen3 q/k RMS norms.
_FAMILY = {"llama": {}, "qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": True}}


def tiny_model_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer decoder config: vocab 64, hidden 32, 4 query / 2 key-value heads of 8, MLP 64, 128 positions,
    bos 1, eos 2, pad 0 (``model_type`` ``llama`` | ``qwen2`` | ``qwen3``; any field can be overridden)."""
    base = dict(
        model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, bos_token_id=1, eos_token_id=(2,), pad_token_id=0,
    )
    base.update(_FAMILY[model_type])
    base.update(overrides)
    return ModelConfig(**base)


# --------------------------------------------------------------------------------------------- configs
def tiny_optim(**overrides) -> OptimConfig:
    """AdamW at lr 1e-2, no weight decay, constant schedule (fast, visible updates on tiny models)."""
    return dataclasses.replace(OptimConfig(lr=1e-2, weight_decay=0.0), **overrides)


def tiny_actor_config(**overrides) -> ActorConfig:
    """``actor_rollout_ref.actor`` for role tests: mini-batch 2 prompts, micro-batch 2 rows, one epoch, no
    shuffle, vanilla PPO loss with a low-var KL loss (0.1) and an entropy bonus (0.01). ``loss_mode=...`` sets
    ``policy_loss.loss_mode``."""
    loss_mode = overrides.pop("loss_mode", "vanilla")
    base = ActorConfig(
        optim=tiny_optim(), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1, shuffle=False,
        grad_clip=1.0, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", tis_imp_ratio_cap=-1.0,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    return dataclasses.replace(base, **overrides)


def tiny_critic_config(**overrides) -> CriticConfig:
    """``critic`` for role tests: mini-batch 2 prompts, micro-batch 2 rows, one epoch, no shuffle, value clip 0.5."""
    base = CriticConfig(
        optim=tiny_optim(), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
        forward_micro_batch_size_per_gpu=None, ppo_epochs=1, shuffle=False, grad_clip=1.0, cliprange_value=0.5, loss_agg_mode="token-mean",
    )
    return dataclasses.replace(base, **overrides)


def tiny_run_config(*, rows: int, rollout_n: int = 1, log_prob_micro: int | None = None, actor: ActorConfig | None = None,
                    critic: CriticConfig | None = None) -> JaxRLConfig:
    """A whole :class:`JaxRLConfig` around the role sections: ``rows`` responses per step
    (``data.train_batch_size = rows / rollout_n``), ``rollout.log_prob_micro_batch_size_per_gpu=log_prob_micro``."""
    if rows % rollout_n:
        raise ValueError(f"rows={rows} must be a multiple of rollout_n={rollout_n}")
    cfg = JaxRLConfig()
    cfg.data.train_batch_size = rows // rollout_n
    cfg.actor_rollout_ref.rollout.n = rollout_n
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = log_prob_micro
    cfg.actor_rollout_ref.actor = actor if actor is not None else tiny_actor_config()
    cfg.critic = critic if critic is not None else tiny_critic_config()
    return cfg


def actor_setup(*, rows: int, rollout_n: int = 1, log_prob_micro: int | None = None, batch_shards: int = 1,
                **actor_overrides):
    """``(actor_cfg, plan)`` for an :class:`~jaxrl.workers.actor.ActorWorker` on ``rows`` responses per step, its
    ``*_per_gpu`` sizes per device on ``batch_shards`` data-parallel devices (1 = no mesh)."""
    cfg = tiny_run_config(rows=rows, rollout_n=rollout_n, log_prob_micro=log_prob_micro,
                          actor=tiny_actor_config(**actor_overrides))
    return cfg.actor_rollout_ref.actor, BatchPlan.from_config(cfg, batch_shards=batch_shards).actor


def critic_setup(*, rows: int, rollout_n: int = 1, batch_shards: int = 1, **critic_overrides):
    """``(critic_cfg, plan)`` for a :class:`~jaxrl.workers.critic.CriticWorker` on ``rows`` responses per step, its
    ``*_per_gpu`` sizes per device on ``batch_shards`` data-parallel devices (1 = no mesh)."""
    cfg = tiny_run_config(rows=rows, rollout_n=rollout_n, critic=tiny_critic_config(**critic_overrides))
    return cfg.critic, BatchPlan.from_config(cfg, batch_shards=batch_shards).critic


# --------------------------------------------------------------------------------------------- batches
def tiny_batch(n: int = 8, seed: int = 0, *, prompt_width: int = 6, response_width: int = 5, vocab_size: int = 64,
               group_size: int = 2) -> tuple[RLBatch, np.random.Generator]:
    """A random left-padded :class:`RLBatch` of ``n`` rows: prompts of 2..P tokens, responses of 1..R tokens, token
    ids in ``[3, vocab_size)`` (never bos/eos/pad), groups of ``group_size`` consecutive rows.

    Returns:
      ``(batch, rng)``: the generator that drew it, to draw further arrays (advantages, log-probs) from the same
      stream.
    """
    rng = np.random.default_rng(seed)
    p, r = prompt_width, response_width
    prompt_len = rng.integers(2, p + 1, size=n)
    resp_len = rng.integers(1, r + 1, size=n)
    prompt_mask = (np.arange(p)[None] >= (p - prompt_len)[:, None]).astype(np.int32)
    response_mask = (np.arange(r)[None] < resp_len[:, None]).astype(np.int32)
    batch = RLBatch(
        prompt_ids=(rng.integers(3, vocab_size, (n, p)) * prompt_mask).astype(np.int32),
        prompt_mask=prompt_mask,
        response_ids=(rng.integers(3, vocab_size, (n, r)) * response_mask).astype(np.int32),
        response_mask=response_mask,
        group_ids=(np.arange(n) // group_size).astype(np.int32),
    )
    return batch, rng
