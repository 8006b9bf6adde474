"""Decoder-only transformer (Llama / Qwen2 / Qwen3) in Flax NNX, with an explicit-slot KV cache.

Numerics follow Hugging Face ``transformers`` (``modeling_llama.py``, ``modeling_qwen2.py``, ``modeling_qwen3.py``,
``modeling_rope_utils.py``): pre-norm blocks, RMSNorm computed in float32, RoPE with the ``rotate_half``
convention (first half / second half of ``head_dim`` paired), grouped-query attention where query head ``h`` reads
key/value head ``h // (nH // nKV)``, SwiGLU MLP ``down(silu(gate(x)) * up(x))``.

Parameter layouts and logical axis names (stored as NNX ``out_sharding`` metadata with ``eager_sharding=False``,
so nothing needs a mesh; ``nnx.get_partition_spec(nnx.state(model))`` returns them for a later mapping from
logical names to mesh axes)::

    embed_tokens                [V, H]        ("vocab", "embed")
    layers[i].input_layernorm.scale, post_attention_layernorm.scale, norm.scale
                                [H]           ("embed",)
    layers[i].self_attn.q_proj  [H, nH, D]    ("embed", "heads", "head_dim")
    layers[i].self_attn.k_proj  [H, nKV, D]   ("embed", "kv_heads", "head_dim")   (v_proj likewise)
    layers[i].self_attn.o_proj  [nH, D, H]    ("heads", "head_dim", "embed")
    layers[i].self_attn.q_bias  [nH, D]       ("heads", "head_dim")               (k_bias/v_bias: "kv_heads")
    layers[i].self_attn.q_norm.scale, k_norm.scale
                                [D]           ("head_dim",)
    layers[i].mlp.gate_proj     [H, I]        ("embed", "mlp")                    (up_proj likewise)
    layers[i].mlp.down_proj     [I, H]        ("mlp", "embed")
    lm_head                     [H, V]        ("embed", "vocab")                  (absent when tied)

``V`` vocab, ``H`` hidden, ``I`` intermediate, ``nH`` query heads, ``nKV`` kv heads, ``D`` head_dim.

``Attention.lora`` / ``MLP.lora`` are None unless :func:`jaxrl.models.lora.apply_lora` added LoRA adapters (then
each adapted projection adds ``(alpha / r) * (x @ A) @ B`` to its output, bias included first, as PEFT does).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models.config import ModelConfig

# Finite "minus infinity" for masked attention scores: a fully masked row then softmaxes to a uniform
# distribution instead of NaN (padding rows are ignored by callers anyway).
_MASK_VALUE = -1e30


class KVCache(NamedTuple):
    """Key/value cache for all layers: one array per layer.

    Attributes:
        k: ``num_layers`` arrays ``[batch, num_kv_heads, max_len, head_dim]``, keys after RoPE (and q/k-norm).
        v: ``num_layers`` arrays ``[batch, num_kv_heads, max_len, head_dim]``, values.

    Kv-head-major (slots next to ``head_dim``): a layer's ``[B, nKV, S, D]`` array is already in the layout the
    attention's batched matmuls read (batch ``B x nKV``, ``S x D`` rows), so decoding reads the cache without a
    per-layer transposing copy (:func:`cached_gqa_attention`). One buffer per layer, not one ``[L, ...]`` array: the
    attention reads its layer's buffer as it is, where a layer's slice of a stacked cache was copied out on every
    decode step (XLA:CPU materialises the slice for the matmul: 24% of the decode loop's op time on SmolLM2 at
    batch 16 with a 319-slot cache, 11% at batch 32 with 95 slots). Each buffer is updated in place in the loop.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Return an all-zero :class:`KVCache`: ``L`` arrays ``[batch, nKV, max_len, D]`` each for keys and values, in
    ``dtype``.

    Raises:
        ValueError: ``batch`` or ``max_len`` is not a positive int.
    """
    for name, v in (("batch", batch), ("max_len", max_len)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    shape = (int(batch), cfg.num_key_value_heads, int(max_len), cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers))


# ----------------------------------------------------------------------------------------------- pure math
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32 for ``cfg`` (default, linear or llama3 scaling).

    Formulas from ``transformers.modeling_rope_utils`` (``_compute_default_rope_parameters``,
    ``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``):
    ``inv_freq[i] = rope_theta ** (-2i / head_dim)``; linear divides by ``factor``; llama3 divides the
    low-frequency band (wavelength > ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the
    high-frequency band, and interpolates smoothly in between.
    """
    d = cfg.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":
        return (inv / np.float32(rs["factor"])).astype(np.float32)
    # llama3
    factor = float(rs["factor"])
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``[B, T, D]`` float32 for integer ``positions`` ``[B, T]`` (HF layout: the D/2
    frequencies are repeated twice, ``cat(freqs, freqs)``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[B, T, n, D]`` by ``cos/sin`` ``[B, T, D]`` (HF ``rotate_half``); computed in float32,
    returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``scale * x / sqrt(mean(x^2) + eps)`` over the last axis; statistics in float32, result in ``x.dtype``
    (HF ``LlamaRMSNorm``: normalise in fp32, cast back, then multiply by the weight)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return scale.astype(x.dtype) * normed


def _masked_softmax(scores: jax.Array, mask: jax.Array, head_dim: int) -> jax.Array:
    """Attention probabilities from float32 ``scores`` ``[B, nKV, G, T, S]`` and ``mask`` ``[B, T, S]``: scaled by
    ``1/sqrt(head_dim)``, masked keys set to ``_MASK_VALUE`` (a fully masked row becomes uniform, never NaN)."""
    scores = jnp.where(mask[:, None, None, :, :], scores * (1.0 / math.sqrt(head_dim)), _MASK_VALUE)
    return jax.nn.softmax(scores, axis=-1)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    Args:
        q: ``[B, T, nH, D]`` queries.
        k, v: ``[B, S, nKV, D]`` keys / values; ``nH % nKV == 0``, query head ``h`` uses kv head ``h // (nH//nKV)``.
        mask: ``[B, T, S]`` bool, True where query ``t`` may attend to key ``s``.

    Returns:
        ``[B, T, nH, D]`` in ``q.dtype``. Scores and softmax are float32 with scale ``1/sqrt(D)``; fully masked
        rows give a uniform average (finite), never NaN.
    """
    b, t, nh, d = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    qg = q.reshape(b, t, nkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    probs = _masked_softmax(scores, mask, d)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh, d).astype(q.dtype)


# Rows from which one decode query's cached attention is computed as broadcast products reduced over D and S
# (:func:`_decode_gqa_attention`) instead of two batched matmuls. SmolLM2 shapes (nKV 3, G 3, D 64, 30 layers) on a
# 2-core Xeon, attention alone: 64 rows x 128 slots 55-72 vs 94-103 ms, 16 x 320 52 vs 60 ms, 4 x 128 5.1 vs 5.9 ms;
# at 1 row the matmuls win (1.1 vs 3.0 ms), at 2 rows they tie. XLA:CPU only: on an H200 (jax 0.11.2) the same
# form made a decode step at Qwen3-1.7B widths, 96 rows x 1535 slots, 4 layers, 2.71 ms against the matmuls' 1.62 ms
# (bench/results/gpu_h200.md), so other platforms keep the matmuls (:func:`decode_attention_form`).
DECODE_REDUCE_MIN_ROWS = 4


def decode_attention_form(rows: int, platform: str) -> str:
    """How :func:`cached_gqa_attention` computes one decode query per row over ``rows`` rows on ``platform`` (a
    ``jax.default_backend()`` name): ``"reduce"`` (:func:`_decode_gqa_attention`) on ``"cpu"`` from
    :data:`DECODE_REDUCE_MIN_ROWS` rows, else ``"matmul"`` (two batched matmuls)."""
    return "reduce" if platform == "cpu" and rows >= DECODE_REDUCE_MIN_ROWS else "matmul"


def _decode_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """:func:`cached_gqa_attention` for one query per row (``q`` ``[B, 1, nH, D]``), as elementwise products
    reduced over ``D`` (scores ``[B, nKV, S, G]``) and over ``S`` (values): a decode query's score "matmul" is
    ``[S, D] x [D, G]`` per kv head, too skinny for a matmul kernel, while a reduction fusion reads each cached key
    and value once without materialising the products. Same numbers up to float32 summation order."""
    b, _, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, 1, g, d).astype(jnp.float32)
    scores = jnp.sum(k[:, :, :, None, :].astype(jnp.float32) * qg, axis=-1)  # [B, nKV, S, G]
    keep = mask[:, 0, None, :, None]  # [B, 1, S, 1]
    probs = jax.nn.softmax(jnp.where(keep, scores * (1.0 / math.sqrt(d)), _MASK_VALUE), axis=2)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=2)  # [B, nKV, G, D]
    return out.reshape(b, 1, nh, d).astype(q.dtype)


def cached_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """:func:`gqa_attention` over one layer of the kv-head-major KV cache.

    Args:
        q: ``[B, T, nH, D]`` queries.
        k, v: ``[B, nKV, S, D]`` the layer's cached keys / values (:class:`KVCache` layout); ``nH % nKV == 0``.
        mask: ``[B, T, S]`` bool, True where query ``t`` may attend to key ``s``.

    Returns:
        ``[B, T, nH, D]`` in ``q.dtype``, as :func:`gqa_attention` (up to float32 summation order).

    The cache is the left operand of the score matmul and the right operand of the value matmul, batched over
    ``(B, nKV)`` with ``D`` (scores) or ``S`` (values) contracted: both read the cache in its own layout, so no
    cache-sized operand is transposed (the ``[B, S, nKV, D]`` layout cost a copy of every layer's keys and values
    per decode step; only the ``[.., S, G, T]`` scores are rearranged here). One query per row (a decode step) goes
    through :func:`_decode_gqa_attention` instead where :func:`decode_attention_form` says so for the rows and the
    backend being traced for (``jax.default_backend()``: XLA:CPU from :data:`DECODE_REDUCE_MIN_ROWS` rows).
    """
    b, t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    with jax.named_scope("kv_cache_attention"):  # (names its ops in profiles: bench/rollout_throughput.py)
        if t == 1 and decode_attention_form(b, jax.default_backend()) == "reduce":
            return _decode_gqa_attention(q, k, v, mask)
        qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, nKV, G, T, D]
        dims = (((3,), (4,)), ((0, 1), (0, 1)))
        scores = jax.lax.dot_general(k, qg, dims, preferred_element_type=jnp.float32)  # [B, nKV, S, G, T]
        keep = jnp.swapaxes(mask, 1, 2)[:, None, :, None, :]  # [B, 1, S, 1, T]
        scores = jnp.where(keep, scores * (1.0 / math.sqrt(d)), _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=2)
        dims = (((2,), (2,)), ((0, 1), (0, 1)))
        out = jax.lax.dot_general(probs.astype(v.dtype), v, dims, preferred_element_type=jnp.float32)  # [B,nKV,G,T,D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d).astype(q.dtype)


def causal_query_block(t: int) -> int:
    """Query-block width of :func:`causal_gqa_attention` for ``t`` tokens: a multiple of 32, at least 32, and at
    most 16 blocks per row (the blocks are unrolled in the program, so their count bounds compile time)."""
    return 32 * max(1, -(-int(t) // (16 * 32)))


def causal_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                         block: int | None = None) -> jax.Array:
    """:func:`gqa_attention` for a causal mask over one chunk (no KV cache), computed in query blocks that skip
    the key blocks every query of the block is masked from.

    Query block ``[lo, hi)`` attends to keys ``[0, hi)`` only: a causal mask hides every later key, so the scores,
    softmax and value sums of the skipped upper triangle are never computed (about half of the ``T x T`` work, and
    each block's scores stay small enough for the cache). Heads are laid out key-value-head-major once
    (``[B, nKV, nH/nKV, T, D]``) instead of per einsum. On a 2-core CPU (SmolLM2 shapes, forward + backward of one
    layer's attention): 1 x 1024 tokens 217 -> 62-67 ms, 4 x 320 46 -> 30-33 ms, 16 x 96 20 -> 12-14 ms.

    Args:
        q: ``[B, T, nH, D]`` queries.
        k, v: ``[B, T, nKV, D]`` keys / values of the same ``T`` positions (``nH % nKV == 0``).
        mask: ``[B, T, T]`` bool, True where query ``t`` may attend to key ``s``; must be False for every
            ``s > t`` (causal), which the caller guarantees (the decoder's no-cache path builds it so).
        block: query-block width; None = :func:`causal_query_block` of ``T``.

    Returns:
        ``[B, T, nH, D]`` in ``q.dtype``, equal to ``gqa_attention(q, k, v, mask)`` (up to float32 summation
        order) at every query with at least one visible key. A query with none (padding) gets the uniform
        average of the keys up to its block's end instead of all keys: finite, and no real token attends to it.

    Raises:
        ValueError: ``k`` / ``v`` / ``mask`` not over the same ``T`` positions as ``q``; ``block < 1``.
    """
    b, t, nh, d = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    if k.shape[1] != t or v.shape[1] != t or mask.shape != (b, t, t):
        raise ValueError(
            f"causal attention needs keys, values and mask over the queries' {t} positions; got k {k.shape}, "
            f"v {v.shape}, mask {mask.shape}"
        )
    block = causal_query_block(t) if block is None else int(block)
    if block < 1:
        raise ValueError(f"block (query-block width) must be a positive number of tokens; got {block}")
    qh = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, nKV, G, T, D]
    kh = k.transpose(0, 2, 1, 3)  # [B, nKV, T, D]
    vh = v.transpose(0, 2, 1, 3)
    outs = []
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        scores = jnp.einsum("bkgtd,bksd->bkgts", qh[:, :, :, lo:hi], kh[:, :, :hi],
                            preferred_element_type=jnp.float32)
        probs = _masked_softmax(scores, mask[:, lo:hi, :hi], d)
        outs.append(jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), vh[:, :, :hi],
                               preferred_element_type=jnp.float32))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)  # [B, nKV, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d).astype(q.dtype)


class SegmentLayout(NamedTuple):
    """Packed rows' attention computed per segment (verl's varlen attention, flash-attn's ``cu_seqlens``, in static
    shapes): each layer's queries, keys and values are gathered from the packed ``[B, T]`` rows into a padded
    ``[B x S, L]`` layout (segment ``s`` of row ``b`` in row ``b x S + s``, its tokens at ``0..n-1``), attended
    causally there (:func:`causal_gqa_attention`), and the outputs gathered back. Passed as an attention block's
    ``mask``.

    Attributes:
        cols: ``[B, S, L]`` int32: the packed column of token ``p`` of segment ``s`` of row ``b``; ``>= T`` where
            the segment has no token ``p`` (or no segment ``s`` exists). Segments may share columns (a prompt laid
            once for several responses: :mod:`jaxrl.workers.packing`), each a causal prefix of every holder.
        mask: ``[B x S, L, L]`` bool: causal, over real tokens only.
        place: ``[B, T]`` int32: where packed column ``t`` of row ``b`` sits in that row's ``S x L`` outputs
            (``s x L + p`` for token ``p`` of segment ``s``, the first such segment); ``S x L`` at columns no segment
            holds (row padding).
    """

    cols: jax.Array
    mask: jax.Array
    place: jax.Array


def segment_layout(segment_cols: jax.Array, t: int) -> SegmentLayout:
    """The :class:`SegmentLayout` of ``segment_cols`` ``[B, S, L]`` over packed rows of ``t`` columns (its mask:
    causal within each segment's ``L`` positions, over the real ones, those ``< t``; built once per forward and read
    by every layer)."""
    b, s, length = segment_cols.shape
    real = (segment_cols < t).reshape(b * s, 1, length)
    cols = segment_cols.reshape(b, s * length)
    # a column several segments hold (a shared prompt: jaxrl.workers.packing) takes the first one's output: every
    # holder computes the same values there (the same tokens, positions and causal keys)
    place = jnp.full((b, t), s * length, jnp.int32).at[jnp.arange(b)[:, None], cols].min(
        jnp.broadcast_to(jnp.arange(s * length, dtype=jnp.int32), cols.shape), mode="drop")
    return SegmentLayout(segment_cols, jnp.tril(jnp.ones((length, length), bool))[None] & real, place)


def segment_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout) -> jax.Array:
    """Attention of packed rows, each segment attending causally within itself (see :class:`SegmentLayout`).

    The work is that of the padded layout ``[B x S, L]`` (its causal upper triangle skipped in blocks), not of
    ``[B, T, T]``: a packed row of ``T`` tokens holding several sequences otherwise scores every earlier column of
    the row, most of them other sequences' (2-core CPU, SmolLM2 shapes, one layer's attention forward + backward: a
    1024-token row of three ~330-token sequences took 67.5 ms as causal blocks over the row, four 320-token rows
    29.5 ms).

    Args:
        q: ``[B, T, nH, D]``; k, v: ``[B, T, nKV, D]``.
        layout: :class:`SegmentLayout` over the same ``B`` rows of ``T`` columns.

    Returns:
        ``[B, T, nH, D]`` in ``q.dtype``, equal to ``gqa_attention`` with the causal same-segment mask (up to float32
        summation order) at every column a segment holds; 0 at columns no segment holds (row padding).
    """
    b, t = q.shape[:2]
    _, s, length = layout.cols.shape
    cols = layout.cols.reshape(b, s * length)
    rows = jnp.arange(b)[:, None]
    safe = jnp.minimum(cols, t - 1)  # a missing token reads the last column: masked as a key, dropped as a query

    def gather(x):
        return x[rows, safe].reshape(b * s, length, *x.shape[2:])

    out = causal_gqa_attention(gather(q), gather(k), gather(v), layout.mask).reshape(b, s * length, *q.shape[2:])
    # back to the packed columns as a gather (``layout.place``; padding columns read an appended zero row), not a
    # scatter into zeros: XLA:CPU split that scatter per query block of the attention, each with a whole
    # [B, T, nH, D] buffer (the prefill of 96 x 512 tokens at Qwen3-1.7B widths, float32: 16.9 GB of temporaries with
    # the scatter, 6.1 GB with this gather)
    out = jnp.concatenate([out, jnp.zeros((b, 1, *out.shape[2:]), out.dtype)], axis=1)
    return out[rows, layout.place]


# ----------------------------------------------------------------------------------------------- modules
def dense(x: jax.Array, w: jax.Array, *, in_dims: int = 1, transposed: bool = False,
          preferred_element_type=None) -> jax.Array:
    """A projection of the last ``in_dims`` axes of ``x`` by ``w``, computed as one 2-D matmul.

    ``x`` ``[B, T, *in]`` and ``w`` ``[*in, *out]`` (or ``[*out, *in]`` with ``transposed``, e.g. a tied embedding
    ``[V, H]`` read as the LM head) give ``[B, T, *out]``; the dtypes are ``x``'s and ``w``'s (cast by the caller).
    The same numbers as ``jnp.einsum`` over the named axes, but the leading ``[B, T]`` axes are flattened into
    one row axis first: with two batch-like axes left in the contraction, XLA:CPU computes the weight gradient
    ``x^T dy`` over ``(B, T)`` after materialising a transposed copy of ``dy`` (a strided write of the whole
    activation in every backward projection); as ``[B*T, in] x [in, out]`` it is one plain matmul each way.
    Measured on SmolLM2-135M's MLP (``16 x 96`` tokens, forward + backward): 198 -> 145 ms.

    Raises:
      ValueError: ``w`` does not hold ``x``'s last ``in_dims`` axes where ``transposed`` says.
    """
    lead, inner = x.shape[: x.ndim - in_dims], x.shape[x.ndim - in_dims:]
    k = math.prod(inner)
    w_in = w.shape[w.ndim - in_dims:] if transposed else w.shape[:in_dims]
    if tuple(w_in) != tuple(inner):
        raise ValueError(f"dense: weight {tuple(w.shape)} does not take input axes {tuple(inner)} of x "
                         f"{tuple(x.shape)} ({'last' if transposed else 'first'} {in_dims} weight axes must match)")
    out = w.shape[: w.ndim - in_dims] if transposed else w.shape[in_dims:]
    w2 = w.reshape(-1, k) if transposed else w.reshape(k, -1)
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    y = jax.lax.dot_general(x.reshape(-1, k), w2, dims, preferred_element_type=preferred_element_type)
    return y.reshape(*lead, *out)


def project(x: jax.Array, w: jax.Array, dtype, matmul_dtype=None, **kwargs) -> jax.Array:
    """:func:`dense` of ``x`` by the weight ``w`` in the compute dtype ``dtype``, or, with ``matmul_dtype``, with
    both operands in ``matmul_dtype`` and the products accumulated and returned in ``dtype``.

    ``matmul_dtype=bfloat16`` with ``dtype=float32`` is the rollout's reduced-precision mode (the embedded sampler's
    ``dtype``, verl's ``actor_rollout_ref.rollout.dtype``): weights held in bfloat16 and every projection a
    bfloat16 x bfloat16 -> float32 matmul, activations, norms, attention and the KV cache in float32. XLA:CPU runs
    that dot on the bfloat16 units (AMX / AVX512-BF16) where it has them, while a bfloat16 -> bfloat16 dot converts
    its operands to float32 (jax 0.10). Used only where nothing is differentiated: JAX's transpose of this dot
    multiplies the float32 cotangent by the bfloat16 operand, which no backend runs at bfloat16 speed.
    ``kwargs`` go to :func:`dense` (``in_dims``, ``transposed``); the result's dtype is ``dtype``.
    """
    if matmul_dtype is None:
        return dense(x, w.astype(dtype), **kwargs)
    return dense(x.astype(matmul_dtype), w.astype(matmul_dtype), preferred_element_type=dtype, **kwargs)


def _param(rngs: nnx.Rngs | None, shape, names, dtype, init: str) -> nnx.Param:
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, dtype=jnp.float32) * 0.02
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=tuple(names), eager_sharding=False)


def _with_lora(lora, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` plus the LoRA adapter ``name``'s output on ``x`` when ``lora`` holds one (PEFT's order: the base
    projection, bias included, then ``+ scale * (x @ A) @ B``); ``x`` ``[B, T, ...in]`` and ``y`` ``[B, T, ...out]``
    are flattened to the adapter's ``[in]`` / ``[out]`` and back. Without an adapter ``y`` is returned as is."""
    if lora is None or name not in lora:
        return y
    delta = lora[name](x.reshape(*x.shape[:2], -1))
    return y + delta.reshape(y.shape).astype(y.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned ``scale`` ``[dim]`` (see :func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float, name: str, *, param_dtype):
        self.eps = float(eps)
        self.scale = _param(None, (dim,), (name,), param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    """GQA self-attention with RoPE, optional q/k/v bias and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype, dtype):
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.dtype = dtype
        self.matmul_dtype = None  # projections' operand dtype when not `dtype` (:func:`project`; set by the sampler)
        self.q_proj = _param(rngs, (h, nh, d), ("embed", "heads", "head_dim"), param_dtype, "normal")
        self.k_proj = _param(rngs, (h, nkv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.v_proj = _param(rngs, (h, nkv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.o_proj = _param(rngs, (nh, d, h), ("heads", "head_dim", "embed"), param_dtype, "normal")
        if cfg.attention_bias:
            self.q_bias = _param(None, (nh, d), ("heads", "head_dim"), param_dtype, "zeros")
            self.k_bias = _param(None, (nkv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            self.v_bias = _param(None, (nkv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.lora = nnx.data(None)  # LoRA adapters by projection name (jaxrl.models.lora.apply_lora), or None

    def _proj(self, x, kernel, bias, name):
        y = project(x, kernel[...], self.dtype, self.matmul_dtype)
        if bias is not None:
            y = y + bias[...].astype(self.dtype)
        return checkpoint_name(_with_lora(self.lora, name, x, y), name)

    def __call__(self, x, cos, sin, mask, k_cache, v_cache, cache_index):
        """``x`` ``[B, T, H]``; ``mask`` ``[B, T, S]`` (or, without a cache, :class:`SegmentLayout`);
        ``k_cache/v_cache``: this layer's cache ``[B, nKV, S, D]`` (:class:`KVCache`), or None (no cache).

        Returns ``(out [B, T, H], k, v)``: with a cache, the layer's cache with the new keys/values (post-RoPE)
        written at slots ``[cache_index, cache_index + T)`` (``cache_index`` a scalar, or ``[B]``: one start slot per
        row, written by a scatter); without, the new keys/values ``[B, T, nKV, D]``. Attending over the updated
        buffer itself lets XLA update the cache in place inside the decode loop (no per-step copy of it)."""
        q = self._proj(x, self.q_proj, self.q_bias, "q_proj")
        k = self._proj(x, self.k_proj, self.k_bias, "k_proj")
        v = self._proj(x, self.v_proj, self.v_bias, "v_proj")
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if k_cache is None:
            k_all, v_all = k, v
        elif cache_index.ndim == 1:  # one start slot per row (continuous batching: every row at its own position)
            b, t = x.shape[:2]
            rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
            slots = cache_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            # [rows, :, slots] with the slice between advanced indices: the updated cells are [B, T, nKV, D]
            k_cache = k_cache.at[rows, :, slots].set(k.astype(k_cache.dtype), mode="promise_in_bounds")
            v_cache = v_cache.at[rows, :, slots].set(v.astype(v_cache.dtype), mode="promise_in_bounds")
            k_all, v_all = k_cache.astype(self.dtype), v_cache.astype(self.dtype)
            k, v = k_cache, v_cache
        else:
            start = (0, 0, cache_index, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, _kv_major(k, k_cache.dtype), start)
            v_cache = jax.lax.dynamic_update_slice(v_cache, _kv_major(v, v_cache.dtype), start)
            k_all, v_all = k_cache.astype(self.dtype), v_cache.astype(self.dtype)
            k, v = k_cache, v_cache
        # no cache: the mask the decoder builds is causal over this chunk's own positions (or per packed segment)
        if k_cache is not None:
            attend = cached_gqa_attention
        elif isinstance(mask, SegmentLayout):
            attend = segment_gqa_attention
        else:
            attend = causal_gqa_attention
        out = attend(q, k_all, v_all, mask)
        proj = project(out, self.o_proj[...], self.dtype, self.matmul_dtype, in_dims=2)
        return checkpoint_name(_with_lora(self.lora, "o_proj", out, proj), "o_proj"), k, v


def _kv_major(x: jax.Array, dtype) -> jax.Array:
    """New keys/values ``[B, T, nKV, D]`` as one layer's cache update ``[B, nKV, T, D]`` in ``dtype``."""
    return jnp.swapaxes(x, 1, 2).astype(dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype, dtype):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.matmul_dtype = None  # as Attention.matmul_dtype
        self.gate_proj = _param(rngs, (h, i), ("embed", "mlp"), param_dtype, "normal")
        self.up_proj = _param(rngs, (h, i), ("embed", "mlp"), param_dtype, "normal")
        self.down_proj = _param(rngs, (i, h), ("mlp", "embed"), param_dtype, "normal")
        self.lora = nnx.data(None)  # LoRA adapters by projection name (jaxrl.models.lora.apply_lora), or None

    def __call__(self, x):
        def proj(x, w):
            return project(x, w[...], self.dtype, self.matmul_dtype)

        gate = checkpoint_name(_with_lora(self.lora, "gate_proj", x, proj(x, self.gate_proj)), "gate_proj")
        up = checkpoint_name(_with_lora(self.lora, "up_proj", x, proj(x, self.up_proj)), "up_proj")
        h = jax.nn.silu(gate) * up
        return _with_lora(self.lora, "down_proj", h, proj(h, self.down_proj))


class Block(nnx.Module):
    """Pre-norm decoder block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=param_dtype)
        self.self_attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=param_dtype)
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def __call__(self, x, cos, sin, mask, k_cache, v_cache, cache_index):
        h, k_new, v_new = self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, cache_index)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_new, v_new


def _call_block(block: Block, x, cos, sin, mask, k_cache, v_cache, cache_index):
    return block(x, cos, sin, mask, k_cache, v_cache, cache_index)


# The projection outputs :meth:`Attention.__call__` and :meth:`MLP.__call__` name
# (``jax.ad_checkpoint.checkpoint_name``) for a rematerialisation policy to keep.
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
# What a rematerialised block keeps for its backward pass, by ``remat`` name (``actor_rollout_ref.model.
# recompute_granularity``, Megatron-Core's term): "full" keeps only the block's input and recomputes the whole block;
# "selective" also keeps the q/k/v/o and gate/up projection outputs (``PROJECTION_NAMES``), so only attention, the
# norms, RoPE and the SwiGLU product are recomputed: no matmul of a projection runs twice. Measured (SmolLM2-135M, the
# GSM8K config's update of 16 responses in 1024-token micro-batches, 2-core CPU, one process alternating the two):
# 17.4 s full, 15.4 s selective; it keeps ``[L, tokens, 4608]`` float32 more per micro-batch (0.33 GB at 590 tokens).
REMAT_POLICIES = {
    "full": None,
    "selective": jax.checkpoint_policies.save_only_these_names(*PROJECTION_NAMES),
}
_remat_blocks = {name: nnx.remat(_call_block, policy=policy) for name, policy in REMAT_POLICIES.items()}


def remat_policy_name(remat: bool | str) -> str | None:
    """The :data:`REMAT_POLICIES` name a ``remat=`` argument means: None for False (no rematerialisation), ``"full"``
    for True, a policy name as it is.

    Raises:
      ValueError: a string that is not a policy name, or another type (the message lists the valid values).
    """
    if remat is False or remat is None:
        return None
    if remat is True:
        return "full"
    if isinstance(remat, str) and remat in REMAT_POLICIES:
        return remat
    raise ValueError(f"remat={remat!r}; valid: False, True, or one of {', '.join(map(repr, REMAT_POLICIES))}")


def _scan_blocks(graphdef, stacked, x, cos, sin, mask, constrain, *, remat: bool, policy: str = "full"):
    """``x`` through the blocks whose weights ``stacked`` holds along a leading ``[L, ...]`` axis (``graphdef``: one
    block's), as one ``lax.scan``; each step rematerialised (``jax.checkpoint``) when ``remat``, keeping what the
    :data:`REMAT_POLICIES` entry ``policy`` names."""

    def step(h, state):
        h, _, _ = nnx.merge(graphdef, state)(h, cos, sin, mask, None, None, None)
        return constrain(h)

    step = jax.checkpoint(step, policy=REMAT_POLICIES[policy]) if remat else step
    x, _ = jax.lax.scan(lambda h, state: (step(h, state), None), x, stacked)
    return x


class StackedBlocks(nnx.Module):
    """``L`` blocks of one structure stored as one :class:`Block` whose parameters carry a leading ``[L, ...]`` axis
    (MaxText's ``scan_layers`` layout): a :class:`Decoder`'s ``layers`` in the training layout
    (:func:`jaxrl.models.scan_layout.stack_layers`). The forward is a ``lax.scan`` over the stacked weights, so the
    training step neither stacks them per call nor unstacks their gradient. Built only by that function.

    Attributes:
      block: the block holding the stacked parameters.
      num_layers: ``L``.
    """

    def __init__(self, block: Block, num_layers: int):
        self.block = block
        self.num_layers = int(num_layers)


class Decoder(nnx.Module):
    """Causal language model: token embedding, ``L`` pre-norm blocks, final RMSNorm, LM head (tied or not).

    Args:
        cfg: architecture.
        rngs: random streams for initialisation (``rngs.params``); weights ~ N(0, 0.02), norms 1, biases 0.
        param_dtype: storage dtype of the parameters (e.g. ``jnp.float32`` or ``jnp.bfloat16``).
        dtype: compute dtype of activations and matmuls; RMSNorm statistics, RoPE, attention softmax and the
            returned logits are float32 regardless.
        remat: recompute each block's activations in the backward pass (the training forward then runs the blocks
            as a rematerialised ``lax.scan``: :meth:`_remat_scan`): False (off), True or ``"full"`` (each block
            recomputed from its input), ``"selective"`` (the projection outputs kept: :data:`REMAT_POLICIES`).

    Attributes:
        layers: the ``L`` blocks, an ``nnx.List`` of :class:`Block`; or, in the training layout of a trained role
            (:func:`jaxrl.models.scan_layout.stack_layers`), one :class:`StackedBlocks` holding them stacked
            (forward without a KV cache only).
        remat: whether the training forward is rematerialised; remat_policy: what it then keeps (a
            :data:`REMAT_POLICIES` name; ``"full"`` when ``remat`` is off).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        remat: bool | str = False,
    ):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.param_dtype = jnp.dtype(param_dtype)
        self.dtype = jnp.dtype(dtype)
        self.matmul_dtype = None  # the LM head's operand dtype when not `dtype` (as Attention.matmul_dtype)
        policy = remat_policy_name(remat)
        self.remat = policy is not None
        self.remat_policy = policy or "full"  # what a rematerialised forward keeps (REMAT_POLICIES)
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg))  # static, hashable
        self.embed_tokens = _param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), self.param_dtype, "normal"
        )
        self.layers = nnx.List(
            [
                Block(cfg, rngs=rngs, param_dtype=self.param_dtype, dtype=self.dtype)
                for _ in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=self.param_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), self.param_dtype, "normal"
            )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        return_hidden: bool = False,
        activation_sharding=None,
        segment_ids: jax.Array | None = None,
        remat: bool | None = None,
        segment_cols: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Run the model on a chunk of ``T`` tokens.

        Args:
            input_ids: ``[B, T]`` int token ids.
            positions: ``[B, T]`` int RoPE positions (for a left-padded prompt pass ``cumsum(mask) - 1``).
            attention_mask: key mask, bool or int (nonzero = real token). Without a cache ``[B, T]``; with a
                cache ``[B, S]`` where ``S`` is the cache ``max_len`` (covering both cached and new slots).
            cache: optional :class:`KVCache`, ``L`` arrays ``[B, nKV, S, D]`` each for keys and values.
            activation_sharding: optional ``jax.sharding.Sharding`` for the ``[B, T, H]`` residual stream; with a
                mesh the trainer passes rows over the batch axes, and it is applied after the embedding and at
                every block boundary (``jax.lax.with_sharding_constraint``) so activations follow the mesh rules.
            cache_index: int32 scalar (may be traced): the slot of the first new token; required with ``cache``.
                Callers must keep ``cache_index + T <= S`` (out-of-range writes are clamped by
                ``lax.dynamic_update_slice``). Or int32 ``[B]``: row ``b``'s first new token goes to slot
                ``cache_index[b]`` (rows decoding at different positions, e.g. continuous batching); callers must
                keep ``cache_index[b] + T <= S`` (out-of-range slots are undefined behaviour, not clamped).
            return_hidden: return the final-normed hidden states instead of logits.
            segment_ids: optional ``[B, T]`` int, no cache only: packed rows (several sequences per row,
                :mod:`jaxrl.workers.packing`). Query ``t`` then also needs ``segment_ids[b, s] ==
                segment_ids[b, t]``, so attention never crosses a sequence boundary; the caller restarts
                ``positions`` at 0 for each segment and marks padding with ``attention_mask`` 0 (segment 0).
                None (the default) leaves the program exactly as without the argument.
            segment_cols: optional ``[B, S, L]`` int32 with ``segment_ids``: where each segment's tokens sit
                (:class:`SegmentLayout`; :func:`jaxrl.workers.packing.packed_micro` gives it). Attention then runs
                per segment in a padded ``[B x S, L]`` layout: the same numbers as the ``[B, T, T]`` segment mask
                for a fraction of the work when a row holds several sequences.
            remat: None = the model's ``remat`` setting; False for a forward that is never differentiated (the
                log-prob and value passes), which then runs the plain layer loop instead of the rematerialised
                scan (whose in-program weight stacking costs time and saves nothing without a backward).

        Semantics: without a cache, query ``t`` attends to keys ``s <= t`` with ``attention_mask[b, s]``. With a
        cache, the new keys/values are written to slots ``[cache_index, cache_index + T)`` and query ``t`` (at
        slot ``cache_index + t``) attends to slots ``s <= cache_index + t`` with ``attention_mask[b, s]`` (with a
        ``[B]`` ``cache_index``, row ``b``'s ``cache_index[b]`` in place of ``cache_index``).

        Returns:
            ``(out, new_cache)``: ``out`` is logits ``[B, T, V]`` float32, or hidden states ``[B, T, H]`` in the
            compute dtype when ``return_hidden``; ``new_cache`` is the updated cache or None.

        Raises:
            ValueError: inconsistent shapes, or ``cache`` given without ``cache_index`` (or vice versa).
        """
        cfg = self.cfg
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {input_ids.shape}")
        b, t = input_ids.shape
        if positions.shape != (b, t):
            raise ValueError(f"positions must have shape {(b, t)} like input_ids; got {positions.shape}")
        if cache is None:
            if cache_index is not None:
                raise ValueError("cache_index was given without a cache")
            if attention_mask.shape != (b, t):
                raise ValueError(
                    f"without a cache attention_mask must have shape {(b, t)}; got {attention_mask.shape}"
                )
            if segment_ids is not None and segment_ids.shape != (b, t):
                raise ValueError(f"segment_ids must have shape {(b, t)} like input_ids; got {segment_ids.shape}")
            if segment_cols is not None and (segment_ids is None or segment_cols.ndim != 3
                                             or segment_cols.shape[0] != b):
                raise ValueError(f"segment_cols must be [{b}, segments, length] and come with segment_ids; got "
                                 f"{getattr(segment_cols, 'shape', None)}")
            s = t
            q_slots = jnp.arange(t, dtype=jnp.int32)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids (packed rows) are not supported with a KV cache")
            if cache_index is None:
                raise ValueError("cache_index is required when a cache is passed")
            n = cfg.num_hidden_layers
            s = cache.k[0].shape[2] if cache.k and cache.k[0].ndim == 4 else -1
            expected = (b, cfg.num_key_value_heads, s, cfg.head_dim)
            shapes = {tuple(a.shape) for a in (*cache.k, *cache.v)}
            if len(cache.k) != n or len(cache.v) != n or shapes != {expected}:
                raise ValueError(
                    f"cache k/v must be {n} arrays each of shape [batch, kv_heads, max_len, head_dim] = {expected}; "
                    f"got {len(cache.k)} / {len(cache.v)} arrays of shapes {sorted(shapes)}"
                )
            if attention_mask.shape != (b, s):
                raise ValueError(
                    f"with a cache attention_mask must have shape [batch, max_len] = {(b, s)}; "
                    f"got {attention_mask.shape}"
                )
            if isinstance(cache_index, (int, np.integer)) and not 0 <= cache_index <= s - t:
                raise ValueError(f"cache_index {cache_index} out of range: need 0 <= cache_index <= {s - t}")
            cache_index = jnp.asarray(cache_index, jnp.int32)
            if cache_index.shape not in ((), (b,)):
                raise ValueError(f"cache_index must be a scalar or [batch] = ({b},); got shape {cache_index.shape}")
            q_slots = cache_index[..., None] + jnp.arange(t, dtype=jnp.int32)  # [T] or [B, T]
        if segment_cols is not None:  # packed rows, attended per segment in a padded layout (no dense mask)
            mask = segment_layout(segment_cols, t)
        else:
            k_slots = jnp.arange(s, dtype=jnp.int32)
            causal = k_slots <= q_slots[..., None]  # [T, S] or [B, T, S]
            mask = (causal if causal.ndim == 3 else causal[None]) & (attention_mask != 0)[:, None, :]
            if segment_ids is not None:  # packed rows: attention stays inside each sequence
                mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])

        cos, sin = rope_cos_sin(positions, np.asarray(self.inv_freq, np.float32))
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        constrain = (lambda a: a) if activation_sharding is None else (
            lambda a: jax.lax.with_sharding_constraint(a, activation_sharding))
        x = constrain(x)
        new_k, new_v = (None, None) if cache is None else (list(cache.k), list(cache.v))
        # Remat only pays off when a backward pass follows; cached decoding never differentiates.
        use_remat = self.remat if remat is None else bool(remat)
        if isinstance(self.layers, StackedBlocks):  # the training layout: one scan over the stacked weights
            if cache is not None:
                raise ValueError("a decoder in the scan layout (layers stacked for training) does not decode with "
                                 "a KV cache; decode with the per-layer weights (jaxrl.models.scan_layout."
                                 "unstack_layers)")
            block_graphdef, stacked = nnx.split(self.layers.block)
            x = _scan_blocks(block_graphdef, stacked, x, cos, sin, mask, constrain, remat=use_remat,
                             policy=self.remat_policy)
            scanned = x
        else:
            scanned = self._remat_scan(x, cos, sin, mask, constrain) if (use_remat and cache is None) else None
        if scanned is not None:
            x = scanned
        else:
            call = _remat_blocks[self.remat_policy] if (use_remat and cache is None) else _call_block
            for i, block in enumerate(self.layers):
                if cache is None:
                    x, _, _ = call(block, x, cos, sin, mask, None, None, cache_index)
                else:  # each block writes its keys/values into its layer's cache (in place) and attends over it
                    x, new_k[i], new_v[i] = call(block, x, cos, sin, mask, new_k[i], new_v[i], cache_index)
                x = constrain(x)
        x = self.norm(x)
        new_cache = None if cache is None else KVCache(tuple(new_k), tuple(new_v))
        if return_hidden:
            return x, new_cache
        return self.logits(x), new_cache

    def prefill_packed(self, input_ids: jax.Array, positions: jax.Array, segment_cols: jax.Array, cache: KVCache,
                       rows: jax.Array, slots: jax.Array) -> KVCache:
        """Fill a KV cache from prompts packed into rows: the keys/values of token ``(k, w)`` of the packed rows go
        to cache row ``rows[k, w]``, slot ``slots[k, w]``.

        Several prompts share a packed row (``segment_cols`` says where each prompt's tokens sit; attention runs per
        prompt, :func:`segment_gqa_attention`), so the projections scale with the prompts' real tokens, not with
        batch x the longest prompt. A forward without a cache computes each layer's keys/values, which are scattered
        into the cache; nothing after the last block's attention input is used (no final norm, no logits). The
        keys/values equal those of :meth:`__call__` on the left-padded prompts with the cache (up to float32
        summation order): a token's keys/values depend only on the tokens before it in its own prompt.

        Args:
            input_ids: ``[K, W]`` int token ids of ``K`` packed rows of ``W`` tokens.
            positions: ``[K, W]`` int RoPE positions, restarting at 0 for each prompt.
            segment_cols: ``[K, S, L]`` int32: the column of token ``p`` of the row's ``s``-th prompt, ``>= W`` where
                there is none (:class:`SegmentLayout`).
            cache: :class:`KVCache` (``L`` x ``[B, nKV, S, D]``) to write into (in a jitted caller, usually zeros).
            rows, slots: ``[K, W]`` int32 destination of each token; a slot ``>= S`` (padding) is dropped.

        Returns:
            the cache with every non-dropped token's keys/values written (post-RoPE, in the cache dtype).

        Raises:
            ValueError: shapes differ from ``[K, W]`` / ``[K, S, L]``, or the decoder holds its layers in the scan
                layout.
        """
        k_rows, width = input_ids.shape
        for name, arr in (("positions", positions), ("rows", rows), ("slots", slots)):
            if arr.shape != (k_rows, width):
                raise ValueError(f"prefill_packed: {name} must have shape {(k_rows, width)} like input_ids; "
                                 f"got {arr.shape}")
        if segment_cols.ndim != 3 or segment_cols.shape[0] != k_rows:
            raise ValueError(f"prefill_packed: segment_cols must be [{k_rows}, prompts, length]; got "
                             f"{segment_cols.shape}")
        if isinstance(self.layers, StackedBlocks):
            raise ValueError("prefill_packed needs the per-layer weights (jaxrl.models.scan_layout.unstack_layers); "
                             "the decoder holds the scan layout")
        layout = segment_layout(segment_cols, width)
        cos, sin = rope_cos_sin(positions, np.asarray(self.inv_freq, np.float32))
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        new_k, new_v = list(cache.k), list(cache.v)
        for i, block in enumerate(self.layers):
            x, k, v = _call_block(block, x, cos, sin, layout, None, None, None)
            new_k[i] = new_k[i].at[rows, :, slots].set(k.astype(new_k[i].dtype), mode="drop")  # cells [K, W, nKV, D]
            new_v[i] = new_v[i].at[rows, :, slots].set(v.astype(new_v[i].dtype), mode="drop")
        return KVCache(tuple(new_k), tuple(new_v))

    def _remat_scan(self, x, cos, sin, mask, constrain):
        """The blocks as one ``lax.scan`` over their weights stacked along a new leading axis, each step
        rematerialised (``jax.checkpoint``): the training forward when ``remat`` is on.

        Why a scan: XLA (seen on CPU, jax 0.10) schedules the recomputation of every ``nnx.remat`` block of an
        unrolled layer loop before the backward pass starts, so each layer's attention scores and MLP activations
        are alive at once and remat saves nothing (SmolLM2-135M, one packed row of 2048 tokens: 15.2 GB of
        temporaries with per-block remat, 15.6 GB without, 1.5 GB as a rematerialised scan). Inside a scan the
        backward of step ``i`` can only recompute step ``i``. MaxText scans its layers for the same reason
        (``scan_layers``). Here the stacked weights are a copy made inside the program (their gradient flows back
        through it and is sliced into per-layer arrays); a trained role avoids both copies by holding its weights
        stacked (:class:`StackedBlocks`, :mod:`jaxrl.models.scan_layout`), so this path serves per-layer models
        (e.g. with LoRA adapters on every layer). The step compiles once, not ``L`` times.

        Returns:
          the residual stream after the last block ``[B, T, H]``, or None when the blocks differ in structure
          (e.g. LoRA adapters on some layers only): the caller then runs the layer loop.
        """
        splits = [nnx.split(block) for block in self.layers]
        graphdef = splits[0][0]
        if len(splits) < 2 or any(g != graphdef for g, _ in splits[1:]):
            return None
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(state for _, state in splits))
        return _scan_blocks(graphdef, stacked, x, cos, sin, mask, constrain, remat=True, policy=self.remat_policy)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head: final-normed hidden states ``[B, T, H]`` -> float32 logits ``[B, T, V]``.

        Callers that need only some positions (the trainer scores response tokens only) slice the hidden states
        first and skip the ``[B, P, V]`` prompt-position logits.
        """
        x = hidden.astype(self.dtype)
        md = self.matmul_dtype or self.dtype  # operands in the compute (or matmul) dtype, accumulated in float32
        if self.lm_head is None:  # tied: the embedding [V, H] read as the head
            return project(x, self.embed_tokens[...], jnp.float32, md, transposed=True)
        return project(x, self.lm_head[...], jnp.float32, md)
