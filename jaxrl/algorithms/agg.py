"""Aggregate a per-token loss matrix into a scalar (verl's ``agg_loss``), micro-batch exact.

Follows the formulas of verl's ``verl.trainer.ppo.core_algos.agg_loss`` (the version that takes
``batch_num_tokens`` / ``global_batch_size``) so a verl ``loss_agg_mode`` means the same thing here.
With the optional global normalisers, a mini-batch split into micro-batches gives exactly the
mini-batch loss (and gradient) when the micro-batch losses are summed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def check_loss_agg_mode(loss_agg_mode: str) -> None:
    """Raise ``ValueError`` naming the valid modes unless ``loss_agg_mode`` is one of ``LOSS_AGG_MODES``."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(LOSS_AGG_MODES)}")


def _safe_denominator(n: jax.Array) -> jax.Array:
    """``n`` where positive, else 1 (the numerator is 0 there), so all-masked input gives 0, not NaN."""
    return jnp.where(n > 0, n, jnp.ones_like(n))


def masked_sum(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Sum of ``values * mask`` over ``axis``; masked entries contribute exactly 0 even when inf/NaN.

    Args:
      values: float array.
      mask: array broadcastable to ``values``; 0 marks an entry to drop (0/1 or weights).
      axis: reduction axis (``None`` = all).
    """
    mask = jnp.asarray(mask).astype(values.dtype)
    return jnp.sum(jnp.where(mask != 0, values * mask, jnp.zeros_like(values)), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """``masked_sum / sum(mask)`` over ``axis``; 0 (not NaN) where the mask is all zero.

    Same quantity as verl's ``verl_F.masked_mean`` (which adds 1e-8 to the count instead).
    """
    mask = jnp.asarray(mask).astype(values.dtype)
    return masked_sum(values, mask, axis) / _safe_denominator(jnp.sum(mask, axis=axis))


def agg_loss(
    loss_mat: jax.Array,
    loss_mask: jax.Array,
    loss_agg_mode: str,
    *,
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    loss_scale_factor: float | None = None,
) -> jax.Array:
    """Aggregate a per-token loss ``[batch, resp_len]`` into a scalar.

    With ``m`` the mask, ``l`` the loss, ``R = loss_mask.shape[-1]`` (the response horizon):

    - ``"token-mean"``:               ``sum_ij l_ij m_ij / num_tokens``
    - ``"seq-mean-token-mean"``:      ``sum_i (sum_j l_ij m_ij / sum_j m_ij) / num_seqs``
    - ``"seq-mean-token-sum"``:       ``sum_i (sum_j l_ij m_ij) / num_seqs``
    - ``"seq-mean-token-sum-norm"``:  ``sum_i (sum_j l_ij m_ij / R) / num_seqs`` (Dr. GRPO's constant
      normaliser, arXiv 2503.20783; ``loss_scale_factor`` replaces ``R`` when given, as in verl).

    ``num_tokens`` defaults to ``sum(loss_mask)`` and ``num_seqs`` to ``batch`` (every row counts,
    including all-masked rows, as verl's local-batch default does). Pass the *mini-batch* values
    when ``loss_mat`` is one micro-batch of it: then summing the micro-batch results equals the
    mini-batch result exactly (for ``-norm`` the micro-batches must share the padded width ``R`` or
    a fixed ``loss_scale_factor``). Rows with no valid token contribute 0; a zero denominator gives
    0, never NaN. Masked entries contribute exactly 0 (and zero gradient) even if inf/NaN.

    Source: verl ``core_algos.agg_loss`` (``batch_num_tokens``/``global_batch_size`` with
    ``dp_size=1``; verl adds 1e-8 to per-row token counts, here 0-count rows are guarded instead).

    Args:
      loss_mat: ``[batch, resp_len]`` float per-token loss.
      loss_mask: ``[batch, resp_len]`` 0/1 mask (bool, int or float).
      loss_agg_mode: one of ``LOSS_AGG_MODES`` (static under ``jax.jit``).
      num_tokens: valid-token count of the whole mini-batch (``token-mean`` only; ignored otherwise).
      num_seqs: sequence count of the whole mini-batch (``seq-mean-*`` only; ignored otherwise).
      loss_scale_factor: ``-norm`` divisor; ``None`` means ``R``.

    Returns:
      Scalar array in ``loss_mat``'s dtype.

    Raises:
      ValueError: unknown ``loss_agg_mode``, or ``loss_mat``/``loss_mask`` not the same 2-D shape.
    """
    check_loss_agg_mode(loss_agg_mode)
    loss_mat = jnp.asarray(loss_mat)
    loss_mask = jnp.asarray(loss_mask)
    if loss_mat.ndim != 2 or loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat {loss_mat.shape} and loss_mask {loss_mask.shape} must both be [batch, resp_len]"
        )
    mask = loss_mask.astype(loss_mat.dtype)

    if loss_agg_mode == "token-mean":
        n = jnp.sum(mask) if num_tokens is None else jnp.asarray(num_tokens, loss_mat.dtype)
        return masked_sum(loss_mat, mask) / _safe_denominator(n)

    seq_sums = masked_sum(loss_mat, mask, axis=-1)  # [batch]
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / _safe_denominator(jnp.sum(mask, axis=-1))
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    else:  # "seq-mean-token-sum-norm"
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_losses = seq_sums / scale
    s = loss_mat.shape[0] if num_seqs is None else num_seqs
    return jnp.sum(seq_losses) / _safe_denominator(jnp.asarray(s, loss_mat.dtype))
