"""KL estimators, loss aggregation, PPO policy loss, entropy and log-probs vs numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss_vanilla,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    log_probs_from_logits,
    registered_policy_losses,
)

# Numerical checks go through jax.jit: one compile per test instead of one per eager op (fast on a
# shared CPU). Input validation is checked on eager calls, where it runs.
kl_j = jax.jit(kl_penalty, static_argnames="kl_penalty")
agg_j = jax.jit(agg_loss, static_argnames="loss_agg_mode")
pg_j = jax.jit(compute_policy_loss_vanilla, static_argnames="loss_agg_mode")
entropy_j = jax.jit(entropy_from_logits)
logprob_j = jax.jit(log_probs_from_logits)

# ----------------------------------------------------------------------------- helpers


def rand_logprobs(rng, shape, scale=1.0):
    return (-np.abs(rng.normal(size=shape)) * scale).astype(np.float32)


def rand_mask(rng, b, r, *, empty_rows=()):
    lengths = rng.integers(1, r + 1, size=b)
    for i in empty_rows:
        lengths[i] = 0
    return (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)


# ----------------------------------------------------------------------------- KL


def np_kl(lp, ref, name):
    lp, ref = lp.astype(np.float64), ref.astype(np.float64)
    d = lp - ref
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return np.abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d**2
    x = np.clip(ref - lp, -20, 20)  # log(pi_ref / pi)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators_match_numpy(name):
    rng = np.random.default_rng(1)
    lp = rand_logprobs(rng, (5, 7), scale=3.0)
    ref = rand_logprobs(rng, (5, 7), scale=3.0)
    lp[0, 0], ref[0, 0] = -30.0, -0.1  # k3: exp(x) - x - 1 is large -> clamped at 10
    lp[0, 1], ref[0, 1] = -0.1, -60.0  # k3: log-ratio clamped at -20 (exp(-20) + 19 -> 10)
    out = kl_j(lp, ref, kl_penalty=name)
    assert out.shape == lp.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np_kl(lp, ref, name), rtol=1e-5, atol=1e-6)
    if name in ("low_var_kl", "k3"):
        assert float(out[0, 0]) == 10.0
        assert float(out[0, 1]) == 10.0
        big = kl_j(np.array([0.0, -1e4, 0.0], np.float32), np.array([-1e4, 0.0, -np.inf], np.float32), kl_penalty=name)
        np.testing.assert_array_equal(np.asarray(big), [10.0, 10.0, 10.0])  # finite, never inf/NaN
        assert np.all(np.asarray(out) >= 0)


def test_kl_invalid_name_lists_valid():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'full'.*'low_var_kl'.*'k3'"):
        kl_penalty(x, x, "full")


def np_k3_is(lp, ref, old):
    """DeepSeek-V3.2 Eq. 7 / TRL ``per_token_kl * coef_1``: (pi/pi_old) * (pi_ref/pi - log(pi_ref/pi) - 1)."""
    lp, ref, old = (x.astype(np.float64) for x in (lp, ref, old))
    return np.exp(lp - old) * (np.exp(ref - lp) - (ref - lp) - 1.0)


@pytest.mark.parametrize("name", ["low_var_kl_is", "k3_is"])
def test_importance_weighted_k3_value_and_gradient_match_numpy(name):
    rng = np.random.default_rng(4)
    lp = rand_logprobs(rng, (4, 6), 2.0)
    ref = (lp + rng.normal(scale=0.7, size=lp.shape)).astype(np.float32)  # k3 well inside verl's clamp at 10
    old = (lp + rng.normal(scale=0.4, size=lp.shape)).astype(np.float32)  # off-policy: ratios 0.4 .. 2.5
    assert np.abs(ref - lp).max() < 2.3
    w = rng.uniform(0.5, 1.5, size=lp.shape)  # an arbitrary weighting of the tokens (the aggregation)

    out = jax.jit(kl_penalty, static_argnames="kl_penalty")(lp, ref, name, old_log_prob=old)
    np.testing.assert_allclose(np.asarray(out), np_k3_is(lp, ref, old), rtol=1e-5, atol=1e-6)

    grad = jax.jit(jax.grad(lambda x, o: jnp.sum(w * kl_penalty(x, ref, name, old_log_prob=o)), argnums=(0, 1)))
    g_lp, g_old = (np.asarray(g) for g in grad(lp, old))
    # independent numpy gradient: central differences of the float64 formula, token by token
    h = 1e-6
    fd = w * (np_k3_is(lp.astype(np.float64) + h, ref, old) - np_k3_is(lp.astype(np.float64) - h, ref, old)) / (2 * h)
    np.testing.assert_allclose(g_lp, fd, rtol=1e-4, atol=1e-6)
    # ... and the closed form: d/dx [e^(x-o) k3] = e^(x-o) (x - r), the importance-weighted k1 score
    np.testing.assert_allclose(g_lp, w * np.exp(lp - old) * (lp - ref), rtol=1e-4, atol=1e-6)
    assert np.all(g_old == 0.0)  # the behaviour policy is a constant
    # off-policy this is neither k3's gradient nor the straight-through k3+'s (d = lp - ref)
    g_st = np.asarray(jax.grad(lambda x: jnp.sum(w * kl_penalty(x, ref, "low_var_kl+")))(lp))
    assert np.abs(g_lp - g_st).max() > 0.1

    # on-policy (old = the current log-probs): the value is k3's and the gradient k3+'s
    on = jax.grad(lambda x: jnp.sum(w * kl_penalty(x, ref, name, old_log_prob=jax.lax.stop_gradient(x))))(lp)
    np.testing.assert_allclose(np.asarray(on), g_st, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_penalty(lp, ref, name, old_log_prob=lp)),
                               np.asarray(kl_penalty(lp, ref, "low_var_kl")), rtol=1e-6)


def test_importance_weighted_k3_gradient_is_the_unbiased_reverse_kl_gradient_off_policy():
    """Tokens sampled from pi_old: the exact expectation over pi_old of the gradient of k3 x pi/pi_old equals the
    gradient of KL(pi || pi_ref) (written out in numpy); k3's and the straight-through k3+'s do not."""
    rng = np.random.default_rng(5)
    v = 7
    theta = rng.normal(size=v).astype(np.float32)  # pi = softmax(theta)
    old_lp = np.asarray(jax.nn.log_softmax(theta + rng.normal(scale=0.8, size=v).astype(np.float32)))
    ref_lp = np.asarray(jax.nn.log_softmax(rng.normal(size=v).astype(np.float32)))
    p_old = np.exp(old_lp.astype(np.float64))

    def expected_grad(name):
        """sum_a pi_old(a) * d/dtheta kl_penalty(log pi(a), log pi_ref(a)): every token once, [1, V] rows."""
        def f(t):
            lp = jax.nn.log_softmax(t)[None]
            return jnp.sum(p_old[None] * kl_penalty(lp, ref_lp[None], name, old_log_prob=old_lp[None]))
        return np.asarray(jax.grad(f)(theta), np.float64)

    lp = np.asarray(jax.nn.log_softmax(theta), np.float64)
    p = np.exp(lp)
    kl = np.sum(p * (lp - ref_lp))
    true_grad = p * (lp - ref_lp - kl)  # d/dtheta_j sum_a p_a (log p_a - log ref_a) for p = softmax(theta)
    np.testing.assert_allclose(expected_grad("low_var_kl_is"), true_grad, rtol=1e-4, atol=1e-6)
    for biased in ("low_var_kl", "low_var_kl+"):
        assert np.abs(expected_grad(biased) - true_grad).max() > 1e-2, biased


def test_importance_weighted_k3_needs_old_log_probs():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"'low_var_kl_is' weights k3 by pi/pi_old and needs old_log_prob"):
        kl_penalty(x, x, "low_var_kl_is")
    with pytest.raises(ValueError, match=r"old_log_prob \(2, 2\) and log_prob \(2, 3\)"):
        kl_penalty(x, x, "k3_is", old_log_prob=np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"valid options are .*'low_var_kl_is', 'k3_is', 'full'"):
        kl_penalty(x, x, "k3_iss")


# ----------------------------------------------------------------------------- agg_loss


def np_agg(loss, mask, mode, num_tokens=None, num_seqs=None):
    loss, mask = loss.astype(np.float64), mask.astype(np.float64)
    seq_sum = (loss * mask).sum(-1)
    seq_cnt = mask.sum(-1)
    if mode == "token-mean":
        n = mask.sum() if num_tokens is None else num_tokens
        return (loss * mask).sum() / n if n > 0 else 0.0
    s = loss.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        per = np.array([a / c if c > 0 else 0.0 for a, c in zip(seq_sum, seq_cnt)])
    elif mode == "seq-mean-token-sum":
        per = seq_sum
    else:
        per = seq_sum / loss.shape[-1]
    return per.sum() / s


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_numpy(mode):
    rng = np.random.default_rng(2)
    loss = rng.normal(size=(6, 10)).astype(np.float32)
    mask = rand_mask(rng, 6, 10, empty_rows=(3,))
    loss[mask == 0] = np.nan  # masked entries must not leak, even as NaN
    out = agg_j(loss, mask, loss_agg_mode=mode)
    assert out.shape == () and np.isfinite(float(out))
    np.testing.assert_allclose(float(out), np_agg(np.nan_to_num(loss), mask, mode), rtol=1e-5)


def test_agg_loss_formulas_by_hand():
    loss = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(16 / 4)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((6 / 3 + 10) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 10) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((6 / 4 + 10 / 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=8.0)) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_is_zero(mode):
    loss = np.ones((3, 4), np.float32)
    mask = np.zeros((3, 4), np.float32)
    out, grad = jax.jit(jax.value_and_grad(lambda x: agg_loss(x, mask, mode)))(loss)
    assert float(out) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_microbatch_decomposition(mode):
    rng = np.random.default_rng(3)
    loss = rng.normal(size=(8, 12)).astype(np.float32)
    mask = rand_mask(rng, 8, 12, empty_rows=(5,))
    full = float(agg_j(loss, mask, loss_agg_mode=mode))
    n_tok, n_seq = mask.sum(), mask.shape[0]
    parts = [
        float(agg_j(loss[i : i + 2], mask[i : i + 2], loss_agg_mode=mode, num_tokens=n_tok, num_seqs=n_seq))
        for i in range(0, 8, 2)
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-5, atol=1e-7)
    # and without the global normalisers the naive sum is wrong (so the test above is meaningful)
    naive = sum(float(agg_j(loss[i : i + 2], mask[i : i + 2], loss_agg_mode=mode)) for i in range(0, 8, 2))
    assert abs(naive - full) > 1e-3


def test_agg_loss_bad_inputs():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'mean'.*'seq-mean-token-sum-norm'"):
        agg_loss(x, x, "mean")
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        agg_loss(x, x[:, :2], "token-mean")


# ----------------------------------------------------------------------------- PPO policy loss


def np_policy_loss(old, new, adv, mask, lo, hi, c, mode):
    old, new, adv = (a.astype(np.float64) for a in (old, new, adv))
    neg_kl = np.clip(new - old, -20, 20)
    ratio = np.exp(neg_kl)
    out = np.empty_like(ratio)
    clipped = np.zeros(ratio.shape, bool)
    lower = np.zeros(ratio.shape, bool)
    for idx in np.ndindex(ratio.shape):
        a, r = adv[idx], ratio[idx]
        unclipped = -a * r
        clip = -a * min(max(r, 1 - lo), 1 + hi)
        clipped[idx] = clip > unclipped
        loss = max(unclipped, clip)
        if a < 0:
            lower[idx] = loss > -a * c
            loss = min(loss, -a * c)
        out[idx] = loss
    n = mask.sum()
    metrics = {
        "pg_clipfrac": (clipped * mask).sum() / n,
        "ppo_kl": (-neg_kl * mask).sum() / n,
        "pg_clipfrac_lower": (lower * mask).sum() / n,
    }
    return np_agg(out, mask, mode), metrics


def test_policy_loss_hand_cases():
    # ratio 2, A=+1 -> clipped at 1+0.28; ratio 0.5, A=-1 -> clipped at 1-0.2 (loss max(0.5, 0.8));
    # ratio 5, A=-1 -> max(5, 0.8)=5 -> dual clip min(5, 3)=3; ratio 1.1, A=+2 -> unclipped -2.2
    ratio = np.array([[2.0, 0.5, 5.0, 1.1]])
    adv = np.array([[1.0, -1.0, -1.0, 2.0]], np.float32)
    old = np.full((1, 4), -2.0, np.float32)
    new = (old + np.log(ratio)).astype(np.float32)
    mask = np.ones((1, 4), np.float32)
    loss, m = compute_policy_loss_vanilla(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        loss_agg_mode="seq-mean-token-sum",
    )
    assert float(loss) == pytest.approx(-1.28 + 0.8 + 3.0 - 2.2, rel=1e-5)
    assert float(m["pg_clipfrac"]) == pytest.approx(2 / 4)  # tokens 0 and 1 took the clipped branch
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(1 / 4)  # token 2 hit the dual clip
    assert float(m["ppo_kl"]) == pytest.approx(-np.log(ratio).mean(), rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_numpy(mode):
    rng = np.random.default_rng(4)
    b, r = 6, 16
    old = rand_logprobs(rng, (b, r), 2.0)
    new = (old + rng.normal(scale=0.8, size=(b, r))).astype(np.float32)  # ratios well outside [0.8, 1.28]
    new[0, 0] = old[0, 0] + 30.0  # exercises the [-20, 20] clamp
    adv = rng.normal(size=(b, r)).astype(np.float32)
    mask = rand_mask(rng, b, r, empty_rows=(2,))
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5)
    loss, m = pg_j(old, new, adv, mask, loss_agg_mode=mode, **kw)
    ref_loss, ref_m = np_policy_loss(old, new, adv, mask, 0.2, 0.28, 2.5, mode)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        np.testing.assert_allclose(float(m[k]), ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert ref_m["pg_clipfrac"] > 0.1 and ref_m["pg_clipfrac_lower"] > 0.0  # every branch is exercised

    if mode == "token-mean":  # the eager call (as registered) agrees with the jitted one
        eloss, em = get_policy_loss("vanilla")(old, new, adv, mask, loss_agg_mode=mode, **kw)
        np.testing.assert_allclose(float(eloss), float(loss), rtol=1e-6)
        np.testing.assert_allclose(float(em["pg_clipfrac"]), float(m["pg_clipfrac"]), rtol=1e-6)


def test_policy_loss_gradient_only_through_unclipped_tokens():
    old = np.zeros((1, 3), np.float32)
    new = np.log(np.array([[2.0, 1.1, 5.0]], np.float32))  # clipped, inside, dual-clipped
    adv = np.array([[1.0, 1.0, -1.0]], np.float32)
    mask = np.ones((1, 3), np.float32)

    def loss(lp):
        return compute_policy_loss_vanilla(old, lp, adv, mask, clip_ratio_high=0.28)[0]

    grad = jax.jit(jax.grad(loss))(new)
    # d/dlp of -A*exp(lp)/3 at the unclipped token = -1.1/3; clipped branches are constant
    np.testing.assert_allclose(np.asarray(grad), [[0.0, -1.1 / 3, 0.0]], rtol=1e-5, atol=1e-7)


def test_policy_loss_registry_and_errors():
    assert "vanilla" in registered_policy_losses()
    assert get_policy_loss("vanilla") is compute_policy_loss_vanilla
    with pytest.raises(ValueError, match=r"unknown policy loss 'gspo2'.*'vanilla'"):
        get_policy_loss("gspo2")
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        compute_policy_loss_vanilla(x, x, x, x, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss_vanilla(x, x, x, x, loss_agg_mode="sum")
    with pytest.raises(ValueError, match="one shape"):
        compute_policy_loss_vanilla(x, x, x[:, :2], x)


# ----------------------------------------------------------------------------- entropy / log-probs


def np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def np_entropy(x):
    lsm = np_log_softmax(x)
    p = np.exp(lsm)
    return -(np.where(p > 0, p * lsm, 0.0)).sum(-1)


@pytest.mark.parametrize("scale,offset", [(1.0, 0.0), (30.0, 0.0), (5.0, 1e4), (5.0, -3e4)])
def test_entropy_matches_numpy(scale, offset):
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(3, 4, 50)) * scale + offset).astype(np.float32)
    out = entropy_j(logits)
    assert out.shape == (3, 4) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np_entropy(logits), rtol=1e-4, atol=2e-5)


def test_entropy_bf16_and_inf_logits():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(2, 3, 64)) * 4, jnp.bfloat16)
    ref = np_entropy(np.asarray(logits.astype(jnp.float32)))
    out = entropy_j(logits)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)

    uniform4 = np.array([[0.0, 0.0, 0.0, 0.0, -np.inf, -np.inf]], np.float32)
    np.testing.assert_allclose(np.asarray(entropy_j(uniform4)), [np.log(4)], rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: entropy_from_logits(x).sum()))(uniform4)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_entropy_gradient_matches_finite_difference():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8,)).astype(np.float64)

    def h(v):
        lsm = np_log_softmax(v)
        return -(np.exp(lsm) * lsm).sum()

    fd = np.array([(h(x + e) - h(x - e)) / 2e-4 for e in np.eye(8) * 1e-4])
    g = jax.jit(jax.grad(entropy_from_logits))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_log_probs_match_numpy(dtype):
    rng = np.random.default_rng(8)
    logits = jnp.asarray(rng.normal(size=(2, 5, 97)) * 3, dtype)
    labels = rng.integers(0, 97, size=(2, 5)).astype(np.int32)
    out = logprob_j(logits, labels)
    assert out.dtype == jnp.float32 and out.shape == (2, 5)
    lsm = np_log_softmax(np.asarray(logits.astype(jnp.float32)))  # reference on the same rounded inputs
    ref = np.take_along_axis(lsm, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    if dtype == jnp.bfloat16:  # eager (with its label-range check) agrees with jit
        eager = log_probs_from_logits(logits, labels)
        np.testing.assert_allclose(np.asarray(eager), np.asarray(out), rtol=1e-6, atol=1e-6)


def test_log_probs_large_logits_are_stable():
    rng = np.random.default_rng(9)
    logits = (rng.normal(size=(3, 4, 33)) * 50 + 2e4).astype(np.float32)
    labels = rng.integers(0, 33, size=(3, 4))
    out = np.asarray(logprob_j(logits, labels))
    ref = np.take_along_axis(np_log_softmax(logits), labels[..., None], -1)[..., 0]
    assert np.all(np.isfinite(out)) and np.all(out <= 0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=5e-3)  # f32 spacing at 2e4 is ~2e-3


def test_log_probs_gradient_is_onehot_minus_softmax():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(1, 2, 6)).astype(np.float32)
    labels = np.array([[1, 4]])
    g = jax.jit(jax.grad(lambda x: log_probs_from_logits(x, labels).sum()))(logits)
    ref = np.eye(6)[labels] - np.exp(np_log_softmax(logits))
    np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-6)


def test_log_probs_bad_inputs():
    logits = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\), got values in \[0, 5\]"):
        log_probs_from_logits(logits, np.array([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match=r"labels \(2, 2\) must equal"):
        log_probs_from_logits(logits, np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="integer"):
        log_probs_from_logits(logits, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="floating-point"):
        log_probs_from_logits(np.zeros((2, 3, 5), np.int32), np.zeros((2, 3), np.int32))
