"""Helpers shared by ``bench/rollout_throughput.py``, ``bench/train_throughput.py`` and ``bench/scaling.py``.

Everything here runs in the main environment (jax + transformers); nothing imports vLLM.

* :func:`prompt_token_ids`: the workload's story prompts (``bench.workload.prompts``) tokenized by a model
  directory's tokenizer and cycled to any number of rows, so every engine sees identical token ids.
* :func:`train_flops_per_token`: the model-FLOPs formula the MFU numbers use (stated in its docstring).
* :func:`actor_config` / :func:`synthetic_batch`: the trainer's validated ``actor_rollout_ref.actor`` section and
  an :class:`~jaxrl.batch.RLBatch` with fixed prompt / response widths, for timing ``ActorWorker.update``.
* :func:`ensure_mid_qwen2`: a mid-size random Qwen2 (hidden 512, 8 layers) for the model-size axis of
  ``bench/scaling.py``, built like ``bench/models.py``'s ``tiny-qwen2``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import prompts as workload_prompts  # noqa: E402

__all__ = [
    "ensure_mid_qwen2", "MID_QWEN2", "prompt_token_ids", "FlopsModel", "train_flops_per_token", "actor_config",
    "synthetic_batch", "model_shape",
]


MID_QWEN2 = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
)


def ensure_mid_qwen2(force: bool = False) -> Path:
    """Build (or reuse) ``outputs/bench/models/mid-qwen2``; returns its directory.

    A randomly initialised ``Qwen2ForCausalLM`` (seed 0, float32) with :data:`MID_QWEN2` (hidden 512, intermediate
    1536, 8 layers, 8 heads / 2 kv heads, head_dim 64, tied embeddings) and SmolLM2's tokenizer and vocabulary
    (49152), i.e. ``tiny-qwen2`` scaled up; about 50 M parameters of which 25 M are the embedding.
    """
    from bench.models import MODELS_DIR, build_random_qwen2, complete

    out = MODELS_DIR / "mid-qwen2"
    if force or not complete(out):
        build_random_qwen2(out, MID_QWEN2)
    return out


def prompt_token_ids(tokenizer, rows: int, *, max_prompt_length: int = 64) -> list[list[int]]:
    """``rows`` prompts as token-id lists: the workload's first 8 story openings, cycled.

    Args:
      tokenizer: an HF tokenizer (``encode`` without special tokens; raw text, no chat template, like
        ``bench/workload.py``).
      rows: how many prompts (>= 1).
      max_prompt_length: every prompt must fit in this many tokens.

    Raises:
      ValueError: ``rows < 1`` or a prompt longer than ``max_prompt_length`` tokens.
    """
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1")
    base = [list(tokenizer.encode(t, add_special_tokens=False)) for t in workload_prompts()]
    too_long = [len(p) for p in base if len(p) > max_prompt_length]
    if too_long:
        raise ValueError(f"workload prompts of {too_long} tokens exceed max_prompt_length={max_prompt_length}")
    return [base[i % len(base)] for i in range(rows)]


@dataclass(frozen=True)
class FlopsModel:
    """Training FLOPs (forward + backward = 3x forward) of a decoder for a sequence length ``T``.

    Attributes:
      n_nonembedding: parameters excluding the token embedding and the LM head (attention + MLP + norms).
      n_lm_head: ``V * H``, the LM-head matmul's weights (tied or not; the head runs as a matmul either way).
      attention: ``12 * L * nH * D * T`` FLOPs per token (QK^T and AV, forward + backward, full ``T x T`` score
        matrix as PaLM counts it; the causal half is computed and masked here too).
      base: ``6 * n_nonembedding + attention`` FLOPs per token (the formula the goal line uses).
      head: ``6 * n_lm_head`` FLOPs per *scored* token: the update needs logits only at the ``R`` positions that
        score response tokens (jaxrl's actor slices the hidden states to them before the head), so a batch of
        ``B`` rows costs ``base * B * T + head * B * R``.
    """

    n_nonembedding: int
    n_lm_head: int
    attention: int
    base: int
    head: int


def model_shape(cfg) -> dict[str, int]:
    """``{"L", "H", "I", "nH", "nKV", "D", "V"}`` of a :class:`jaxrl.models.ModelConfig`."""
    return {"L": cfg.num_hidden_layers, "H": cfg.hidden_size, "I": cfg.intermediate_size,
            "nH": cfg.num_attention_heads, "nKV": cfg.num_key_value_heads, "D": cfg.head_dim, "V": cfg.vocab_size}


def train_flops_per_token(cfg, seq_len: int) -> FlopsModel:
    """Model FLOPs of training on sequences of ``seq_len`` tokens (see :class:`FlopsModel`).

    Formula: ``6 N + 12 L nH D T`` with ``N`` the non-embedding parameter count -- PaLM (Chowdhery et al. 2022,
    arXiv 2204.02311, Appendix B, the MFU definition) and Kaplan et al. 2020 (arXiv 2001.08361, Sec. 2.1:
    ``C_forward ~ 2N + 2 n_layer n_ctx d_attn``, training = 3x forward). Element-wise work (norms, RoPE, softmax,
    SiLU, the optimizer) is not counted, as in both papers.

    Args:
      cfg: the model's :class:`jaxrl.models.ModelConfig`.
      seq_len: tokens per sequence ``T`` (prompt + response width, padding included: the model computes it).
    """
    s = model_shape(cfg)
    L, H, I, nH, nKV, D, V = s["L"], s["H"], s["I"], s["nH"], s["nKV"], s["D"], s["V"]
    attn_params = H * nH * D + 2 * H * nKV * D + nH * D * H
    if cfg.attention_bias:
        attn_params += nH * D + 2 * nKV * D
    per_layer = attn_params + 3 * H * I + 2 * H + (2 * D if cfg.qk_norm else 0)
    n_nonembed = L * per_layer + H
    attention = 12 * L * nH * D * seq_len
    base = 6 * n_nonembed + attention
    return FlopsModel(n_nonembedding=n_nonembed, n_lm_head=V * H, attention=attention, base=base, head=6 * V * H)


def actor_config(rows: int, micro_rows: int, *, remat: bool = False, extra: tuple[str, ...] = ()):
    """The trainer's validated ``actor_rollout_ref.actor`` section and the actor's batch plan
    (:class:`jaxrl.config.batch_plan.RolePlan`) for one update over ``rows`` responses.

    GRPO defaults of the workload (``bench/workload.py``): one mini-batch of all ``rows`` (``rollout.n=1``), micro
    batches of ``micro_rows``, AdamW lr 1e-6, grad clip 1.0, no KL, no entropy term, float32.

    Raises:
      jaxrl.config.ConfigError: ``micro_rows`` does not divide ``rows`` (or another invalid combination).
    """
    from jaxrl.config import load_config
    from jaxrl.config.batch_plan import BatchPlan

    overrides = [
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.n=1", f"data.train_batch_size={rows}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_rows}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_rows}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(remat).lower()}",
        "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.model.param_dtype=float32", *extra,
    ]
    cfg = load_config(None, overrides)
    return cfg.actor_rollout_ref.actor, BatchPlan.from_config(cfg).actor


def synthetic_batch(tokenizer, rows: int, prompt_width: int, response_len: int, vocab_size: int, *,
                    seed: int = 0):
    """An :class:`~jaxrl.batch.RLBatch` with every response exactly ``response_len`` tokens long.

    Prompts are the workload prompts (left-padded to ``prompt_width``); responses are uniform random ids (what
    they are does not change the work); old log-probs ~ -U(0.5, 5) nats, advantages ~ N(0, 1) per group of one.

    Raises:
      ValueError: a prompt is longer than ``prompt_width``.
    """
    from jaxrl.batch import RLBatch

    rng = np.random.default_rng(seed)
    ids = prompt_token_ids(tokenizer, rows, max_prompt_length=prompt_width)
    prompt_ids = np.zeros((rows, prompt_width), np.int32)
    prompt_mask = np.zeros((rows, prompt_width), np.int32)
    for i, p in enumerate(ids):
        prompt_ids[i, prompt_width - len(p):] = p
        prompt_mask[i, prompt_width - len(p):] = 1
    resp = rng.integers(0, vocab_size, size=(rows, response_len), dtype=np.int32)
    old = -rng.uniform(0.5, 5.0, size=(rows, response_len)).astype(np.float32)
    adv = np.repeat(rng.standard_normal((rows, 1)).astype(np.float32), response_len, axis=1)
    return RLBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp,
                   response_mask=np.ones((rows, response_len), np.int32), group_ids=np.arange(rows, dtype=np.int32),
                   rollout_log_probs=old, old_log_probs=old, advantages=adv)
