"""Gradient accumulation is exact: grad over a mini-batch == sum of grads over its micro-batches.

A tiny linear-softmax policy (logits = features @ W, W [H, V]) trained with
``policy loss + kl_coef * agg(kl) - entropy_coeff * agg(entropy)``, with every term aggregated
with the mini-batch's global normalisers (``num_tokens``, ``num_seqs``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_grpo_outcome_advantage,
    compute_policy_loss_vanilla,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
)

B, R, H, V = 8, 6, 5, 11
MICRO = 2
KL_COEF, ENTROPY_COEFF = 0.05, 0.01


def make_minibatch(seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(B, R, H)).astype(np.float32)
    labels = rng.integers(0, V, size=(B, R)).astype(np.int32)
    lengths = rng.integers(1, R + 1, size=B)
    lengths[3] = 0  # one zero-length response
    mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    w = rng.normal(size=(H, V)).astype(np.float32)
    w_old = (w + 0.5 * rng.normal(size=(H, V))).astype(np.float32)  # behaviour policy: ratios get clipped
    w_ref = (w + 0.3 * rng.normal(size=(H, V))).astype(np.float32)
    logprob = jax.jit(lambda w_: log_probs_from_logits(feats @ w_, labels))
    old_lp, ref_lp = np.asarray(logprob(w_old)), np.asarray(logprob(w_ref))
    rewards = np.zeros((B, R), np.float32)
    rewards[np.arange(B), np.maximum(lengths - 1, 0)] = rng.normal(size=B)
    group_ids = np.repeat(np.arange(0, B, 4), 4).astype(np.int32)  # 2 groups of 4
    adv, _ = jax.jit(compute_grpo_outcome_advantage)(rewards, mask, group_ids)
    batch = dict(feats=feats, labels=labels, mask=mask, old_lp=old_lp, ref_lp=ref_lp, adv=np.asarray(adv))
    return w, batch


def loss_fn(w, batch, mode, num_tokens, num_seqs):
    logits = batch["feats"] @ w
    log_prob = log_probs_from_logits(logits, batch["labels"])
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    pg_loss, metrics = compute_policy_loss_vanilla(
        batch["old_lp"], log_prob, batch["adv"], batch["mask"],
        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, **norm,
    )
    kl = agg_loss(kl_penalty(log_prob, batch["ref_lp"], "low_var_kl"), batch["mask"], mode, **norm)
    ent = agg_loss(entropy_from_logits(logits), batch["mask"], mode, **norm)
    return pg_loss + KL_COEF * kl - ENTROPY_COEFF * ent, metrics


@jax.jit
def grads_all_modes(w, batch, num_tokens, num_seqs):
    """{mode: ((loss, metrics), dloss/dW)} for every loss_agg_mode, in one compiled function."""
    return {
        mode: jax.value_and_grad(loss_fn, has_aux=True)(w, batch, mode, num_tokens, num_seqs)
        for mode in LOSS_AGG_MODES
    }


def micro_batches(batch):
    return [{k: v[i : i + MICRO] for k, v in batch.items()} for i in range(0, B, MICRO)]


@pytest.fixture(scope="module")
def results():
    w, batch = make_minibatch()
    num_tokens = jnp.float32(batch["mask"].sum())
    num_seqs = jnp.float32(B)
    full = grads_all_modes(w, batch, num_tokens, num_seqs)
    micro = [grads_all_modes(w, mb, num_tokens, num_seqs) for mb in micro_batches(batch)]
    naive = [grads_all_modes(w, mb, None, None) for mb in micro_batches(batch)]
    return full, micro, naive


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_microbatch_grads_sum_to_minibatch_grad(mode, results):
    full, micro, naive = results
    (full_loss, metrics), full_grad = full[mode]
    # the clipped and dual-clipped branches are part of the gradient
    assert float(metrics["pg_clipfrac"]) > 0.05 and float(metrics["pg_clipfrac_lower"]) > 0.0
    assert np.isfinite(float(full_loss)) and float(jnp.abs(full_grad).max()) > 1e-3

    acc_loss = sum(m[mode][0][0] for m in micro)
    acc_grad = sum(m[mode][1] for m in micro)
    np.testing.assert_allclose(float(acc_loss), float(full_loss), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(full_grad), rtol=0, atol=1e-6)

    if mode == "token-mean":
        # Without the global token count, averaging micro-batch token-means is not the mini-batch
        # token-mean (micro-batches hold different numbers of valid tokens). Equal-size micro-batches
        # make the naive average exact for the seq-mean-* modes, so only token-mean is checked here.
        naive_grad = sum(m[mode][1] for m in naive) / len(naive)
        assert float(jnp.abs(naive_grad - full_grad).max()) > 1e-4
