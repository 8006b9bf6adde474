"""Masked statistics the advantage estimators share: group mean/std (GRPO-style baselines) and verl's
``masked_var`` / ``masked_whiten`` (batch whitening). Pure and ``jax.jit``-able."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import masked_mean

__all__ = ["group_mean_std", "masked_var", "masked_whiten"]


def _is_concrete(*xs) -> bool:
    """True when none of ``xs`` is a JAX tracer (eager call: value checks can run)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def group_mean_std(scores: jax.Array, group_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row mean, unbiased std and size of the row's group.

    Groups of size 1 get mean 0 and std 1 (verl's convention: the single response's advantage is
    its raw score). The std is the unbiased sample std (``ddof=1``), matching ``torch.std`` in verl.

    Args:
      scores: ``[B]`` float scores.
      group_ids: ``[B]`` integer group ids in ``[0, B)``.

    Returns:
      ``(mean [B], std [B], count [B])``, each gathered back to the rows.
    """
    num = scores.shape[0]
    ones = jnp.ones_like(scores)
    count = jax.ops.segment_sum(ones, group_ids, num_segments=num)
    safe_count = jnp.maximum(count, 1.0)
    mean_g = jax.ops.segment_sum(scores, group_ids, num_segments=num) / safe_count
    sq_dev = jnp.square(scores - mean_g[group_ids])
    var_g = jax.ops.segment_sum(sq_dev, group_ids, num_segments=num) / jnp.maximum(count - 1.0, 1.0)
    row_count = count[group_ids]
    single = row_count <= 1.0
    mean = jnp.where(single, 0.0, mean_g[group_ids])
    std = jnp.where(single, 1.0, jnp.sqrt(var_g[group_ids]))
    return mean, std, row_count


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the entries of ``values`` where ``mask`` is non-zero (verl ``verl_F.masked_var``).

    ``var = masked_mean((values - masked_mean(values))**2)``, times the Bessel correction
    ``n / (n - 1)`` (``n = sum(mask)``) when ``unbiased`` (verl's default).

    Source: verl ``verl.utils.torch_functional.masked_var`` (from TRL).

    Args:
      values: float array (any shape).
      mask: 0/1 array of the same shape.
      unbiased: apply the ``n / (n - 1)`` correction. Static.

    Returns:
      Scalar float array.

    Raises:
      ValueError: shapes differ; or, eager call with ``unbiased``, ``sum(mask)`` is 0 or 1 (as verl,
        the unbiased variance is undefined). Under ``jax.jit`` no error can be raised: the
        correction's denominator is clamped to >= 1, so ``n == 1`` gives 0 and ``n == 0`` gives 0.
    """
    values = jnp.asarray(values)
    mask = jnp.asarray(mask)
    if values.shape != mask.shape:
        raise ValueError(f"values {values.shape} and mask {mask.shape} must have the same shape")
    mask = mask.astype(values.dtype)
    n = jnp.sum(mask)
    if unbiased and _is_concrete(n):
        count = float(n)
        if count == 0:
            raise ValueError("masked_var: the mask is all zero; at least two valid entries are needed")
        if count == 1:
            raise ValueError("masked_var: the mask has one valid entry; the unbiased variance needs at least two")
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        var = var * n / jnp.maximum(n - 1.0, 1.0)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """Standardise ``values`` with the mean and unbiased variance of its masked entries (verl semantics).

    ``whitened = (values - mean) * rsqrt(var + 1e-8)`` with ``mean = masked_mean(values, mask)`` and
    ``var = masked_var(values, mask, unbiased=True)``; with ``shift_mean=False`` the mean is added
    back (``whitened + mean``: rescaled, not centred). Statistics are over the whole array (batch
    and time together). Every entry is transformed, masked ones included (as verl); mask the
    result yourself where that matters.

    Source: verl ``verl.utils.torch_functional.masked_whiten`` (from TRL).

    Args:
      values: float array (any shape), e.g. ``[B, R]`` advantages.
      mask: 0/1 array of the same shape.
      shift_mean: keep the result centred (True) or add the mean back (False). Static.

    Returns:
      Array like ``values``.

    Raises:
      ValueError: as ``masked_var`` (shape mismatch; eager call with fewer than 2 valid entries).
    """
    values = jnp.asarray(values)
    mean = masked_mean(values, jnp.asarray(mask).astype(values.dtype))
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
