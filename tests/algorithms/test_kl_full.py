"""Exact full-vocabulary KL, straight-through "+" KL estimators, KL controllers and the in-reward
KL penalty, against numpy references and hand computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    KL_PENALTIES,
    KL_PENALTIES_STRAIGHT_THROUGH,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_full,
    kl_penalty,
)


def np_log_softmax(x):
    x = x.astype(np.float64)
    m = np.max(np.where(np.isfinite(x), x, -np.inf), -1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def np_kl_full(logp, ref):
    p = np.exp(logp)
    support = p > 0
    terms = np.where(support, p * (np.where(support, logp, 0.0) - np.where(support, ref, 0.0)), 0.0)
    return terms.sum(-1)


def random_dists(seed, shape=(3, 4, 29), scale=2.0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=shape) * scale
    z_ref = z + rng.normal(size=shape)
    return z.astype(np.float32), z_ref.astype(np.float32)


# ----------------------------------------------------------------------------- full KL


def test_kl_full_matches_numpy_on_random_distributions():
    z, z_ref = random_dists(0)
    z[0, 0, :5] = -np.inf  # banned tokens under the policy: p = 0, contributes nothing
    logp, ref = np_log_softmax(z), np_log_softmax(z_ref)
    out = jax.jit(kl_full)(logp.astype(np.float32), ref.astype(np.float32))
    assert out.shape == (3, 4) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np_kl_full(logp, ref), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(out) > 0)
    same = kl_full(logp.astype(np.float32), logp.astype(np.float32))
    np.testing.assert_allclose(np.asarray(same), 0.0, atol=1e-6)
    # a token the policy can emit but the reference cannot: infinite KL
    ref_inf = ref.copy()
    ref_inf[1, 1, 3] = -np.inf
    assert float(kl_full(logp.astype(np.float32), ref_inf.astype(np.float32))[1, 1]) == np.inf


def test_kl_full_gradient_wrt_logits():
    # d KL(softmax(z) || q) / d z_j = p_j * (log p_j - log q_j - KL)
    z, z_ref = random_dists(1, shape=(2, 3, 11))
    z[0, 1, 2] = -np.inf
    ref = np_log_softmax(z_ref).astype(np.float32)

    def loss(zz):
        return kl_full(jax.nn.log_softmax(zz, axis=-1), ref).sum()

    g = np.asarray(jax.jit(jax.grad(loss))(z))
    logp = np_log_softmax(z)
    p = np.exp(logp)
    kl = np_kl_full(logp, ref)[..., None]
    expected = np.where(p > 0, p * (np.where(p > 0, logp, 0) - ref - kl), 0.0)
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-6)
    assert np.all(np.isfinite(g))


def test_kl_full_bf16_and_dispatch_and_errors():
    z, z_ref = random_dists(2)
    logp = jnp.asarray(np_log_softmax(z), jnp.bfloat16)
    ref = jnp.asarray(np_log_softmax(z_ref), jnp.bfloat16)
    out = kl_full(logp, ref)
    assert out.dtype == jnp.float32
    ref_np = np_kl_full(np.asarray(logp.astype(jnp.float32), np.float64), np.asarray(ref.astype(jnp.float32), np.float64))
    np.testing.assert_allclose(np.asarray(out), ref_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kl_penalty(logp, ref, "full")), np.asarray(out))

    x2 = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'full'.*\[batch, resp_len, vocab\]"):
        kl_penalty(x2, x2, "full")
    with pytest.raises(ValueError, match="must have the same shape"):
        kl_full(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 5), np.float32))
    with pytest.raises(ValueError, match="floating point"):
        kl_full(np.zeros((2, 3, 4), np.int32), np.zeros((2, 3, 4), np.int32))


# ----------------------------------------------------------------------------- "+" straight-through


def np_base(lp, ref, name):
    """Schulman's k1 / |d| / k2 / k3 (with verl's clamps) on d = log pi - log pi_ref."""
    d = lp.astype(np.float64) - ref
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return np.abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d**2
    x = np.clip(-d, -20, 20)  # log(pi_ref / pi)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("name", KL_PENALTIES)
def test_plus_variant_has_base_value_and_k2_gradient(name):
    rng = np.random.default_rng(3)
    lp = (-np.abs(rng.normal(size=(4, 6))) * 2).astype(np.float32)
    ref = (-np.abs(rng.normal(size=(4, 6))) * 2).astype(np.float32)
    plus = name + "+"
    assert plus in KL_PENALTIES_STRAIGHT_THROUGH

    value = jax.jit(kl_penalty, static_argnames="kl_penalty")(lp, ref, kl_penalty=plus)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(kl_penalty(lp, ref, name)))
    np.testing.assert_allclose(np.asarray(value), np_base(lp, ref, name), rtol=1e-5, atol=1e-6)

    grad_plus = jax.jit(jax.grad(lambda x: kl_penalty(x, ref, plus).sum()))(lp)
    np.testing.assert_allclose(np.asarray(grad_plus), lp - ref, rtol=1e-5, atol=1e-6)  # d/dlp 0.5 d^2 = d
    grad_base = jax.grad(lambda x: kl_penalty(x, ref, name).sum())(lp)
    if name not in ("mse", "k2"):  # the base estimators' own gradients differ from k2's
        assert float(jnp.abs(grad_base - grad_plus).max()) > 1e-3


def test_unknown_kl_name_lists_all_options():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k4'.*'k3\+'.*'full'"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="unknown kl_penalty 'full\\+'"):
        kl_penalty(x, x, "full+")


# ----------------------------------------------------------------------------- controllers


def test_adaptive_controller_update_sequence_by_hand():
    ctrl = get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert ctrl == AdaptiveKLController(value=0.1, target=6.0, horizon=10000.0)
    # step 1: kl 9 -> err clip(9/6 - 1 = 0.5) = 0.2; mult = 1 + 0.2 * 500 / 10000 = 1.01
    # step 2: kl 5.4 -> err -0.1; mult = 1 - 0.1 * 1000 / 10000 = 0.99
    # step 3: kl 0 -> err clip(-1) = -0.2; mult = 1 - 0.2 * 250 / 10000 = 0.995
    # step 4: kl 6 -> err 0; unchanged
    expected = 0.1
    for kl, n, mult in ((9.0, 500, 1.01), (5.4, 1000, 0.99), (0.0, 250, 0.995), (6.0, 64, 1.0)):
        ctrl = ctrl.update(kl, n)
        expected *= mult
        assert isinstance(ctrl.value, float)
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    assert ctrl.value == pytest.approx(0.1 * 1.01 * 0.99 * 0.995, rel=1e-12)
    assert (ctrl.target, ctrl.horizon) == (6.0, 10000.0)
    # checkpoint round trip
    assert AdaptiveKLController(**ctrl._asdict()) == ctrl


def test_adaptive_controller_under_jit_and_errors():
    ctrl = AdaptiveKLController(value=0.2, target=0.5, horizon=100.0)

    @jax.jit
    def step(c, kl):
        return c.update(kl, 10)

    out = step(ctrl, jnp.float32(0.6))  # err 0.2 -> mult 1.02
    np.testing.assert_allclose(float(out.value), 0.2 * 1.02, rtol=1e-6)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        ctrl.update(float("nan"), 10)
    with pytest.raises(ValueError, match="n_steps must be >= 0"):
        ctrl.update(0.1, -1)
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
        AdaptiveKLController(value=0.2, target=0.0, horizon=1.0).update(0.1, 1)


def test_fixed_controller_and_factory_errors():
    ctrl = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController) and ctrl.update(123.0, 1000) == ctrl == FixedKLController(0.05)
    with pytest.raises(ValueError, match=r"unknown kl_ctrl type 'pid'.*'fixed', 'adaptive'"):
        get_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizon > 0"):
        get_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="target_kl > 0"):
        get_kl_controller("adaptive", 0.1, horizon=10)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        get_kl_controller("fixed", -1.0)


# ----------------------------------------------------------------------------- in-reward KL penalty


@pytest.mark.parametrize("name", ["kl", "low_var_kl", "k3+"])
def test_apply_kl_penalty_matches_numpy(name):
    rng = np.random.default_rng(4)
    b, r = 5, 8
    scores = np.zeros((b, r), np.float32)
    lengths = np.array([8, 3, 0, 5, 1])
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    mask[0, 2:4] = 0.0  # multi-turn gap
    for i in range(b):
        if lengths[i]:
            scores[i, lengths[i] - 1] = rng.normal()
    old = (-np.abs(rng.normal(size=(b, r)))).astype(np.float32)
    ref = (old + rng.normal(scale=0.5, size=(b, r))).astype(np.float32)
    old_nan = old.copy()
    old_nan[mask == 0] = np.nan  # padding may hold garbage: must not leak

    rewards, current_kl = jax.jit(apply_kl_penalty, static_argnames="kl_penalty")(
        scores, old_nan, ref, mask, 0.1, kl_penalty=name
    )
    kld = np_base(old, ref, name.rstrip("+")) * mask
    np.testing.assert_allclose(np.asarray(rewards), scores - 0.1 * kld, rtol=1e-5, atol=1e-6)
    per_seq = np.array([kld[i].sum() / mask[i].sum() if mask[i].sum() else 0.0 for i in range(b)])
    np.testing.assert_allclose(float(current_kl), per_seq.mean(), rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(rewards)))


def test_apply_kl_penalty_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="unknown kl_penalty 'full'"):
        apply_kl_penalty(x, x, x, x, 0.1, "full")
    with pytest.raises(ValueError, match="one shape"):
        apply_kl_penalty(x, x, x[:, :2], x, 0.1)
