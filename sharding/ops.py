"""Small, pure layout operations that weight translation is built from.

Every function works on ``numpy`` arrays and on ``jax`` arrays (also inside ``jax.jit``), returns new arrays and
never reads global state. All of them except :func:`cast` and :func:`scale` only *move* elements (or pad with a
fill value), which is what lets the translator trace where every element goes (see
``sharding.translator``).

Layouts in the docstrings use torch / Hugging Face conventions where noted: a linear weight is ``[out, in]``,
e.g. ``q_proj.weight`` is ``[nH*D, E]`` (``nH`` query heads, ``nKV`` key/value heads, ``D`` head_dim,
``E`` hidden, ``I`` intermediate, ``tp`` tensor-parallel size).

The fused per-rank layouts follow vLLM's column-parallel layers (``vllm/model_executor/layers/linear.py``):
``QKVParallelLinear`` gives rank ``r`` the rows ``[q heads of r | k heads of r | v heads of r]`` where rank ``r``
owns query heads ``[r*nH/tp, (r+1)*nH/tp)`` and kv heads ``[r*nKV/tp, ...)`` - or, when ``tp > nKV``, the single
kv head ``r // (tp/nKV)`` (each kv head replicated on ``tp/nKV`` ranks); ``MergedColumnParallelLinear`` gives
rank ``r`` ``[gate rows of r | up rows of r]``. The global fused tensor is the rank blocks stacked in rank order
along the output axis, so sharding that axis ``tp`` ways hands rank ``r`` its block.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

__all__ = [
    "cast",
    "fuse_gate_up_per_rank",
    "fuse_qkv_per_rank",
    "kv_layout",
    "pad_axis",
    "pad_head_dim",
    "repeat_kv_heads",
    "reshape",
    "rope_halves_to_interleaved",
    "rope_interleaved_to_halves",
    "scale",
    "split",
    "stack_layers",
    "transpose",
    "unfuse_gate_up_per_rank",
    "unfuse_qkv_per_rank",
    "unstack_layers",
]


def _xp(*xs):
    return np if all(isinstance(x, np.ndarray) for x in xs) else jnp


def _axis(x, axis: int) -> int:
    nd = np.ndim(x)
    if not -nd <= axis < nd:
        raise ValueError(f"axis {axis} is out of range for an array of rank {nd} (shape {np.shape(x)})")
    return axis % nd


# ----------------------------------------------------------------------------------------------- generic
def transpose(x, perm: Sequence[int]):
    """Permute the axes of ``x``: output axis ``i`` is input axis ``perm[i]``.

    Raises:
        ValueError: ``perm`` is not a permutation of ``range(x.ndim)``.
    """
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(np.ndim(x))):
        raise ValueError(f"perm {perm} is not a permutation of the {np.ndim(x)} axes of shape {np.shape(x)}")
    return x.transpose(perm)


def reshape(x, shape: Sequence[int]):
    """Row-major reshape of ``x`` to ``shape`` (one entry may be -1).

    Raises:
        ValueError: the element counts differ.
    """
    shape = tuple(int(s) for s in shape)
    size = int(np.prod(np.shape(x)))
    known = int(np.prod([s for s in shape if s != -1]))
    if (-1 in shape and (known == 0 or size % known)) or (-1 not in shape and known != size):
        raise ValueError(f"cannot reshape an array of shape {np.shape(x)} ({size} elements) to {shape}")
    return x.reshape(shape)


def split(x, sizes: Sequence[int], axis: int = 0) -> tuple:
    """Split ``x`` along ``axis`` into consecutive pieces of the given ``sizes``.

    Raises:
        ValueError: the sizes do not add up to ``x.shape[axis]``.
    """
    axis = _axis(x, axis)
    sizes = [int(s) for s in sizes]
    if sum(sizes) != np.shape(x)[axis] or any(s < 0 for s in sizes):
        raise ValueError(f"split sizes {sizes} do not add up to dimension {axis} of shape {np.shape(x)}")
    bounds = np.cumsum([0] + sizes)
    return tuple(x[(slice(None),) * axis + (slice(int(a), int(b)),)] for a, b in zip(bounds[:-1], bounds[1:]))


def stack_layers(xs: Sequence, axis: int = 0):
    """Stack per-layer arrays ``L x [...]`` into one scanned array with a new layer axis at ``axis``.

    Raises:
        ValueError: empty input or arrays of different shapes.
    """
    xs = list(xs)
    if not xs:
        raise ValueError("stack_layers needs at least one array")
    shapes = {tuple(np.shape(x)) for x in xs}
    if len(shapes) != 1:
        raise ValueError(f"stack_layers needs arrays of one shape; got {sorted(shapes)}")
    if not -(len(np.shape(xs[0])) + 1) <= axis <= len(np.shape(xs[0])):
        raise ValueError(f"axis {axis} is out of range to insert into shape {np.shape(xs[0])}")
    return _xp(*xs).stack(xs, axis=axis)


def unstack_layers(x, axis: int = 0) -> tuple:
    """Inverse of :func:`stack_layers`: split the layer axis ``axis`` into ``L`` arrays (the axis removed)."""
    axis = _axis(x, axis)
    return tuple(_xp(x).take(x, i, axis=axis) for i in range(np.shape(x)[axis]))


def pad_axis(x, new_size: int, axis: int = 0, fill=0):
    """Pad dimension ``axis`` of ``x`` at the end up to ``new_size`` with ``fill`` (e.g. vocabulary padding).

    Raises:
        ValueError: ``new_size`` smaller than the current size.
    """
    axis = _axis(x, axis)
    cur = np.shape(x)[axis]
    if new_size < cur:
        raise ValueError(f"pad_axis: new_size {new_size} < current size {cur} of axis {axis}")
    if new_size == cur:
        return x
    widths = [(0, 0)] * np.ndim(x)
    widths[axis] = (0, int(new_size) - cur)
    return _xp(x).pad(x, widths, constant_values=fill)


def pad_head_dim(x, new_dim: int, axis: int = -1, fill=0):
    """Pad the head_dim axis (``axis`` of an array with an explicit head_dim axis, e.g. ``[E, nH, D]``) up to
    ``new_dim`` with zeros (``fill``), as inference kernels that need a head_dim multiple of 128 do. Zero padding of
    q/k/v columns leaves attention scores and outputs unchanged (the softmax scale must stay ``1/sqrt(D)``)."""
    return pad_axis(x, new_dim, axis=axis, fill=fill)


def cast(x, dtype):
    """``x`` converted to ``dtype`` (e.g. float32 -> bfloat16, round to nearest even)."""
    return x.astype(dtype)


def scale(x, factor: float):
    """``x * factor`` in ``x``'s dtype (e.g. MaxText's query-kernel pre-scaling by ``1/sqrt(head_dim)``)."""
    return (x * np.asarray(factor, dtype=np.float32)).astype(x.dtype)


def rope_halves_to_interleaved(x, axis: int = -1):
    """Permute a head_dim axis from the rotate-half RoPE layout (HF: pairs ``(i, i + D/2)``) to the interleaved
    one (pairs ``(2i, 2i+1)``, Meta / MaxText): output ``[..., 2i] = x[..., i]``, ``[..., 2i+1] = x[..., i + D/2]``.
    Inverse of MaxText's ``permute_to_match_maxtext_rope``-style ``concat(evens, odds)``.

    Raises:
        ValueError: odd head_dim.
    """
    axis = _axis(x, axis)
    d = np.shape(x)[axis]
    if d % 2:
        raise ValueError(f"RoPE head_dim must be even; got {d}")
    perm = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=-1).reshape(d)
    return _xp(x).take(x, perm, axis=axis)


def rope_interleaved_to_halves(x, axis: int = -1):
    """Inverse of :func:`rope_halves_to_interleaved`: ``concat(x[..., 0::2], x[..., 1::2])`` on ``axis``."""
    axis = _axis(x, axis)
    d = np.shape(x)[axis]
    if d % 2:
        raise ValueError(f"RoPE head_dim must be even; got {d}")
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    return _xp(x).take(x, perm, axis=axis)


# ----------------------------------------------------------------------------------------------- attention heads
def repeat_kv_heads(x, n_rep: int, axis: int = 0):
    """Repeat every kv head ``n_rep`` times consecutively along the head ``axis`` (``[k0, k0, k1, k1, ...]``):
    HF ``repeat_kv`` order, and vLLM's choice of kv head ``r // n_rep`` for rank ``r`` when ``tp > nKV``.

    Raises:
        ValueError: ``n_rep`` not a positive int.
    """
    if isinstance(n_rep, bool) or not isinstance(n_rep, (int, np.integer)) or n_rep < 1:
        raise ValueError(f"n_rep={n_rep!r} must be a positive int")
    axis = _axis(x, axis)
    return x if n_rep == 1 else _xp(x).repeat(x, int(n_rep), axis=axis)


def kv_layout(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int, int]:
    """vLLM's per-rank head counts for ``QKVParallelLinear``: ``(q_heads_per_rank, kv_heads_per_rank, kv_replicas)``.

    ``kv_replicas = tp / nKV`` when ``tp >= nKV`` (then one kv head per rank), else 1.

    Raises:
        ValueError: ``tp`` does not divide ``num_heads``, or neither of ``tp``/``num_kv_heads`` divides the other
            (vLLM rejects the same configurations).
    """
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if num_heads % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide num_heads={num_heads} (vLLM's requirement)")
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise ValueError(f"tensor-parallel size {tp} > num_kv_heads={num_kv_heads} must be a multiple of it")
        return num_heads // tp, 1, tp // num_kv_heads
    if num_kv_heads % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide num_kv_heads={num_kv_heads}")
    return num_heads // tp, num_kv_heads // tp, 1


def _rank_blocks(x, tp: int):
    """``[tp * n, ...]`` -> ``[tp, n, ...]`` (rank-major)."""
    return x.reshape((tp, np.shape(x)[0] // tp) + tuple(np.shape(x)[1:]))


def fuse_qkv_per_rank(q, k, v, *, num_heads: int, num_kv_heads: int, tp: int):
    """Fuse q/k/v projections into vLLM's column-parallel ``qkv_proj`` layout for ``tp`` ranks.

    Args:
        q: ``[nH*D, ...]`` (HF ``q_proj.weight`` ``[nH*D, E]`` or ``q_proj.bias`` ``[nH*D]``).
        k, v: ``[nKV*D, ...]``.
        num_heads, num_kv_heads: ``nH``, ``nKV``.
        tp: tensor-parallel size.

    Returns:
        ``[tp * (qh + 2*kh) * D, ...]``: rank ``r``'s block (rows ``[r*(qh+2kh)*D, (r+1)*(qh+2kh)*D)``) is
        ``[q heads r*qh..(r+1)*qh | k heads of r | v heads of r]`` with ``qh, kh, rep = kv_layout(nH, nKV, tp)``;
        when ``tp > nKV`` rank ``r`` holds kv head ``r // rep`` (kv rows repeated, as vLLM loads them).

    Raises:
        ValueError: shapes inconsistent with the head counts, or an invalid ``tp`` (see :func:`kv_layout`).
    """
    qh, kh, rep = kv_layout(num_heads, num_kv_heads, tp)
    if np.shape(q)[0] % num_heads:
        raise ValueError(f"q rows {np.shape(q)[0]} are not a multiple of num_heads={num_heads}")
    d = np.shape(q)[0] // num_heads
    rest = tuple(np.shape(q)[1:])
    for name, t in (("k", k), ("v", v)):
        if tuple(np.shape(t)) != (num_kv_heads * d,) + rest:
            raise ValueError(f"{name} has shape {np.shape(t)}; expected {(num_kv_heads * d,) + rest} "
                             f"(num_kv_heads={num_kv_heads} x head_dim={d})")
    xp = _xp(q, k, v)

    def kv_blocks(t):
        heads = t.reshape((num_kv_heads, d) + rest)
        heads = repeat_kv_heads(heads, rep, axis=0)  # [tp*kh, d, ...] once replicated
        return heads.reshape((tp, kh * d) + rest)

    fused = xp.concatenate([_rank_blocks(q, tp), kv_blocks(k), kv_blocks(v)], axis=1)
    return fused.reshape((tp * (qh + 2 * kh) * d,) + rest)


def unfuse_qkv_per_rank(qkv, *, num_heads: int, num_kv_heads: int, tp: int) -> tuple:
    """Inverse of :func:`fuse_qkv_per_rank`: ``(q [nH*D, ...], k [nKV*D, ...], v [nKV*D, ...])``; replicated kv
    heads are read from the first rank that holds them.

    Raises:
        ValueError: a leading size that does not fit the head counts.
    """
    qh, kh, rep = kv_layout(num_heads, num_kv_heads, tp)
    rows = np.shape(qkv)[0]
    if rows % (tp * (qh + 2 * kh)):
        raise ValueError(f"qkv rows {rows} are not a multiple of tp*(q+2kv heads per rank) = {tp * (qh + 2 * kh)}")
    d = rows // (tp * (qh + 2 * kh))
    rest = tuple(np.shape(qkv)[1:])
    blocks = qkv.reshape((tp, (qh + 2 * kh) * d) + rest)
    q = blocks[:, : qh * d].reshape((num_heads * d,) + rest)
    k = blocks[::rep, qh * d : (qh + kh) * d].reshape((num_kv_heads * d,) + rest)
    v = blocks[::rep, (qh + kh) * d :].reshape((num_kv_heads * d,) + rest)
    return q, k, v


def fuse_gate_up_per_rank(gate, up, tp: int):
    """Fuse SwiGLU ``gate``/``up`` (``[I, ...]`` each, HF ``[I, E]``) into vLLM's ``gate_up_proj`` layout
    ``[2I, ...]`` whose rank-``r`` block is ``[gate rows r*I/tp..(r+1)*I/tp | the same rows of up]``.

    Raises:
        ValueError: different shapes, or ``tp`` not dividing ``I``.
    """
    if np.shape(gate) != np.shape(up):
        raise ValueError(f"gate {np.shape(gate)} and up {np.shape(up)} must have the same shape")
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1 or np.shape(gate)[0] % tp:
        raise ValueError(f"tp={tp!r} must be a positive int dividing the intermediate size {np.shape(gate)[0]}")
    fused = _xp(gate, up).concatenate([_rank_blocks(gate, tp), _rank_blocks(up, tp)], axis=1)
    return fused.reshape((2 * np.shape(gate)[0],) + tuple(np.shape(gate)[1:]))


def unfuse_gate_up_per_rank(gate_up, tp: int) -> tuple:
    """Inverse of :func:`fuse_gate_up_per_rank`: ``(gate [I, ...], up [I, ...])``.

    Raises:
        ValueError: a leading size not divisible by ``2*tp``.
    """
    rows = np.shape(gate_up)[0]
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1 or rows % (2 * tp):
        raise ValueError(f"gate_up rows {rows} must be divisible by 2*tp (tp={tp!r})")
    rest = tuple(np.shape(gate_up)[1:])
    blocks = gate_up.reshape((tp, 2, rows // (2 * tp)) + rest)
    return blocks[:, 0].reshape((rows // 2,) + rest), blocks[:, 1].reshape((rows // 2,) + rest)
