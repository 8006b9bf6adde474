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
        host = np.asarray(labels)  # (np.min of a jax array inside a trace would be traced, even for a concrete one)
        lo, hi = int(host.min()), int(host.max())
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


# Logits of one position chunk: at most this many bytes (float32 [B, c, V]). 64 MiB keeps a SmolLM2 micro-batch of 8
# rows (V = 49152) at 32 positions per chunk; the backward holds about three such arrays at a time.
LOGITS_CHUNK_BYTES = 64 * 1024**2


def head_log_probs(hidden: jax.Array, labels: jax.Array, head, *, with_entropy: bool = False, chunked: bool = True,
                   chunk_bytes: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs (and entropies) of ``labels`` under ``head(hidden)``, without the whole ``[B, R, V]`` logits.

    The LM head and the log-softmax run over chunks of ``c`` positions in a ``lax.scan`` whose step is rematerialised
    (``jax.checkpoint``): forward and backward hold one chunk's ``[B, c, V]`` logits at a time, and the backward
    recomputes each chunk's logits (one more LM-head matmul). Each position's values are computed exactly as by
    :func:`log_probs_from_logits` / :func:`entropy_from_logits` on the full logits. When the full logits fit in the
    budget this is those two functions on ``head(hidden)``. The same idea as Liger-Kernel's fused linear
    cross-entropy and verl's ``entropy_from_logits_with_chunking``, as a scan.

    Args:
      hidden: ``[B, R, H]`` hidden states at the scoring positions (any float dtype).
      labels: ``[B, R]`` integer token ids in ``[0, V)``.
      head: ``[B, c, H] -> [B, c, V]`` float32 logits (the LM head and any temperature division).
      with_entropy: also return the entropies (else None).
      chunked: False = the whole logits at once (no scan, no recomputation).
      chunk_bytes: budget for one chunk's float32 logits (default :data:`LOGITS_CHUNK_BYTES`).

    Returns:
      ``(log_probs, entropy)``: float32 ``[B, R]`` each (``entropy`` None unless ``with_entropy``).

    Raises:
      ValueError: ``hidden`` is not ``[B, R, H]`` or ``labels`` not ``[B, R]``.
    """
    if hidden.ndim != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, R, H] and labels [B, R], got {hidden.shape} and {labels.shape}")

    def values(h, y):
        logits = head(h)
        return log_probs_from_logits(logits, y), (entropy_from_logits(logits) if with_entropy else None)

    b, r, _ = hidden.shape
    vocab = jax.eval_shape(head, jax.ShapeDtypeStruct((b, 1, hidden.shape[2]), hidden.dtype)).shape[-1]
    budget = LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_position = b * vocab * 4
    if not chunked or r * per_position <= budget or r <= 1:
        return values(hidden, labels)
    n = -(-r // max(1, budget // per_position))  # chunks
    c = -(-r // n)  # positions per chunk (the last chunk padded)
    pad = n * c - r
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(labels, ((0, 0), (0, pad)))
    xs = (jnp.moveaxis(h.reshape(b, n, c, -1), 1, 0), jnp.moveaxis(y.reshape(b, n, c), 1, 0))
    _, (lp, ent) = jax.lax.scan(lambda carry, x: (carry, jax.checkpoint(values)(*x)), None, xs)
    unchunk = lambda v: jnp.moveaxis(v, 0, 1).reshape(b, n * c)[:, :r]  # noqa: E731
    return unchunk(lp), (unchunk(ent) if with_entropy else None)
