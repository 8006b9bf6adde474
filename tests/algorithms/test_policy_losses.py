"""GSPO, CISPO, Clip-Cov, KL-Cov, GPG policy losses and truncated IS weights vs numpy references."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    LOSS_AGG_MODES,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    get_policy_loss,
    registered_policy_losses,
    tis_weights,
)

NEW_LOSSES = ("gspo", "cispo", "clip_cov", "kl_cov", "gpg")
COMMON_KW = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "num_tokens", "num_seqs",
             "rollout_is_weights")


# ----------------------------------------------------------------------------- helpers


def make_inputs(seed=0, b=6, r=16, adv_scale=2.0):
    rng = np.random.default_rng(seed)
    old = (-np.abs(rng.normal(size=(b, r))) * 2.0).astype(np.float32)
    new = (old + rng.normal(scale=0.6, size=(b, r))).astype(np.float32)
    adv = (rng.normal(size=(b, r)) * adv_scale).astype(np.float32)
    lengths = rng.integers(2, r + 1, size=b)
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    if b > 4:
        mask[2] = 0.0  # zero-length response
        mask[4, 3:5] = 0.0  # a multi-turn gap
    return old, new, adv, mask


def np_agg(loss, mask, mode):
    loss, mask = loss.astype(np.float64) * mask, mask.astype(np.float64)
    if mode == "token-mean":
        return loss.sum() / max(mask.sum(), 1)
    per = loss.sum(-1)
    if mode == "seq-mean-token-mean":
        per = np.array([p / c if c else 0.0 for p, c in zip(per, mask.sum(-1))])
    elif mode == "seq-mean-token-sum-norm":
        per = per / loss.shape[-1]
    return per.sum() / loss.shape[0]


def tmean(x, mask):
    return float((x * mask).sum() / mask.sum())


def np_gspo(old, new, adv, mask, lo, hi):
    d = (new - old).astype(np.float64)
    lengths = np.maximum(mask.sum(-1), 1)
    s = np.exp(np.minimum((d * mask).sum(-1) / lengths, 10.0))[:, None] * np.ones_like(d)
    l1, l2 = -adv * s, -adv * np.clip(s, 1 - lo, 1 + hi)
    return np.maximum(l1, l2), {"pg_clipfrac": tmean(l2 > l1, mask), "ppo_kl": tmean(-d, mask), "pg_clipfrac_lower": 0.0}


def np_cispo(old, new, adv, mask, lo, hi):
    d = np.clip(new - old, -20, 20).astype(np.float64)
    r = np.exp(d)
    w = np.clip(r, 1 - lo, 1 + hi)
    return -w * adv * new, {"pg_clipfrac": tmean(w != r, mask), "ppo_kl": tmean(-d, mask), "pg_clipfrac_lower": 0.0}


def np_cov(adv, new, mask):
    valid = mask > 0
    a, lp = adv.astype(np.float64), new.astype(np.float64)
    return (a - a[valid].mean()) * (lp - lp[valid].mean())


def np_topk(score, eligible, k):
    """Flat indices of the k eligible entries with the largest score; ties to the lower index."""
    cands = [(score.flat[i], i) for i in range(score.size) if eligible.flat[i]]
    return [i for _, i in sorted(cands, key=lambda c: (-c[0], c[1]))[:k]]


def np_clip_cov(old, new, adv, mask, lo, hi, ratio=2e-4, lb=1.0, ub=5.0):
    d = np.clip(new - old, -20, 20).astype(np.float64)
    r = np.exp(d)
    l1, l2 = -adv * r, -adv * np.clip(r, 1 - lo, 1 + hi)
    cov = np_cov(adv, new, mask)
    eligible = (mask > 0) & ~(l2 > l1) & (cov > lb) & (cov < ub)
    k = max(int(ratio * mask.sum()), 1)
    corr = np.ones_like(d)
    corr.flat[np_topk(cov, eligible, k)] = 0.0
    return np.maximum(l1, l2) * corr, {"pg_clipfrac": tmean(corr == 0, mask), "ppo_kl": tmean(-d, mask),
                                       "pg_clipfrac_lower": 0.0}


def np_kl_cov(old, new, adv, mask, ratio=2e-4, coef=1.0):
    d = np.clip(new - old, -20, 20).astype(np.float64)
    l1 = -adv * np.exp(d)
    k = max(int(ratio * mask.sum()), 1)
    pen = np.zeros(d.shape, bool)
    pen.flat[np_topk(np_cov(adv, new, mask), mask > 0, k)] = True
    loss = np.where(pen, l1 + coef * np.abs(d), l1)
    return loss, {"pg_clipfrac": 0.0, "ppo_kl": tmean(-d, mask), "pg_clipfrac_lower": 0.0,
                  "ppo_kl_abs": tmean(np.abs(d), mask), "kl_cov_frac": tmean(pen, mask)}


def np_gpg(old, new, adv, mask):
    d = np.clip(new - old, -20, 20).astype(np.float64)
    return -new.astype(np.float64) * adv, {"pg_clipfrac": 0.0, "ppo_kl": tmean(-d, mask), "pg_clipfrac_lower": 0.0}


# ----------------------------------------------------------------------------- registry / signatures / metrics


def test_losses_registered_with_common_signature():
    assert {"vanilla", *NEW_LOSSES} <= set(registered_policy_losses())
    for name in ("vanilla", *NEW_LOSSES):
        params = inspect.signature(get_policy_loss(name)).parameters
        assert list(params)[:4] == ["old_log_prob", "log_prob", "advantages", "response_mask"], name
        assert set(COMMON_KW) <= set(params), (name, set(COMMON_KW) - set(params))


@pytest.mark.parametrize("name", ("vanilla", *NEW_LOSSES))
def test_every_loss_reports_the_vanilla_metric_keys(name):
    old, new, adv, mask = make_inputs(1)
    loss, metrics = get_policy_loss(name)(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.shape == () and np.isfinite(float(loss))
    assert {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"} <= set(metrics)
    for k, v in metrics.items():
        assert v.shape == () and v.dtype == jnp.float32 and np.isfinite(float(v)), (name, k)
    np.testing.assert_allclose(float(metrics["ppo_kl"]), tmean(np.clip(old - new, -20, 20), mask), rtol=1e-5)


# ----------------------------------------------------------------------------- value vs numpy


REFS = {
    "gspo": lambda o, n, a, m: np_gspo(o, n, a, m, 0.2, 0.28),
    "cispo": lambda o, n, a, m: np_cispo(o, n, a, m, 0.2, 0.28),
    "clip_cov": lambda o, n, a, m: np_clip_cov(o, n, a, m, 0.2, 0.28, ratio=0.05),
    "kl_cov": lambda o, n, a, m: np_kl_cov(o, n, a, m, ratio=0.05, coef=0.7),
    "gpg": lambda o, n, a, m: np_gpg(o, n, a, m),
}
OPTIONS = {"clip_cov": {"clip_cov_ratio": 0.05}, "kl_cov": {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.7}}


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_loss_matches_numpy_all_modes(name):
    old, new, adv, mask = make_inputs(2)
    per_token, ref_m = REFS[name](old, new, adv, mask)
    fn = jax.jit(get_policy_loss(name), static_argnames="loss_agg_mode")
    for mode in LOSS_AGG_MODES:
        loss, m = fn(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode,
                     **OPTIONS.get(name, {}))
        ref_mode = "seq-mean-token-mean" if name == "gspo" else mode  # GSPO always aggregates per sequence
        np.testing.assert_allclose(float(loss), np_agg(per_token, mask, ref_mode), rtol=2e-5, atol=1e-6,
                                   err_msg=f"{name} {mode}")
    for k, v in ref_m.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}")
    if name in ("gspo", "cispo", "clip_cov"):  # the clip / selection branch is exercised
        assert ref_m["pg_clipfrac"] > 0.0
    if name == "kl_cov":
        assert ref_m["kl_cov_frac"] > 0.0


def test_gspo_ignores_loss_agg_mode_but_validates_it():
    old, new, adv, mask = make_inputs(3)
    a = compute_policy_loss_gspo(old, new, adv, mask, loss_agg_mode="token-mean")[0]
    b = compute_policy_loss_gspo(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum")[0]
    assert float(a) == float(b)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss_gspo(old, new, adv, mask, loss_agg_mode="sum")


# ----------------------------------------------------------------------------- gradients


def _grad(name, old, new, adv, mask, **kw):
    fn = get_policy_loss(name)
    return np.asarray(jax.jit(jax.grad(lambda lp: fn(old, lp, adv, mask, **kw)[0]))(new))


def test_gspo_gradient_is_sequence_ratio_times_token_score():
    old, new, adv, mask = make_inputs(4)
    lo, hi = 0.2, 0.28
    g = _grad("gspo", old, new, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi)
    lengths = mask.sum(-1)
    s = np.exp(((new - old) * mask).sum(-1) / np.maximum(lengths, 1))
    b = old.shape[0]
    n_clipped = 0
    for i in range(b):
        for t in range(old.shape[1]):
            if mask[i, t] == 0:
                assert g[i, t] == 0.0
                continue
            a = adv[i, t]
            clipped = (a > 0 and s[i] > 1 + hi) or (a < 0 and s[i] < 1 - lo)
            n_clipped += clipped
            expected = 0.0 if clipped else -a * s[i] / (lengths[i] * b)
            np.testing.assert_allclose(g[i, t], expected, rtol=1e-4, atol=1e-7)
    assert 0 < n_clipped < mask.sum()  # both branches exercised


def test_cispo_gradient_keeps_clipped_tokens_with_bounded_weight():
    old, new, adv, mask = make_inputs(5)
    g = _grad("cispo", old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    w = np.clip(np.exp(np.clip(new - old, -20, 20)), 0.8, 1.28)
    np.testing.assert_allclose(g, -w * adv * mask / mask.sum(), rtol=1e-5, atol=1e-8)
    # unlike PPO, clipped tokens still get a gradient
    assert np.all(g[(mask > 0) & (w != np.exp(new - old)) & (adv != 0)] != 0.0)


def test_gpg_gradient_is_minus_advantage():
    old, new, adv, mask = make_inputs(6)
    g = _grad("gpg", old, new, adv, mask, loss_agg_mode="seq-mean-token-sum")
    np.testing.assert_allclose(g, -adv * mask / old.shape[0], rtol=1e-6)


def test_kl_cov_gradient_adds_sign_penalty_on_selected_tokens():
    old, new, adv, mask = make_inputs(7)
    g = _grad("kl_cov", old, new, adv, mask, kl_cov_ratio=0.1, ppo_kl_coef=0.5)
    _, ref_m = np_kl_cov(old, new, adv, mask, ratio=0.1)
    k = max(int(0.1 * mask.sum()), 1)
    pen = np.zeros(old.shape, bool)
    pen.flat[np_topk(np_cov(adv, new, mask), mask > 0, k)] = True
    d = new - old
    expected = (-adv * np.exp(d) + np.where(pen, 0.5 * np.sign(d), 0.0)) * mask / mask.sum()
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    assert pen.sum() == k == round(ref_m["kl_cov_frac"] * mask.sum())


# ----------------------------------------------------------------------------- Clip-Cov selection


def _cut_set(grad, mask):
    return (mask > 0) & (grad == 0.0)


def test_clip_cov_selection_deterministic_and_random():
    old, new, adv, mask = make_inputs(8)
    old = new.copy()  # ratio 1: no PPO clipping, so every valid token with A != 0 has a gradient unless cut
    wide = dict(clip_cov_lb=-1e9, clip_cov_ub=1e9, clip_cov_ratio=0.25)
    n_valid = int(mask.sum())
    k = int(0.25 * n_valid)

    det = _cut_set(_grad("clip_cov", old, new, adv, mask, **wide), mask)
    expected = np.zeros(mask.shape, bool)
    expected.flat[np_topk(np_cov(adv, new, mask), mask > 0, k)] = True
    np.testing.assert_array_equal(det, expected)  # key=None: the top-covariance candidates

    key = jax.random.key(0)
    r1 = _cut_set(_grad("clip_cov", old, new, adv, mask, key=key, **wide), mask)
    r1b = _cut_set(_grad("clip_cov", old, new, adv, mask, key=key, **wide), mask)
    r2 = _cut_set(_grad("clip_cov", old, new, adv, mask, key=jax.random.key(1), **wide), mask)
    np.testing.assert_array_equal(r1, r1b)  # reproducible from the key
    assert r1.sum() == r2.sum() == k
    assert not np.array_equal(r1, r2) and not np.array_equal(r1, det)
    _, m = compute_policy_loss_clip_cov(old, new, adv, mask, key=key, **wide)
    np.testing.assert_allclose(float(m["pg_clipfrac"]), k / n_valid, rtol=1e-6)


def test_clip_cov_band_and_ppo_clipped_tokens_are_never_cut():
    old, new, adv, mask = make_inputs(9)
    lo = hi = 0.2
    grad = _grad("clip_cov", old, new, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi, clip_cov_ratio=0.5,
                 key=jax.random.key(3))
    r = np.exp(new - old)
    ppo_clipped = (-adv * np.clip(r, 1 - lo, 1 + hi)) > (-adv * r)
    cov = np_cov(adv, new, mask)
    cut = (mask > 0) & (grad == 0.0) & ~ppo_clipped
    assert cut.sum() > 0
    assert np.all((cov[cut] > 1.0) & (cov[cut] < 5.0))
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        compute_policy_loss_clip_cov(old, new, adv, mask, clip_cov_ratio=0.0)


def test_selection_count_is_exact_for_integer_products():
    # int(0.53 * 100) == 53, while float32(0.53) * 100 floors to 52 without care
    old, new, adv, mask = make_inputs(10, b=1, r=100)
    mask = np.ones_like(mask)
    _, m = compute_policy_loss_kl_cov(old, new, adv, mask, kl_cov_ratio=0.53)
    np.testing.assert_allclose(float(m["kl_cov_frac"]), 0.53, rtol=1e-6)
    _, m = compute_policy_loss_kl_cov(old, new, adv, mask, kl_cov_ratio=1e-4)  # at least one token
    np.testing.assert_allclose(float(m["kl_cov_frac"]), 0.01, rtol=1e-6)
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        compute_policy_loss_kl_cov(old, new, adv, mask, kl_cov_ratio=-1.0)


# ----------------------------------------------------------------------------- rollout IS weights / TIS


def test_tis_weights_match_numpy_and_are_capped():
    rng = np.random.default_rng(11)
    old = (-np.abs(rng.normal(size=(3, 9)))).astype(np.float32)
    rollout = (old + rng.normal(scale=1.0, size=(3, 9))).astype(np.float32)
    rollout[0, 0] = old[0, 0] + 50.0  # ratio e^-50 -> clamped log-ratio, tiny but finite weight
    w = jax.jit(tis_weights)(old, rollout, 2.0)
    ref = np.minimum(np.exp(np.clip(old.astype(np.float64) - rollout, -20, 20)), 2.0)
    np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-5, atol=1e-12)
    assert w.dtype == jnp.float32 and float(w.max()) == 2.0 and float(w.min()) > 0
    g = jax.grad(lambda o: tis_weights(o, rollout, 2.0).sum())(old)
    assert np.all(np.asarray(g) == 0.0)  # stop-gradient
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, rollout, 0.0)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        tis_weights(old, rollout[:, :-1], 2.0)


@pytest.mark.parametrize("name", ("vanilla", *NEW_LOSSES))
def test_rollout_is_weights_scale_token_losses(name):
    old, new, adv, mask = make_inputs(12)
    rng = np.random.default_rng(12)
    w = rng.uniform(0.2, 2.0, size=old.shape).astype(np.float32)
    fn = get_policy_loss(name)
    kw = dict(loss_agg_mode="seq-mean-token-sum", clip_ratio_high=0.28, **OPTIONS.get(name, {}))
    loss_w, _ = fn(old, new, adv, mask, rollout_is_weights=w, **kw)
    if name == "vanilla":
        ones_loss = fn(old, new, adv, mask, rollout_is_weights=np.ones_like(w), **kw)[0]
        np.testing.assert_allclose(float(ones_loss), float(fn(old, new, adv, mask, **kw)[0]), rtol=1e-6)
        assert abs(float(loss_w) - float(ones_loss)) > 1e-4
    else:
        per_token, _ = REFS[name](old, new, adv, mask)
        mode = "seq-mean-token-mean" if name == "gspo" else "seq-mean-token-sum"
        np.testing.assert_allclose(float(loss_w), np_agg(per_token * w, mask, mode), rtol=2e-5, atol=1e-6)
    # weights are constants: d loss / d w == 0, and the log-prob gradient is scaled token-wise
    gw = jax.grad(lambda ww: fn(old, new, adv, mask, rollout_is_weights=ww, **kw)[0])(w)
    assert np.all(np.asarray(gw) == 0.0)
    g1 = jax.grad(lambda lp: fn(old, lp, adv, mask, **kw)[0])(new)
    gw_lp = jax.grad(lambda lp: fn(old, lp, adv, mask, rollout_is_weights=w, **kw)[0])(new)
    if name not in ("clip_cov", "kl_cov"):  # (their token selection does not depend on w, but keep it simple)
        np.testing.assert_allclose(np.asarray(gw_lp), np.asarray(g1) * w, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="one shape"):
        fn(old, new, adv, mask, rollout_is_weights=w[:, :-1])
