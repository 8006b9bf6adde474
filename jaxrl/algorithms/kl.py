"""KL divergence between the policy and the reference policy (verl's ``kl_penalty``).

- Per-token estimators from the sampled tokens' log-probs: ``KL_PENALTIES`` (k1/abs/k2/k3 and aliases).
- Straight-through ``"+"`` variants (``KL_PENALTIES_STRAIGHT_THROUGH``): the value of the named
  estimator with the gradient of k2.
- ``"full"`` (``KL_PENALTY_FULL``): the exact KL over the vocabulary, ``kl_full``, from full
  ``[B, R, V]`` log-prob distributions.
- Importance-weighted k3 (``KL_PENALTIES_IMPORTANCE_WEIGHTED``, ``"low_var_kl_is"`` / ``"k3_is"``):
  k3 times the differentiable ratio pi / pi_old (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``),
  a KL *loss* only: it needs the behaviour policy's log-probs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_PENALTIES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Per-token estimators (what ``config.schema.KL_PENALTY_CHOICES`` mirrors)."""

KL_PENALTIES_STRAIGHT_THROUGH: tuple[str, ...] = tuple(name + "+" for name in KL_PENALTIES)
"""``"k1+"``, ``"low_var_kl+"``, …: value of the base estimator, gradient of k2."""

KL_PENALTY_FULL = "full"
"""Exact KL over the vocabulary; needs ``[batch, resp_len, vocab]`` log-prob distributions."""

KL_PENALTIES_IMPORTANCE_WEIGHTED: tuple[str, ...] = ("low_var_kl_is", "k3_is")
"""k3 x exp(log_prob - old_log_prob), the ratio differentiated: needs ``old_log_prob``."""

_PER_TOKEN = KL_PENALTIES + KL_PENALTIES_STRAIGHT_THROUGH + KL_PENALTIES_IMPORTANCE_WEIGHTED


