"""Clip-Cov and KL-Cov: the entropy-control policy losses of Cui et al. (arXiv 2505.22617).

Both pick a few tokens by the centred covariance of advantage and log-prob and treat them differently:
Clip-Cov cuts their gradient, KL-Cov adds a ``|log-ratio|`` penalty to them. They share the covariance,
the selection count and the top-k selection below; the call contract, the common helpers and the other
losses are in :mod:`jaxrl.algorithms.policy_loss`. Their own options (``clip_cov_*``, ``kl_cov_ratio``,
``ppo_kl_coef``) are declared in :mod:`jaxrl.algorithms.registry`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import agg_loss, masked_mean
from jaxrl.algorithms.policy_loss import _F32, _apply_is_weights, _check_positive, _frac, _metrics, _prepare

__all__ = ["compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov"]


def _selection_count(fraction, n_valid: jax.Array) -> jax.Array:
    """``max(int(fraction * n_valid), 1)`` as int32 (verl), in float32 with a 1e-6 relative tolerance
    so that an exact integer product is not floored down by float rounding."""
    k = jnp.floor(jnp.asarray(fraction, _F32) * n_valid.astype(_F32) * (1.0 + 1e-6))
    return jnp.maximum(k, 1.0).astype(jnp.int32)


def _top_k_mask(priority: jax.Array, candidate: jax.Array, k: jax.Array) -> jax.Array:
    """Boolean mask of the (at most) ``k`` candidates with the largest ``priority``.

    Ties go to the lower row-major index (stable sort), so the result is deterministic. ``k`` may
    be traced (the selection is a rank comparison, not a ``top_k`` with a static size).
    """
    shape = priority.shape
    flat = jnp.where(candidate, priority, -jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True, descending=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return candidate & (rank < k).reshape(shape)


def _token_covariance(advantages: jax.Array, log_prob: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token centred product ``(A - mean A) * (logp - mean logp)`` over valid tokens, no gradient
    (the covariance term of arXiv 2505.22617; verl's ``cov_all`` / ``cov_lst_all``)."""
    adv = jax.lax.stop_gradient(advantages).astype(_F32)
    logp = jax.lax.stop_gradient(log_prob).astype(_F32)
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov


