"""Shared pieces of the vLLM tests: tiny random decoders (head_dim 32, vLLM's CPU attention minimum), their
prompts, the trainer's log-prob recompute and the rollout comparison. Imports no vLLM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.rollout.sampling import token_log_probs

PAD, BOS, EOS = 0, 1, 2
P, R = 32, 12
PROMPTS = [[BOS, 5, 6, 7, 8, 9, 10, 11, 12, 13], [BOS, 40, 41], [BOS] + list(range(60, 80))]


def tiny_cfg(model_type: str) -> ModelConfig:
    return ModelConfig(
        model_type=model_type, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3", bos_token_id=BOS, eos_token_id=(EOS,), pad_token_id=PAD,
        max_position_embeddings=256, rope_theta=10000.0,
        # Qwen3 tied like the real Qwen3-0.6B/1.7B (the CPU LM head needs a repack after each reload), Qwen2 untied.
        tie_word_embeddings=model_type == "qwen3",
    )


def scaled(state, scale: float, seed: int):
    """Matrices times ``scale * (1 + 0.3 * noise)``: peaked next-token distributions (few near-ties)."""
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x * scale * (1 + 0.3 * jax.random.normal(k, x.shape, x.dtype)) if x.ndim >= 2 else x
           for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, out)


def recompute_log_probs(graphdef, params, out, temperature: float) -> np.ndarray:
    """The trainer's view: one full forward over [prompt | response], log_softmax(logits / T) at each response token."""
    model = nnx.merge(graphdef, params)
    ids = np.concatenate([out.prompt_ids, out.response_ids], axis=1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    logits, _ = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))
    width = out.prompt_ids.shape[1]
    pred = logits[:, width - 1: -1]  # position width-1+t predicts response token t
    b, r, v = pred.shape
    lp = token_log_probs(pred.reshape(b * r, v), jnp.asarray(out.response_ids).reshape(-1), temperature)
    return np.asarray(lp).reshape(b, r) * out.response_mask


def assert_same_rollout(a, b, *, logprob_atol: float):
    for name in ("prompt_ids", "prompt_mask", "response_mask", "response_ids", "prompt_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=logprob_atol, rtol=0)
