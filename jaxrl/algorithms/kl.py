"""Per-token KL estimators between the policy and the reference policy (verl's ``kl_penalty``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_PENALTIES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: jax.Array, ref_log_prob: jax.Array, kl_penalty: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probabilities.

    With ``d = log_prob - ref_log_prob`` (log pi(a) - log pi_ref(a), ``a`` sampled from pi):

    - ``"kl"`` / ``"k1"``: ``d`` (unbiased, high variance, can be negative)
    - ``"abs"``: ``|d|``
    - ``"mse"`` / ``"k2"``: ``0.5 * d**2`` (biased, low variance)
    - ``"low_var_kl"`` / ``"k3"``: ``exp(-d) - (-d) - 1`` with ``-d`` clamped to [-20, 20] before
      ``exp`` and the result clamped to [-10, 10], exactly as verl does (unbiased, >= 0, low variance).

    Source: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html;
    names and clamps follow verl ``core_algos.kl_penalty``.

    Args:
      log_prob: ``[batch, resp_len]`` float log-probs under the current policy (nats).
      ref_log_prob: ``[batch, resp_len]`` float log-probs under the reference policy (nats).
      kl_penalty: estimator name, one of ``KL_PENALTIES`` (static under ``jax.jit``).

    Returns:
      ``[batch, resp_len]`` per-token KL estimate (nats), dtype at least float32. Not masked:
      aggregate it with ``agg_loss``.

    Raises:
      ValueError: unknown estimator name (the message lists the valid ones; ``"full"`` is not
        supported because it needs full-vocabulary distributions), or mismatched shapes.
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid options are {list(KL_PENALTIES)}")
    log_prob = jnp.asarray(log_prob)
    ref_log_prob = jnp.asarray(ref_log_prob)
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob {log_prob.shape} and ref_log_prob {ref_log_prob.shape} must have the same shape")
    dtype = jnp.promote_types(jnp.promote_types(log_prob.dtype, ref_log_prob.dtype), jnp.float32)
    log_prob = log_prob.astype(dtype)
    ref_log_prob = ref_log_prob.astype(dtype)

    if kl_penalty in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kl_penalty == "abs":
        return jnp.abs(log_prob - ref_log_prob)
    if kl_penalty in ("mse", "k2"):
        return 0.5 * jnp.square(log_prob - ref_log_prob)
    # "low_var_kl" / "k3"
    log_ratio = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
