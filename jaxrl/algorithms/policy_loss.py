"""Policy-gradient losses (names follow verl's ``policy_loss.loss_mode``) and truncated IS weights.

Every policy loss has the signature::

    fn(old_log_prob [B, R], log_prob [B, R], advantages [B, R], response_mask [B, R], *,
       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode=..., num_tokens=None,
       num_seqs=None, rollout_is_weights=None, **own_options)
        -> (pg_loss scalar, metrics dict[str, scalar])

All losses accept the common keywords (a loss that does not use one ignores it, documented per
loss), so the actor can call any registered loss the same way. ``num_tokens`` / ``num_seqs`` are
the mini-batch normalisers forwarded to ``agg_loss`` (see there), which make gradient accumulation
over micro-batches exact. ``rollout_is_weights`` ([B, R], e.g. from ``tis_weights``) multiplies
the per-token losses before aggregation, under ``stop_gradient`` (verl's ``rollout_is_weights``).
Metrics are micro-batch token means wrapped in ``stop_gradient``; every loss returns at least
``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower`` (0.0 where the loss has no such clip, as
verl). A loss's own options (``**own_options``, keys of ``actor_rollout_ref.actor.policy_loss``)
are declared with its name in :mod:`jaxrl.algorithms.registry`; add a loss with
``@register_policy_loss("name", options=...)``.

Here: ``vanilla`` (PPO-clip / clip-higher / dual clip), ``gspo``, ``cispo``, ``gpg`` and the shared
helpers; ``clip_cov`` and ``kl_cov`` (covariance-selected tokens) are in :mod:`jaxrl.algorithms.cov_losses`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import agg_loss, check_loss_agg_mode, masked_mean, masked_sum
from jaxrl.algorithms.logprob import entropy_from_logits
from jaxrl.algorithms.registry import get_policy_loss, register_policy_loss, registered_policy_losses

__all__ = [
    "compute_policy_loss_cispo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "entropy_from_logits",
    "get_policy_loss",
    "register_policy_loss",
    "registered_policy_losses",
    "tis_weights",
]


# ----------------------------------------------------------------------------- shared helpers

_F32 = jnp.float32


def _is_concrete(*xs) -> bool:
    """True when none of ``xs`` is a JAX tracer (eager call: value checks can run)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights=None):
    """Validate the common inputs; return them as arrays (``rollout_is_weights`` may stay ``None``)."""
    check_loss_agg_mode(loss_agg_mode)
    arrays = {
        "old_log_prob": jnp.asarray(old_log_prob),
        "log_prob": jnp.asarray(log_prob),
        "advantages": jnp.asarray(advantages),
        "response_mask": jnp.asarray(response_mask),
    }
    if rollout_is_weights is not None:
        arrays["rollout_is_weights"] = jnp.asarray(rollout_is_weights)
    shapes = {k: v.shape for k, v in arrays.items()}
    if len(set(shapes.values())) != 1 or len(shapes["log_prob"]) != 2:
        raise ValueError(f"inputs must all be [batch, resp_len] with one shape, got {shapes}")
    return (
        arrays["old_log_prob"],
        arrays["log_prob"],
        arrays["advantages"],
        arrays["response_mask"],
        arrays.get("rollout_is_weights"),
    )


def _apply_is_weights(pg_losses: jax.Array, rollout_is_weights: jax.Array | None) -> jax.Array:
    """``pg_losses * stop_gradient(rollout_is_weights)`` (identity when ``None``), as verl."""
    if rollout_is_weights is None:
        return pg_losses
    return pg_losses * jax.lax.stop_gradient(rollout_is_weights.astype(pg_losses.dtype))


def _frac(cond: jax.Array, mask: jax.Array) -> jax.Array:
    """Token fraction (float32) of ``cond`` over ``mask``."""
    return masked_mean(cond.astype(_F32), mask)


