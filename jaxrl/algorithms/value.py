"""Critic (value-function) loss and its explained-variance diagnostic (verl semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import agg_loss, check_loss_agg_mode, masked_mean, masked_sum


def _check_same_2d(**arrays) -> dict[str, jax.Array]:
    out = {k: jnp.asarray(v) for k, v in arrays.items()}
    shapes = {k: v.shape for k, v in out.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"inputs must all be [batch, resp_len] with one shape, got {shapes}")
    return out


def compute_value_loss(
    vpreds: jax.Array,
    values: jax.Array,
    returns: jax.Array,
    response_mask: jax.Array,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped value loss: ``0.5 * agg(max((V - G)^2, (V_clip - G)^2))``.

    ``V = vpreds`` (current critic, differentiated), ``V_old = values`` (the critic at rollout
    time), ``G = returns`` (e.g. GAE returns), ``V_clip = clip(V, V_old - cliprange_value,
    V_old + cliprange_value)``. Taking the max of the two squared errors is pessimistic: the critic
    cannot profit from moving more than ``cliprange_value`` away from ``V_old``. The per-token loss is
    aggregated with ``agg_loss(…, loss_agg_mode, num_tokens, num_seqs)`` (micro-batch exact), then
    halved.

    Metric ``vf_clipfrac``: token fraction (over ``response_mask``) where the clipped error is the
    larger one, stop-gradient.

    Note the argument order: ``(vpreds, values, returns, ...)``; verl's is ``(vpreds, returns,
    values, ...)``. Pass them by keyword when porting code.

    Sources: PPO (Schulman et al., arXiv 1707.06347) value clipping as in OpenAI baselines / TRL;
    verl ``core_algos.compute_value_loss``.

    Args:
      vpreds: ``[B, R]`` float current value predictions.
      values: ``[B, R]`` float value predictions at rollout time.
      returns: ``[B, R]`` float value targets.
      response_mask: ``[B, R]`` 0/1 mask.
      cliprange_value: clip half-width, >= 0 (verl ``critic.cliprange_value``, default 0.5).
      loss_agg_mode: see ``agg_loss``.
      num_tokens: mini-batch valid-token count for ``agg_loss``.
      num_seqs: mini-batch sequence count for ``agg_loss``.

    Returns:
      ``(vf_loss scalar, {"vf_clipfrac": scalar})``.

    Raises:
      ValueError: mismatched shapes, unknown ``loss_agg_mode``, or (eager) ``cliprange_value < 0``.
    """
    check_loss_agg_mode(loss_agg_mode)
    if not isinstance(cliprange_value, jax.core.Tracer) and not float(cliprange_value) >= 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    a = _check_same_2d(vpreds=vpreds, values=values, returns=returns, response_mask=response_mask)
    vpreds, values, returns, mask = a["vpreds"], a["values"], a["returns"], a["response_mask"]

    vpredclipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = jnp.square(vpreds - returns)
    vf_losses2 = jnp.square(vpredclipped - returns)
    clipped_vf_losses = jnp.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).astype(jnp.float32), mask)
    return vf_loss, {"vf_clipfrac": jax.lax.stop_gradient(vf_clipfrac)}


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """How much of the returns' variance the critic explains: ``1 - Var[G - V] / (Var[G] + 1e-5)``.

    Variances are unbiased (``ddof=1``) over the valid tokens of the whole batch, as verl's
    ``critic/vf_explained_var`` metric (``torch.var`` of the masked-selected entries). 1 is a
    perfect critic, 0 no better than a constant, negative worse than a constant.

    Source: verl ``trainer.ppo.metric_utils.compute_data_metrics`` (``critic/vf_explained_var``).

    Args:
      values: ``[B, R]`` float value predictions ``V``.
      returns: ``[B, R]`` float returns ``G``.
      mask: ``[B, R]`` 0/1 mask of valid tokens.

    Returns:
      Scalar float32; NaN when fewer than 2 tokens are valid (the variance is undefined; verl's
      ``torch.var`` also gives NaN).

    Raises:
      ValueError: mismatched shapes.
    """
    a = _check_same_2d(values=values, returns=returns, mask=mask)
    v = a["values"].astype(jnp.float32)
    g = a["returns"].astype(jnp.float32)
    m = a["mask"].astype(jnp.float32)
    n = jnp.sum(m)

    def unbiased_var(x):
        mean = masked_mean(x, m)
        return masked_sum(jnp.square(x - mean), m) / jnp.maximum(n - 1.0, 1.0)

    ev = 1.0 - unbiased_var(g - v) / (unbiased_var(g) + 1e-5)
    return jnp.where(n >= 2, ev, jnp.nan)
