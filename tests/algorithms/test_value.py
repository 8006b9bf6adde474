"""Clipped value loss and explained variance vs numpy references and hand-worked clipping cases."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl.algorithms import LOSS_AGG_MODES, compute_value_loss, explained_variance


def np_value_loss(vpreds, values, returns, mask, clip, mode):
    v, old, g, m = (x.astype(np.float64) for x in (vpreds, values, returns, mask))
    l1 = (v - g) ** 2
    l2 = (np.minimum(np.maximum(v, old - clip), old + clip) - g) ** 2
    loss = np.maximum(l1, l2) * m
    if mode == "token-mean":
        agg = loss.sum() / m.sum()
    else:
        per = loss.sum(-1)
        if mode == "seq-mean-token-mean":
            per = np.array([p / c if c else 0.0 for p, c in zip(per, m.sum(-1))])
        elif mode == "seq-mean-token-sum-norm":
            per = per / loss.shape[-1]
        agg = per.sum() / loss.shape[0]
    return 0.5 * agg, ((l2 > l1) * m).sum() / m.sum()


def test_value_loss_clipping_cases_by_hand():
    # old value 1.0, clip 0.5 -> allowed [0.5, 1.5]
    # t0: vpred 1.2 (inside), return 2 -> both errors 0.64 -> no clip
    # t1: vpred 3.0 (moved up too far), return 2 -> unclipped 1.0, clipped (1.5-2)^2=0.25 -> max 1.0, no clip
    # t2: vpred 3.0, return 4 -> unclipped 1.0, clipped (1.5-4)^2=6.25 -> clipped branch (pessimistic)
    # t3: vpred 0.0 (moved down too far), return -1 -> unclipped 1.0, clipped (0.5+1)^2=2.25 -> clipped
    vpreds = np.array([[1.2, 3.0, 3.0, 0.0]], np.float32)
    values = np.ones((1, 4), np.float32)
    returns = np.array([[2.0, 2.0, 4.0, -1.0]], np.float32)
    mask = np.ones((1, 4), np.float32)
    loss, m = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5, loss_agg_mode="token-mean")
    assert float(loss) == pytest.approx(0.5 * (0.64 + 1.0 + 6.25 + 2.25) / 4, rel=1e-6)
    assert float(m["vf_clipfrac"]) == pytest.approx(0.5)

    grad = jax.grad(lambda v: compute_value_loss(v, values, returns, mask, cliprange_value=0.5)[0])(vpreds)
    # clipped tokens (t2, t3) give no gradient to vpreds; t0, t1: d/dv 0.5 * (v - g)^2 / 4 = (v - g) / 4
    np.testing.assert_allclose(np.asarray(grad), [[(1.2 - 2.0) / 4, (3.0 - 2.0) / 4, 0.0, 0.0]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_numpy(mode):
    rng = np.random.default_rng(0)
    b, r = 6, 9
    values = rng.normal(size=(b, r)).astype(np.float32)
    vpreds = (values + rng.normal(scale=0.6, size=(b, r))).astype(np.float32)
    returns = (values + rng.normal(size=(b, r))).astype(np.float32)
    lengths = rng.integers(1, r + 1, size=b)
    lengths[3] = 0
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    vpreds[mask == 0] = np.nan  # padding must not leak
    loss, m = jax.jit(compute_value_loss, static_argnames="loss_agg_mode")(
        vpreds, values, returns, mask, cliprange_value=0.3, loss_agg_mode=mode
    )
    ref_loss, ref_frac = np_value_loss(np.nan_to_num(vpreds), values, returns, mask, 0.3, mode)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["vf_clipfrac"]), ref_frac, rtol=1e-6)
    assert 0.0 < ref_frac < 1.0


def test_value_loss_microbatch_normalisers_and_errors():
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(3)]
    mask = np.ones((4, 5), np.float32)
    mask[1, 3:] = 0
    full = compute_value_loss(*x, mask, cliprange_value=0.2)[0]
    parts = [
        compute_value_loss(*(a[i : i + 2] for a in x), mask[i : i + 2], cliprange_value=0.2, num_tokens=mask.sum())[0]
        for i in (0, 2)
    ]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        compute_value_loss(*x, mask, cliprange_value=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        compute_value_loss(x[0], x[1][:, :-1], x[2], mask)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_value_loss(*x, mask, loss_agg_mode="mean")


def test_explained_variance():
    rng = np.random.default_rng(2)
    returns = rng.normal(size=(5, 7)).astype(np.float32) * 2
    values = (returns + rng.normal(scale=0.7, size=(5, 7))).astype(np.float32)
    mask = (rng.random((5, 7)) > 0.3).astype(np.float32)
    values[mask == 0] = 1e6  # ignored
    ev = float(jax.jit(explained_variance)(values, returns, mask))
    g, v = returns[mask > 0].astype(np.float64), values[mask > 0].astype(np.float64)
    expected = 1 - np.var(g - v, ddof=1) / (np.var(g, ddof=1) + 1e-5)
    np.testing.assert_allclose(ev, expected, rtol=1e-5)
    assert 0.5 < ev < 1.0
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0, abs=1e-6)
    const = np.full_like(returns, float(g.mean()))
    assert float(explained_variance(const, returns, mask)) == pytest.approx(0.0, abs=1e-4)
    one = np.zeros_like(mask)
    one[0, 0] = 1
    assert np.isnan(float(explained_variance(values, returns, one)))
    with pytest.raises(ValueError, match="one shape"):
        explained_variance(values, returns[:, :-1], mask)
