"""``causal_gqa_attention`` (query blocks over key prefixes) against the plain ``gqa_attention``, values and gradients.

The decoder's no-cache path (training, log-prob and value forwards, prefill-free scoring) uses the blocked form;
these tests pin it to the reference on the masks that path builds: causal, left padding, and packed rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.decoder import (
    DECODE_REDUCE_MIN_ROWS,
    cached_gqa_attention,
    causal_gqa_attention,
    causal_query_block,
    decode_attention_form,
    gqa_attention,
)


def _inputs(b, t, nh=6, nkv=2, d=8, seed=0, dtype=jnp.float32):
    r = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(r.randn(b, t, n, d), dtype) for n in (nh, nkv, nkv))
    return q, k, v


def _masks(b, t, seed=0):
    """The three causal masks the decoder builds: plain, left-padded rows, packed rows (segments + end padding)."""
    r = np.random.RandomState(seed)
    causal = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    pad = np.zeros((b, t), bool)
    for i in range(b):
        pad[i, r.randint(0, t // 2):] = True  # left padding of random width
    left = causal & pad[:, None, :]
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        cuts = np.sort(r.choice(np.arange(1, t - 2), 2, replace=False))
        seg[i, :cuts[0]], seg[i, cuts[0]:cuts[1]], seg[i, cuts[1]:t - 2] = 1, 2, 3  # 2 padding tokens at the end
    packed = causal & (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
    return {"causal": causal, "left_padded": left, "packed": packed}


def _visible(mask):
    return np.asarray(mask).any(-1)  # [B, T]: queries with at least one key


@pytest.mark.parametrize("t,block", [(37, 8), (37, 32), (64, 16), (20, 64), (96, None)])
@pytest.mark.parametrize("kind", ["causal", "left_padded", "packed"])
def test_blocked_equals_plain_attention(t, block, kind):
    q, k, v = _inputs(3, t, seed=t)
    mask = jnp.asarray(_masks(3, t, seed=t)[kind])
    ref = np.asarray(gqa_attention(q, k, v, mask))
    out = np.asarray(causal_gqa_attention(q, k, v, mask, block))
    vis = _visible(mask)
    assert vis.any() and np.isfinite(out).all()
    np.testing.assert_allclose(out[vis], ref[vis], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["causal", "left_padded", "packed"])
def test_blocked_gradients_equal_plain(kind):
    """Gradients of a loss on the visible queries: equal, including the keys / values padding queries never read."""
    t = 45
    q, k, v = _inputs(2, t, seed=3)
    mask = jnp.asarray(_masks(2, t, seed=3)[kind])
    w = jnp.asarray(np.random.RandomState(4).randn(2, t, 6, 8), jnp.float32) * _visible(mask)[:, :, None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * w)

    g_ref = jax.grad(loss(gqa_attention), argnums=(0, 1, 2))(q, k, v)
    g_blk = jax.grad(loss(lambda *a: causal_gqa_attention(*a, block=8)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ref, g_blk, strict=True):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_blocked_skips_the_upper_triangle():
    """The program computes one score block per query block over its key prefix only: [B, nKV, G, block, hi]."""
    q, k, v = _inputs(1, 64)
    mask = jnp.asarray(_masks(1, 64)["causal"])
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: causal_gqa_attention(q, k, v, mask, 16))(q, k, v))
    for hi in (16, 32, 48, 64):
        assert f"f32[1,2,3,16,{hi}]" in jaxpr
    assert "f32[1,2,3,64,64]" not in jaxpr


def test_bf16_inputs_keep_their_dtype_and_stay_close():
    q, k, v = _inputs(2, 33, dtype=jnp.bfloat16)
    mask = jnp.asarray(_masks(2, 33)["left_padded"])
    out = causal_gqa_attention(q, k, v, mask, 16)
    assert out.dtype == jnp.bfloat16
    vis = _visible(mask)
    ref = np.asarray(gqa_attention(q, k, v, mask), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32)[vis], ref[vis], atol=2e-2)


def test_block_width_rule():
    assert [causal_query_block(t) for t in (1, 96, 512, 513, 1024, 2048)] == [32, 32, 32, 64, 64, 128]
    assert all(-(-t // causal_query_block(t)) <= 16 for t in range(1, 4097, 37))


def test_shape_mismatch_is_a_clear_error():
    q, k, v = _inputs(1, 8)
    with pytest.raises(ValueError, match="over the queries' 8 positions"):
        causal_gqa_attention(q, k[:, :6], v[:, :6], jnp.ones((1, 8, 6), bool))
    with pytest.raises(ValueError, match="must be a positive number of tokens; got 0"):
        causal_gqa_attention(q, k, v, jnp.ones((1, 8, 8), bool), block=0)


@pytest.mark.parametrize("b,t,s", [(3, 1, 23), (3, 1, 64), (3, 5, 40), (3, 16, 16),
                                   (DECODE_REDUCE_MIN_ROWS, 1, 23), (DECODE_REDUCE_MIN_ROWS + 3, 1, 64),
                                   (DECODE_REDUCE_MIN_ROWS + 1, 5, 40)])
def test_cached_attention_equals_plain(b, t, s):
    """The KV-cache form (keys/values ``[B, nKV, S, D]``, kv-head-major) equals gqa_attention on ``[B, S, nKV, D]``:
    one decode query (t=1: the matmul form below ``DECODE_REDUCE_MIN_ROWS`` rows, the product-reduce form from it)
    or a chunk of queries (prefill through the cache), left padding and a causal offset, a fully masked row finite;
    a kv-head/group mix-up would pair queries with the wrong keys."""
    nh, nkv, d = 6, 2, 8
    r = np.random.RandomState(b * 10000 + t * 100 + s)
    q = jnp.asarray(r.randn(b, t, nh, d), jnp.float32)
    k, v = (jnp.asarray(r.randn(b, s, nkv, d), jnp.float32) for _ in range(2))
    start = np.array([0, 3, s // 2] * b)[:b]  # left padding per row
    q_slot = s - t + np.arange(t)  # the queries sit at the last t slots
    slot = np.arange(s)[None, None, :]
    mask = (slot <= q_slot[None, :, None]) & (slot >= start[:, None, None])
    mask[2, 0] = False  # a query with no key at all
    mask = jnp.asarray(mask)
    ref = np.asarray(gqa_attention(q, k, v, mask))
    out = np.asarray(cached_gqa_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask))
    assert out.shape == (b, t, nh, d) and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_decode_form_is_chosen_by_rows_and_keeps_the_dtype():
    """One query per row: two batched matmuls below ``DECODE_REDUCE_MIN_ROWS`` rows, no matmul from it (products
    reduced over D and S); a bfloat16 query / cache stays bfloat16 out and close to the float32 result."""
    nh, nkv, d, s = 6, 2, 8, 16
    r = np.random.RandomState(7)

    def inputs(b, dtype=jnp.float32):
        q = jnp.asarray(r.randn(b, 1, nh, d), dtype)
        k, v = (jnp.asarray(r.randn(b, nkv, s, d), dtype) for _ in range(2))
        return q, k, v, jnp.ones((b, 1, s), bool)

    def dots(b):
        return str(jax.make_jaxpr(cached_gqa_attention)(*inputs(b))).count("dot_general")

    assert jax.default_backend() == "cpu"  # the suite runs on XLA:CPU, where the reduce form applies
    assert dots(DECODE_REDUCE_MIN_ROWS - 1) == 2 and dots(DECODE_REDUCE_MIN_ROWS) == 0
    q, k, v, mask = inputs(DECODE_REDUCE_MIN_ROWS, jnp.bfloat16)
    out = cached_gqa_attention(q, k, v, mask)
    ref = cached_gqa_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2)


def test_decode_reduce_form_is_for_xla_cpu_only():
    """The product-reduce decode form from ``DECODE_REDUCE_MIN_ROWS`` rows on CPU only: on an H200 it made the decode
    step 1.7x slower than the matmuls (bench/results/gpu_h200.md), so GPU and TPU keep the matmuls at any batch."""
    assert decode_attention_form(DECODE_REDUCE_MIN_ROWS, "cpu") == "reduce"
    assert decode_attention_form(DECODE_REDUCE_MIN_ROWS - 1, "cpu") == "matmul"
    for platform in ("gpu", "cuda", "rocm", "tpu"):
        assert decode_attention_form(96, platform) == "matmul"