def _metrics(mask, *, ppo_kl, pg_clipfrac=None, pg_clipfrac_lower=None, **extra) -> dict[str, jax.Array]:
    """Stop-gradient metrics dict with the three keys every loss reports (0.0 when ``None``)."""
    zero = jnp.zeros((), _F32)
    out = {
        "pg_clipfrac": zero if pg_clipfrac is None else pg_clipfrac,
        "ppo_kl": masked_mean(ppo_kl.astype(_F32), mask),
        "pg_clipfrac_lower": zero if pg_clipfrac_lower is None else pg_clipfrac_lower,
    }
    out.update(extra)
    return jax.lax.stop_gradient(out)


def _check_positive(name: str, x) -> None:
    if _is_concrete(x) and not float(x) > 0.0:
        raise ValueError(f"{name} must be > 0, got {float(x)}")


# ----------------------------------------------------------------------------- vanilla PPO


def compute_policy_loss_vanilla(
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with decoupled clip range and dual clip, exactly as verl computes it.

    Per token, with ``A`` the advantage and ``r = exp(clip(log_prob - old_log_prob, -20, 20))``:

    - ``L1 = -A * r``, ``L2 = -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``, ``L = max(L1, L2)``
      (PPO-clip, arXiv 1707.06347; asymmetric "clip-higher" bounds from DAPO, arXiv 2503.14476);
    - where ``A < 0``: ``L = min(L, -A * clip_ratio_c)`` (dual-clip PPO, arXiv 1912.09729), which
      bounds the loss when ``r`` is very large on a negative-advantage token.

    ``L`` is multiplied by ``rollout_is_weights`` when given, then aggregated with
    ``agg_loss(…, loss_agg_mode, num_tokens, num_seqs)``.

    Metrics (token means over ``response_mask``, stop-gradient):
      ``pg_clipfrac``: fraction of tokens with ``L2 > L1`` (the clipped branch was taken);
      ``ppo_kl``: mean of ``old_log_prob - log_prob`` after the [-20, 20] clamp (k1 KL estimate);
      ``pg_clipfrac_lower``: fraction of tokens with ``A < 0`` and ``max(L1, L2) > -A * clip_ratio_c``.

    Source: verl ``core_algos.compute_policy_loss_vanilla``.

    Args:
      old_log_prob: ``[B, R]`` float log-probs of the sampled tokens under the behaviour policy.
      log_prob: ``[B, R]`` float log-probs under the current policy (differentiated).
      advantages: ``[B, R]`` float advantages.
      response_mask: ``[B, R]`` 0/1 mask of valid response tokens.
      clip_ratio_low: lower clip epsilon (ratio floor ``1 - clip_ratio_low``).
      clip_ratio_high: upper clip epsilon (ratio ceiling ``1 + clip_ratio_high``).
      clip_ratio_c: dual-clip constant, must be > 1.
      loss_agg_mode: see ``agg_loss``.
      num_tokens: mini-batch valid-token count for ``agg_loss`` (``None``: this batch's).
      num_seqs: mini-batch sequence count for ``agg_loss`` (``None``: this batch's).
      rollout_is_weights: optional ``[B, R]`` per-token weights (e.g. ``tis_weights``), stop-gradient.

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``, all scalars.

    Raises:
      ValueError: ``clip_ratio_c <= 1``, unknown ``loss_agg_mode``, or mismatched shapes.
    """
    if not isinstance(clip_ratio_c, jax.core.Tracer) and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )

    negative_approx_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(negative_approx_kl)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = jnp.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = jnp.minimum(pg_losses3, clip_pg_losses1)
    negative_adv = advantages < 0
    pg_losses = jnp.where(negative_adv, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _apply_is_weights(pg_losses, is_w)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)

    metrics = _metrics(
        response_mask,
        ppo_kl=-negative_approx_kl,
        pg_clipfrac=_frac(pg_losses2 > pg_losses1, response_mask),
        pg_clipfrac_lower=_frac((clip_pg_losses1 > pg_losses3) & negative_adv, response_mask),
    )
    return pg_loss, metrics


# ----------------------------------------------------------------------------- GSPO


def compute_policy_loss_gspo(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    rollout_is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO: PPO-style clipping of a *sequence-level* importance ratio (GSPO-token form).

    ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the valid tokens of row ``i`` (the
    length-normalised sequence likelihood ratio). The per-token ratio used in the loss is
    ``s_it = exp(min(sg[log s_i] + log_prob_it - sg[log_prob_it], 10))``: its value is ``s_i`` on
    every token (capped at e^10), its gradient that of ``log_prob_it`` scaled by ``s_i``. Then
    ``L = max(-A * s_it, -A * clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))`` (no dual clip),
    times ``rollout_is_weights`` if given.

    The loss is always aggregated with ``"seq-mean-token-mean"`` (GSPO's objective is a mean over
    sequences; verl hard-codes this): ``loss_agg_mode`` is validated but not used. ``num_seqs`` is
    forwarded. ``clip_ratio_c`` is accepted for the common signature and unused.

    Metrics: ``pg_clipfrac`` = token fraction with the clipped branch taken; ``ppo_kl`` = token mean
    of ``old_log_prob - log_prob`` (unclamped, as verl); ``pg_clipfrac_lower`` = 0.

    Sources: Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071); verl
    ``core_algos.compute_policy_loss_gspo``.

    Args:
      old_log_prob, log_prob, advantages, response_mask: ``[B, R]`` as in ``compute_policy_loss_vanilla``.
      clip_ratio_low, clip_ratio_high: clip epsilons applied to the sequence ratio (the GSPO paper
        uses much smaller values than token-level PPO, e.g. 3e-4 / 4e-4).
      clip_ratio_c: unused.
      loss_agg_mode: validated, ignored (always ``"seq-mean-token-mean"``).
      num_tokens: unused by the seq-mean aggregation.
      num_seqs: mini-batch sequence count for ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` per-token weights, stop-gradient.

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``.

    Raises:
      ValueError: unknown ``loss_agg_mode`` or mismatched shapes.
    """
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = jnp.maximum(jnp.sum(response_mask.astype(log_prob.dtype), axis=-1), 1.0)
    negative_approx_kl_seq = masked_sum(negative_approx_kl, response_mask, axis=-1) / seq_lengths
    sg = jax.lax.stop_gradient
    log_seq_ratio = log_prob - sg(log_prob) + sg(negative_approx_kl_seq)[:, None]
    seq_ratio = jnp.exp(jnp.minimum(log_seq_ratio, 10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * jnp.clip(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = _apply_is_weights(jnp.maximum(pg_losses1, pg_losses2), is_w)

    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _metrics(
        response_mask, ppo_kl=-negative_approx_kl, pg_clipfrac=_frac(pg_losses2 > pg_losses1, response_mask)
    )
    return pg_loss, metrics


# ----------------------------------------------------------------------------- CISPO


def compute_policy_loss_cispo(
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance-sampling weight on every token.

    ``r = exp(clip(log_prob - old_log_prob, -20, 20))``, ``w = sg(clip(r, 1 - clip_ratio_low,
    1 + clip_ratio_high))`` and ``L = -w * A * log_prob`` (times ``rollout_is_weights``), so the
    gradient is ``-w * A * grad log_prob``: unlike PPO no token's gradient is dropped, the clip only
    bounds its weight. Aggregated with ``agg_loss``. ``clip_ratio_c`` is accepted and unused.

    Metrics: ``pg_clipfrac`` = token fraction whose weight was clipped (``r != w``, either side);
    ``ppo_kl`` = token mean of the clamped ``old_log_prob - log_prob``; ``pg_clipfrac_lower`` = 0.

    Sources: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
    (arXiv 2506.13585), CISPO objective; verl ``core_algos.compute_policy_loss_cispo``.

    Args:
      old_log_prob, log_prob, advantages, response_mask: ``[B, R]`` as in ``compute_policy_loss_vanilla``.
      clip_ratio_low, clip_ratio_high: IS-weight clip epsilons (MiniMax-M1 effectively leaves the
        lower side unbounded: use a large ``clip_ratio_low``, e.g. 1.0 or more).
      clip_ratio_c: unused.
      loss_agg_mode, num_tokens, num_seqs: see ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` per-token weights, stop-gradient.

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``.

    Raises:
      ValueError: unknown ``loss_agg_mode`` or mismatched shapes.
    """
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )
    negative_approx_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(negative_approx_kl)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -jax.lax.stop_gradient(clipped_ratio) * advantages * log_prob
    pg_losses = _apply_is_weights(pg_losses, is_w)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _metrics(
        response_mask, ppo_kl=-negative_approx_kl, pg_clipfrac=_frac(ratio != clipped_ratio, response_mask)
    )
    return pg_loss, metrics


# ----------------------------------------------------------------------------- GPG


def compute_policy_loss_gpg(
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GPG: the plain policy-gradient (REINFORCE) surrogate ``L = -log_prob * A``, no ratio, no clip.

    Meant for on-policy updates with the ``"gpg"`` advantage estimator. Times
    ``rollout_is_weights`` if given, then ``agg_loss``. ``old_log_prob`` only feeds the ``ppo_kl``
    metric; the ``clip_ratio_*`` keywords are accepted and unused.

    Metrics: ``ppo_kl`` = token mean of ``old_log_prob - log_prob`` (clamped to [-20, 20], as
    ``vanilla``; verl reports nothing for this loss); ``pg_clipfrac`` = ``pg_clipfrac_lower`` = 0.

    Sources: Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv 2504.02546); verl ``core_algos.compute_policy_loss_gpg``.

    Args:
      old_log_prob, log_prob, advantages, response_mask: ``[B, R]`` as in ``compute_policy_loss_vanilla``.
      clip_ratio_low, clip_ratio_high, clip_ratio_c: unused.
      loss_agg_mode, num_tokens, num_seqs: see ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` per-token weights, stop-gradient.

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``.

    Raises:
      ValueError: unknown ``loss_agg_mode`` or mismatched shapes.
    """
    old_log_prob, log_prob, advantages, response_mask, is_w = _prepare(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights
    )
    pg_losses = _apply_is_weights(-log_prob * advantages, is_w)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _metrics(response_mask, ppo_kl=-jnp.clip(log_prob - old_log_prob, -20.0, 20.0))
    return pg_loss, metrics


# ----------------------------------------------------------------------------- truncated IS


def tis_weights(old_log_prob: jax.Array, rollout_log_prob: jax.Array, cap: float) -> jax.Array:
    """Truncated importance-sampling weights correcting the rollout engine / trainer mismatch.

    The sampler (rollout engine, e.g. a bf16 inference kernel) and the trainer compute slightly
    different probabilities for the same tokens, so rollouts are off-policy for the trainer's
    ``pi_old``. Per token ``w = min(pi_old / pi_rollout, cap) = min(exp(old_log_prob -
    rollout_log_prob), cap)`` (log-ratio clamped to [-20, 20] before ``exp``), under
    ``stop_gradient``. Pass the result as ``rollout_is_weights=`` to any registered policy loss: it
    multiplies the per-token losses before aggregation, exactly where verl applies
    ``tis_imp_ratio`` when ``actor.tis_imp_ratio_cap > 0`` (the cap is that config value; verl's
    recipes use 2.0). Masked positions may hold anything; the loss masks them.

    Sources: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (https://fengyao.notion.site/off-policy-rl, 2025); verl ``core_algos.compute_policy_loss_vanilla``
    (``tis_imp_ratio_cap``).

    Args:
      old_log_prob: ``[B, R]`` float log-probs of the sampled tokens recomputed by the trainer.
      rollout_log_prob: ``[B, R]`` float log-probs reported by the rollout engine.
      cap: truncation threshold, > 0.

    Returns:
      ``[B, R]`` float32 weights in ``(0, cap]``, stop-gradient.

    Raises:
      ValueError: ``cap <= 0`` (eager) or mismatched shapes.
    """
    _check_positive("cap", cap)
    old_log_prob = jnp.asarray(old_log_prob)
    rollout_log_prob = jnp.asarray(rollout_log_prob)
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.ndim != 2:
        raise ValueError(
            f"old_log_prob {old_log_prob.shape} and rollout_log_prob {rollout_log_prob.shape} "
            "must both be [batch, resp_len]"
        )
    log_ratio = jnp.clip(old_log_prob.astype(_F32) - rollout_log_prob.astype(_F32), -20.0, 20.0)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), cap))