def _forward(log_prob: jax.Array, ref_log_prob: jax.Array, name: str) -> jax.Array:
    """The base (non-``+``) per-token estimator ``name``."""
    if name in ("kl", "k1"):
        return log_prob - ref_log_prob
    if name == "abs":
        return jnp.abs(log_prob - ref_log_prob)
    if name in ("mse", "k2"):
        return 0.5 * jnp.square(log_prob - ref_log_prob)
    # "low_var_kl" / "k3"
    log_ratio = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def kl_penalty(
    log_prob: jax.Array, ref_log_prob: jax.Array, kl_penalty: str, *, old_log_prob: jax.Array | None = None
) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probabilities.

    With ``d = log_prob - ref_log_prob`` (log pi(a) - log pi_ref(a), ``a`` sampled from pi):

    - ``"kl"`` / ``"k1"``: ``d`` (unbiased, high variance, can be negative)
    - ``"abs"``: ``|d|``
    - ``"mse"`` / ``"k2"``: ``0.5 * d**2`` (biased, low variance)
    - ``"low_var_kl"`` / ``"k3"``: ``exp(-d) - (-d) - 1`` with ``-d`` clamped to [-20, 20] before
      ``exp`` and the result clamped to [-10, 10], exactly as verl does (unbiased, >= 0, low variance).
    - ``"<name>+"`` (e.g. ``"k1+"``, ``"low_var_kl+"``): straight-through estimator whose *value*
      is that of ``<name>`` and whose *gradient* is that of k2, ``d * grad(log_prob)``
      (``k2 - sg(k2) + sg(<name>)``). The expected gradient of k1/k3 is not the gradient of the KL
      while k2's is, so ``"+"`` keeps the unbiased value for logging and the right gradient for a
      KL loss. ``"k2+"``/``"mse+"`` equal ``"k2"``.
    - ``"full"``: the exact KL over the vocabulary; requires ``[batch, resp_len, vocab]`` inputs and
      dispatches to ``kl_full`` (see there for how the trainer must call it).
    - ``"low_var_kl_is"`` / ``"k3_is"``: importance-weighted k3, ``ratio * k3`` with
      ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20] as in the policy
      loss; ``old_log_prob`` under ``stop_gradient``, the ratio itself differentiated) and k3 as
      ``"low_var_kl"`` above. The tokens were sampled from pi_old, so ``E_old[ratio * k3] = E_pi[k3]``
      (an unbiased value) and the gradient with respect to ``log_prob`` is ``ratio * d`` (``d/dx`` of
      ``e^(x-o) * (e^(r-x) - (r-x) - 1)`` is ``e^(x-o) * (x - r)``): the importance-weighted
      score-function gradient of KL(pi || pi_ref), unbiased also off-policy (``ppo_epochs > 1``,
      several mini-batches), where k3's and k3+'s are not. On-policy (ratio 1) the gradient equals
      ``"low_var_kl+"``'s, ``d``. Where a clamp binds, the value and gradient are the clamped ones.

    Sources: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html;
    names, clamps and the ``"+"`` straight-through trick follow verl ``core_algos.kl_penalty``. The
    importance-weighted k3 is DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556, section 3.1, Eq. 7)
    as TRL computes it: ``GRPOTrainer._compute_loss``, ``per_token_kl = per_token_kl * coef_1`` under
    ``use_bias_correction_kl`` (default ``True`` in TRL 1.16; TRL clamps neither k3 nor the ratio: equal
    to this one where ``|log(pi_ref / pi)| <= 20``, ``k3 <= 10`` and ``|log(pi / pi_old)| <= 20``).

    Args:
      log_prob: ``[batch, resp_len]`` float log-probs under the current policy (nats);
        ``[batch, resp_len, vocab]`` log-prob distributions for ``"full"``.
      ref_log_prob: same shape, under the reference policy.
      kl_penalty: estimator name, one of ``KL_PENALTIES``, ``KL_PENALTIES_STRAIGHT_THROUGH``,
        ``KL_PENALTIES_IMPORTANCE_WEIGHTED`` or ``"full"`` (static under ``jax.jit``).
      old_log_prob: ``[batch, resp_len]`` log-probs under the behaviour policy pi_old that sampled
        the tokens (the policy loss's ``old_log_prob``); required by the importance-weighted
        estimators, ignored by the others.

    Returns:
      ``[batch, resp_len]`` per-token KL estimate (nats), dtype at least float32. Not masked:
      aggregate it with ``agg_loss``.

    Raises:
      ValueError: unknown estimator name (the message lists the valid ones), ``"full"`` with
        ``[batch, resp_len]`` inputs, an importance-weighted estimator without ``old_log_prob``,
        or mismatched shapes.
    """
    log_prob = jnp.asarray(log_prob)
    ref_log_prob = jnp.asarray(ref_log_prob)
    if kl_penalty == KL_PENALTY_FULL:
        if log_prob.ndim != 3:
            raise ValueError(
                f"unknown kl_penalty 'full' for [batch, resp_len] per-token log-probs (got shape "
                f"{log_prob.shape}); per-token options are {list(_PER_TOKEN)}. 'full' is the exact KL "
                "over the vocabulary and needs [batch, resp_len, vocab] log-prob distributions (see kl_full)"
            )
        return kl_full(log_prob, ref_log_prob)
    if kl_penalty not in _PER_TOKEN:
        raise ValueError(
            f"unknown kl_penalty {kl_penalty!r}; valid options are {list(_PER_TOKEN) + [KL_PENALTY_FULL]}"
        )
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob {log_prob.shape} and ref_log_prob {ref_log_prob.shape} must have the same shape")
    dtype = jnp.promote_types(jnp.promote_types(log_prob.dtype, ref_log_prob.dtype), jnp.float32)
    log_prob = log_prob.astype(dtype)
    ref_log_prob = ref_log_prob.astype(dtype)

    if kl_penalty in KL_PENALTIES_IMPORTANCE_WEIGHTED:
        if old_log_prob is None:
            raise ValueError(
                f"kl_penalty {kl_penalty!r} weights k3 by pi/pi_old and needs old_log_prob (the behaviour "
                "policy's [batch, resp_len] log-probs); without them use 'low_var_kl' or 'low_var_kl+'"
            )
        old_log_prob = jnp.asarray(old_log_prob)
        if old_log_prob.shape != log_prob.shape:
            raise ValueError(
                f"old_log_prob {old_log_prob.shape} and log_prob {log_prob.shape} must have the same shape"
            )
        old_log_prob = jax.lax.stop_gradient(old_log_prob.astype(dtype))
        ratio = jnp.exp(jnp.clip(log_prob - old_log_prob, -20.0, 20.0))
        return ratio * _forward(log_prob, ref_log_prob, "k3")

    base = kl_penalty.removesuffix("+")
    forward = _forward(log_prob, ref_log_prob, base)
    if base == kl_penalty or base in ("mse", "k2"):
        return forward
    backward = 0.5 * jnp.square(log_prob - ref_log_prob)
    sg = jax.lax.stop_gradient
    return backward - sg(backward) + sg(forward)


def kl_full(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Exact KL(pi || pi_ref) over the vocabulary at every position: ``sum_v p_v (logp_v - ref_logp_v)``.

    Terms with ``p_v = 0`` (``logp_v = -inf``, e.g. banned tokens) contribute exactly 0, with zero
    (not NaN) gradient; a token with ``p_v > 0`` and ``ref_logp_v = -inf`` makes the KL ``+inf``
    (it is infinite). Computed in float32. The gradient flows into ``logp`` (and ``ref_logp`` if it
    is not stop-gradient'ed).

    How the trainer must call it (``actor.use_kl_loss`` with ``kl_loss_type="full"``): inside the
    actor's loss function, for the response positions of a micro-batch, take the policy logits
    ``[B, R, V]`` (divided by the rollout temperature if one is applied to log-probs) and
    ``logp = jax.nn.log_softmax(logits.astype(float32))``; run the *reference* model on the same
    micro-batch in the same step and take ``ref_logp = stop_gradient(log_softmax(ref_logits))``
    (per-token ``ref_log_prob`` from the rollout phase is not enough, and storing ``[B, R, V]``
    reference distributions between phases costs ``4 * B * R * V`` bytes); then
    ``agg_loss(kl_full(logp, ref_logp), response_mask, loss_agg_mode, ...)``. It cannot be used for
    the in-reward penalty (``apply_kl_penalty``), which only has per-token log-probs.
    ``kl_penalty(logp, ref_logp, "full")`` is the same call.

    Source: definition of the KL divergence; verl reserves ``kl_penalty="full"`` for it
    (``core_algos.kl_penalty``, where it is not implemented).

    Args:
      logp: ``[..., V]`` (typically ``[B, R, V]``) float log-probabilities of the policy, normalised
        over the last axis (any float dtype).
      ref_logp: same shape, reference policy log-probabilities.

    Returns:
      ``[...]`` (``[B, R]``) float32 KL per position (nats, >= 0 up to rounding). Not masked.

    Raises:
      ValueError: shapes differ, fewer than 2 dimensions, or non-float inputs.
    """
    logp = jnp.asarray(logp)
    ref_logp = jnp.asarray(ref_logp)
    if logp.shape != ref_logp.shape or logp.ndim < 2:
        raise ValueError(
            f"logp {logp.shape} and ref_logp {ref_logp.shape} must have the same shape [..., vocab] "
            "(typically [batch, resp_len, vocab])"
        )
    for name, x in (("logp", logp), ("ref_logp", ref_logp)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    logp = logp.astype(jnp.float32)
    ref_logp = ref_logp.astype(jnp.float32)
    p = jnp.exp(logp)
    support = p > 0
    safe_logp = jnp.where(support, logp, 0.0)
    safe_ref = jnp.where(support, ref_logp, 0.0)
    return jnp.sum(jnp.where(support, p * (safe_logp - safe_ref), 0.0), axis=-1)
