"""Token log-probabilities and entropies from logits, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _check_floating(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def log_probs_from_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(logits)[label] per position, in float32.

    Computes ``logits[label] - logsumexp(logits)`` in float32: one logsumexp reduction over the
    vocabulary plus one gather, so no ``[batch, seq, vocab]`` log-softmax is materialised (under
    ``jax.jit`` the float32 up-cast fuses into the reduction).

    Args:
      logits: ``[batch, seq, vocab]`` (any leading shape) float logits, any float dtype (bf16 ok).
      labels: ``[batch, seq]`` integer token ids in ``[0, vocab)``. Padding positions must still
        hold a valid id (e.g. the pad id) and be masked downstream; an out-of-range id yields NaN
        under ``jax.jit`` and raises ``ValueError`` when called eagerly.

    Returns:
      ``[batch, seq]`` float32 log-probabilities (nats, <= 0).

    Raises:
      ValueError: non-float logits, non-integer labels, ``labels.shape != logits.shape[:-1]``,
        or (eager call only) a label outside ``[0, vocab)``.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    _check_floating("logits", logits)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be an integer array, got dtype {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must equal logits.shape[:-1] {logits.shape[:-1]}")
    vocab = logits.shape[-1]
    if not isinstance(labels, jax.core.Tracer) and labels.size:
        lo, hi = int(np.min(labels)), int(np.max(labels))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"labels must be in [0, {vocab}), got values in [{lo}, {hi}]")

    logits32 = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits32, axis=-1)
    picked = jnp.take_along_axis(logits32, labels[..., None], axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]
    return picked - lse


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy (nats) of the categorical distribution softmax(logits), in float32.

    ``H = logsumexp(z) - sum(softmax(z) * z)`` with ``z = logits - max(logits)`` (the same value as
    with the raw logits; the shift keeps both terms in ``[0, log V]`` so large logits lose no
    precision). ``-inf`` logits (banned tokens) are allowed and contribute 0, with zero gradient.
    Source: verl ``verl.utils.torch_functional.entropy_from_logits``.

    Args:
      logits: ``[..., vocab]`` float logits, any float dtype.

    Returns:
      ``[...]`` float32 entropies in ``[0, log vocab]``.

    Raises:
      ValueError: non-float logits.
    """
    logits = jnp.asarray(logits)
    _check_floating("logits", logits)
    x = logits.astype(jnp.float32)
    z = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    finite = jnp.isfinite(z)
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jnp.exp(z - lse[..., None])
    z_safe = jnp.where(finite, z, 0.0)
    return lse - jnp.sum(jnp.where(finite, p * z_safe, 0.0), axis=-1)