def compute_policy_loss_clip_cov(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    rollout_is_weights: jax.Array | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    key: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clip-Cov: PPO-clip, plus the gradient of a few high-covariance tokens is cut (entropy control).

    ``r = exp(clip(log_prob - old_log_prob, -20, 20))``; ``L1 = -A r``, ``L2 = -A clip(r, 1 - lo,
    1 + hi)``. Per valid token the centred covariance term ``c = (A - mean A)(logp - mean logp)``
    (means over valid tokens, no gradient). Candidates: valid tokens not already clipped by PPO
    (``L2 <= L1``) with ``clip_cov_lb < c < clip_cov_ub``. Of those, ``k = max(int(clip_cov_ratio *
    n_valid), 1)`` are selected and get ``L = 0`` (no gradient); every other token gets
    ``max(L1, L2)`` (no dual clip, as verl). Times ``rollout_is_weights``, then ``agg_loss``.

    Selection: with ``key`` (a ``jax.random`` key) the ``k`` tokens are a uniformly random subset
    of the candidates (verl's ``torch.randperm``, here reproducible from the key). With
    ``key=None`` (default) the selection is deterministic: the ``k`` candidates with the largest
    covariance (ties to the lower row-major index). Pass a fresh key per step to match the paper.

    Deviation from verl: the log-ratio is clamped to [-20, 20] before ``exp`` (as in ``vanilla``;
    verl does not clamp here), which only matters where the ratio would exceed e^20.
    ``clip_ratio_c`` is accepted and unused.

    Metrics: ``pg_clipfrac`` = fraction of valid tokens whose gradient was cut (verl's value);
    ``ppo_kl`` = token mean of the clamped ``old_log_prob - log_prob``; ``pg_clipfrac_lower`` = 0.

    Sources: Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv 2505.22617), Clip-Cov; verl ``core_algos.compute_policy_loss_clip_cov``.

    Args:
      old_log_prob, log_prob, advantages, response_mask: ``[B, R]`` as in ``compute_policy_loss_vanilla``.
      clip_ratio_low, clip_ratio_high: PPO clip epsilons.
      clip_ratio_c: unused.
      loss_agg_mode, num_tokens, num_seqs: see ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` per-token weights, stop-gradient.
      clip_cov_ratio: fraction of valid tokens to cut, > 0 (verl default 2e-4).
      clip_cov_lb, clip_cov_ub: open covariance band for candidates (verl defaults 1.0, 5.0).
      key: optional PRNG key for the random selection; ``None`` = deterministic top covariance.

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``.

    Raises:
      ValueError: ``clip_cov_ratio <= 0`` (eager), unknown ``loss_agg_mode``, or mismatched shapes.
    """
    _check_positive("clip_cov_ratio", clip_cov_ratio)
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )
    negative_approx_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)

    valid = response_mask != 0
    clip_by_origin = (pg_losses2 > pg_losses1) & valid
    cov = _token_covariance(advantages, log_prob, response_mask)
    candidate = valid & ~clip_by_origin & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = _selection_count(clip_cov_ratio, jnp.sum(valid))
    priority = cov if key is None else jax.random.uniform(key, cov.shape, _F32)
    cut = _top_k_mask(priority, candidate, k)

    pg_losses = jnp.where(cut, jnp.zeros_like(pg_losses1), jnp.maximum(pg_losses1, pg_losses2))
    pg_losses = _apply_is_weights(pg_losses, is_w)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _metrics(response_mask, ppo_kl=-negative_approx_kl, pg_clipfrac=_frac(cut, response_mask))
    return pg_loss, metrics


def compute_policy_loss_kl_cov(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    rollout_is_weights: jax.Array | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-Cov: unclipped policy gradient, plus a |log-ratio| penalty on the top-covariance tokens.

    ``r = exp(clip(log_prob - old_log_prob, -20, 20))``, ``L = -A r`` on every token, except the
    ``k = max(int(kl_cov_ratio * n_valid), 1)`` valid tokens with the largest centred covariance
    ``(A - mean A)(logp - mean logp)`` (means over valid tokens, no gradient), which get
    ``L = -A r + ppo_kl_coef * |log_prob - old_log_prob|``. The selection is deterministic (a
    top-k, as verl; ties to the lower row-major index). No ratio clipping at all (the
    ``clip_ratio_*`` keywords are accepted and unused). Times ``rollout_is_weights``, then ``agg_loss``.

    Deviation from verl: the log-ratio is clamped to [-20, 20] (as in ``vanilla``) before ``exp``
    and in the penalty; it only matters beyond e^20.

    Metrics: ``ppo_kl`` = token mean of the clamped ``old_log_prob - log_prob`` (k1, as every loss);
    ``ppo_kl_abs`` = token mean of ``|log_prob - old_log_prob|`` (what verl reports as ``ppo_kl``
    for this loss); ``kl_cov_frac`` = fraction of valid tokens penalised; ``pg_clipfrac`` =
    ``pg_clipfrac_lower`` = 0.

    Sources: Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv 2505.22617), KL-Cov; verl ``core_algos.compute_policy_loss_kl_cov``.

    Args:
      old_log_prob, log_prob, advantages, response_mask: ``[B, R]`` as in ``compute_policy_loss_vanilla``.
      clip_ratio_low, clip_ratio_high, clip_ratio_c: unused.
      loss_agg_mode, num_tokens, num_seqs: see ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` per-token weights, stop-gradient.
      kl_cov_ratio: fraction of valid tokens to penalise, > 0 (verl default 2e-4).
      ppo_kl_coef: penalty coefficient (verl actor config `policy_loss.ppo_kl_coef`, default 0.1).

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "ppo_kl_abs", "kl_cov_frac"})``.

    Raises:
      ValueError: ``kl_cov_ratio <= 0`` (eager), unknown ``loss_agg_mode``, or mismatched shapes.
    """
    _check_positive("kl_cov_ratio", kl_cov_ratio)
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )
    negative_approx_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    abs_kl = jnp.abs(negative_approx_kl)
    ratio = jnp.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = pg_losses1 + ppo_kl_coef * abs_kl

    valid = response_mask != 0
    cov = _token_covariance(advantages, log_prob, response_mask)
    k = _selection_count(kl_cov_ratio, jnp.sum(valid))
    penalised = _top_k_mask(cov, valid, k)

    pg_losses = _apply_is_weights(jnp.where(penalised, pg_losses_kl, pg_losses1), is_w)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _metrics(
        response_mask,
        ppo_kl=-negative_approx_kl,
        ppo_kl_abs=masked_mean(abs_kl.astype(_F32), response_mask),
        kl_cov_frac=_frac(penalised, response_mask),
    )
    return pg_loss, metrics
