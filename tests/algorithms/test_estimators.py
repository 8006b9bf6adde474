"""Advantage estimators (gae, rloo, reinforce++, reinforce++-baseline, remax, grpo_passk, opo, gpg)
and masked whitening vs independent numpy references written from the papers / verl's semantics."""

from __future__ import annotations

import inspect
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    compute_gae_advantage_return,
    compute_grpo_passk_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    get_adv_estimator,
    masked_var,
    masked_whiten,
    registered_adv_estimators,
)

VERL_ESTIMATORS = (
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "opo", "gpg",
)
# the option names the trainer may pass (it passes only those a function declares)
TRAINER_OPTIONS = {"norm_adv_by_std_in_grpo", "adv_std_epsilon", "gamma", "lam", "values", "reward_baselines", "f_norm"}


# ----------------------------------------------------------------------------- batch


def make_batch(seed=0):
    """14 rows, 10 tokens. Groups: 7 (4 random rows), 2 (3 rows, all-equal scores), 0 (1 row),
    11 (4 rows, one zero-length), 4 (2 rows). Rows 1, 6, 12 are multi-turn: masked gaps (observation
    tokens) inside the response. Rewards are token-level (a process reward on some valid tokens plus
    the outcome on the last valid one) so reward-to-go estimators see structure."""
    rng = np.random.default_rng(seed)
    ids = np.array([7, 7, 2, 7, 2, 0, 11, 11, 2, 7, 11, 11, 4, 4], np.int32)
    b, r = len(ids), 10
    lengths = rng.integers(3, r + 1, size=b)
    lengths[10] = 0  # zero-length response
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    for row, gap in ((1, (1, 3)), (6, (2, 4)), (12, (1, 2))):
        lengths[row] = r
        mask[row] = 1.0
        mask[row, gap[0] : gap[1]] = 0.0  # observation tokens of a tool call
    rewards = np.zeros((b, r), np.float32)
    for i in range(b):
        valid = np.flatnonzero(mask[i])
        if valid.size:
            rewards[i, valid[-1]] = rng.normal()
            rewards[i, valid[0]] += 0.3 * rng.normal()  # a process reward
    for i in np.flatnonzero(ids == 2):  # all-equal group: same score on the last valid token
        rewards[i] = 0.0
        rewards[i, np.flatnonzero(mask[i])[-1]] = 0.5
    values = rng.normal(size=(b, r)).astype(np.float32)
    baselines = rng.normal(size=b).astype(np.float32)
    return rewards, mask, ids, values, baselines


def np_masked_whiten(x, mask, shift_mean=True):
    sel = x[mask > 0].astype(np.float64)
    mean, var = sel.mean(), sel.var(ddof=1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def groups_of(ids):
    g = defaultdict(list)
    for i, k in enumerate(ids):
        g[int(k)].append(i)
    return g


# ----------------------------------------------------------------------------- numpy references


def np_gae(rewards, values, mask, gamma, lam):
    """Plain per-row loop: a masked token is an observation; it neither emits a TD error nor is
    bootstrapped from, so the last valid token before a gap bootstraps from the first valid one after."""
    b, r = rewards.shape
    raw = np.zeros((b, r))
    for i in range(b):
        next_v, running = 0.0, 0.0
        for t in range(r - 1, -1, -1):
            if mask[i, t] > 0:
                running = rewards[i, t] + gamma * next_v - values[i, t] + gamma * lam * running
                next_v = values[i, t]
            raw[i, t] = running
    returns = raw + values
    adv = np_masked_whiten(raw, mask) * mask
    return adv, returns


def np_rloo(rewards, mask, ids):
    s = rewards.astype(np.float64).sum(-1)
    adv = s.copy()
    for rows in groups_of(ids).values():
        n = len(rows)
        if n > 1:
            for i in rows:
                adv[i] = s[i] - np.mean([s[j] for j in rows if j != i])
    return adv[:, None] * mask


def np_rfpp(rewards, mask, gamma):
    b, r = rewards.shape
    ret = np.zeros((b, r))
    for i in range(b):
        g = 0.0
        for t in range(r - 1, -1, -1):
            g = rewards[i, t] + gamma * g
            ret[i, t] = g
            if mask[i, t] == 0:
                g = 0.0  # verl: the running return restarts after a masked position
    return np_masked_whiten(ret, mask) * mask, ret


def np_rfpp_baseline(rewards, mask, ids):
    s = rewards.astype(np.float64).sum(-1)
    centred = s.copy()
    for rows in groups_of(ids).values():
        if len(rows) > 1:
            centred[rows] = s[rows] - s[rows].mean()
    tiled = centred[:, None] * mask
    return np_masked_whiten(tiled, mask) * mask


def np_remax(rewards, mask, baselines):
    b, r = rewards.shape
    ret = np.zeros((b, r))
    for i in range(b):
        for t in range(r):
            ret[i, t] = sum(rewards[i, s] * mask[i, s] for s in range(t, r))
    return (ret - baselines[:, None]) * mask, ret


def np_passk(rewards, mask, ids, norm, eps=1e-6):
    s = rewards.astype(np.float64).sum(-1)
    adv = np.zeros_like(s)
    for rows in groups_of(ids).values():
        vals = s[rows]
        order = sorted(range(len(rows)), key=lambda j: (-vals[j], j))
        best = rows[order[0]]
        a = vals[order[0]] - vals[order[1]]
        adv[best] = a / (vals.std(ddof=1) + eps) if norm else a
    return adv[:, None] * mask


def np_opo(rewards, mask, ids):
    s = rewards.astype(np.float64).sum(-1)
    lengths = mask.sum(-1)
    adv = s.copy()
    for rows in groups_of(ids).values():
        if len(rows) > 1 and lengths[rows].sum() > 0:
            adv[rows] = s[rows] - (lengths[rows] * s[rows]).sum() / lengths[rows].sum()
    return adv[:, None] * mask


def np_gpg(rewards, mask, ids, f_norm=1.0):
    s = rewards.astype(np.float64).sum(-1)
    alpha = len(s) / max(np.count_nonzero(s), 1)
    adv = s.copy()
    for rows in groups_of(ids).values():
        mean = s[rows].mean() if len(rows) > 1 else 0.0
        adv[rows] = alpha * (s[rows] - mean) / f_norm
    return adv[:, None] * mask


# ----------------------------------------------------------------------------- registry / signatures


def test_every_verl_estimator_is_registered_with_trainer_option_names():
    assert set(VERL_ESTIMATORS) <= set(registered_adv_estimators())
    for name in VERL_ESTIMATORS:
        params = inspect.signature(get_adv_estimator(name)).parameters
        positional = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [p.name for p in positional] == ["token_level_rewards", "response_mask", "group_ids"], name
        options = {p.name for p in params.values() if p.kind is p.KEYWORD_ONLY}
        assert options <= TRAINER_OPTIONS, (name, options - TRAINER_OPTIONS)
    assert "values" in inspect.signature(get_adv_estimator("gae")).parameters
    assert "reward_baselines" in inspect.signature(get_adv_estimator("remax")).parameters


# ----------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_scan_matches_python_loop(gamma, lam):
    rewards, mask, ids, values, _ = make_batch(1)
    adv, ret = jax.jit(compute_gae_advantage_return)(rewards, mask, ids, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-4, atol=1e-5)
    assert adv.shape == ret.shape == rewards.shape and adv.dtype == jnp.float32
    assert np.all(np.asarray(adv)[mask == 0] == 0.0)
    valid = np.asarray(adv)[mask > 0]  # whitened over the batch: mean 0, unbiased std 1
    assert abs(valid.mean()) < 1e-5 and abs(valid.std(ddof=1) - 1.0) < 1e-4


def test_gae_bridges_an_observation_gap_by_hand():
    # one row: action, action, [obs, obs], action; gamma = lam = 1 -> A_t = sum of future valid
    # rewards + V(last) * 0 - V_t: every valid token's raw advantage is (sum of its reward-to-go) - V_t
    rewards = np.array([[0.0, 0.5, 9.0, 9.0, 2.0], [0.0, 0.0, 0.0, 0.0, 1.0]], np.float32)
    mask = np.array([[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]], np.float32)
    values = np.array([[0.1, 0.2, 7.0, 7.0, 0.4], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    values_nan = values.copy()
    values_nan[0, 2:4] = np.nan  # observation tokens may hold garbage values: they must not leak
    _, ret = compute_gae_advantage_return(rewards, mask, np.zeros(2, np.int32), values=values_nan)
    ret = np.asarray(ret)
    # raw advantages row 0: t4: 2 - 0.4 = 1.6; t1: 0.5 + V4 - V1 + A4 = 0.5 + 0.4 - 0.2 + 1.6 = 2.3;
    # t0: 0 + V1 - V0 + A1 = 0.2 - 0.1 + 2.3 = 2.4 (the 9.0 rewards on observation tokens are ignored)
    np.testing.assert_allclose(ret[0, [0, 1, 4]] - values[0, [0, 1, 4]], [2.4, 2.3, 1.6], rtol=1e-6)
    # with gamma < 1 the gap costs no discount either (it is not a time step)
    _, ret2 = compute_gae_advantage_return(rewards, mask, np.zeros(2, np.int32), values=values, gamma=0.5, lam=1.0)
    a4 = 2.0 - 0.4
    a1 = 0.5 + 0.5 * 0.4 - 0.2 + 0.5 * a4
    np.testing.assert_allclose(np.asarray(ret2)[0, 1] - 0.2, a1, rtol=1e-6)


def test_gae_input_errors():
    rewards, mask, ids, values, _ = make_batch()
    with pytest.raises(ValueError, match=r"values must be a float array of shape \(14, 10\)"):
        compute_gae_advantage_return(rewards, mask, ids, values=values[:, :-1])
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        compute_gae_advantage_return(rewards, mask, ids, values=values, gamma=1.5)
    with pytest.raises(ValueError, match="lam must be in"):
        compute_gae_advantage_return(rewards, mask, ids, values=values, lam=-0.1)


# ----------------------------------------------------------------------------- whitening


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_numpy(shift_mean):
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(5, 8)) * 3 + 2).astype(np.float32)
    mask = (rng.random((5, 8)) > 0.4).astype(np.float32)
    x[mask == 0] = 1e6  # masked entries must not enter the statistics
    out = jax.jit(masked_whiten, static_argnames="shift_mean")(x, mask, shift_mean=shift_mean)
    np.testing.assert_allclose(np.asarray(out)[mask > 0], np_masked_whiten(x, mask, shift_mean)[mask > 0], rtol=1e-5)
    sel = x[mask > 0].astype(np.float64)
    np.testing.assert_allclose(float(masked_var(x, mask)), sel.var(ddof=1), rtol=1e-5)
    np.testing.assert_allclose(float(masked_var(x, mask, unbiased=False)), sel.var(), rtol=1e-5)


def test_masked_var_needs_two_valid_entries():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with pytest.raises(ValueError, match="all zero"):
        masked_var(x, np.zeros_like(x))
    one = np.zeros_like(x)
    one[1, 2] = 1
    with pytest.raises(ValueError, match="one valid entry"):
        masked_whiten(x, one)
    # under jit no error can be raised: a single valid entry whitens to 0 (finite)
    out = jax.jit(masked_whiten)(x, one)
    assert float(out[1, 2]) == 0.0


# ----------------------------------------------------------------------------- outcome estimators vs numpy


def _run(name, batch, **kw):
    rewards, mask, ids, values, baselines = batch
    extra = {"gae": {"values": values}, "remax": {"reward_baselines": baselines}}.get(name, {})
    fn = get_adv_estimator(name)
    static = tuple(k for k in ("norm_adv_by_std_in_grpo",) if k in kw)
    return jax.jit(fn, static_argnames=static)(rewards, mask, ids, **extra, **kw)


def _pairs(ids):
    """The make_batch ids with the singleton group merged into group 4 (grpo_passk needs >= 2 rows)."""
    ids = ids.copy()
    ids[ids == 0] = 4
    return ids


CASES = {
    "rloo": lambda b: (np_rloo(b[0], b[1], b[2]),) * 2,
    "reinforce_plus_plus": lambda b: np_rfpp(b[0], b[1], 1.0),
    "reinforce_plus_plus_baseline": lambda b: (np_rfpp_baseline(b[0], b[1], b[2]),) * 2,
    "remax": lambda b: np_remax(b[0], b[1], b[4]),
    "opo": lambda b: (np_opo(b[0], b[1], b[2]),) * 2,
    "gpg": lambda b: (np_gpg(b[0], b[1], b[2]),) * 2,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimator_matches_numpy(name):
    batch = make_batch(2)
    rewards, mask, ids, _, _ = batch
    adv, ret = _run(name, batch)
    ref_adv, ref_ret = CASES[name](batch)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-4, atol=1e-5, err_msg=name)
    assert adv.dtype == jnp.float32 and adv.shape == rewards.shape
    assert np.all(np.asarray(adv)[mask == 0] == 0.0), "advantages must be 0 at masked positions"
    assert np.all(np.asarray(adv)[10] == 0.0), "zero-length response"
    # eager (with its input checks) agrees with jit
    eager = get_adv_estimator(name)(
        rewards, mask, ids, **({"reward_baselines": batch[4]} if name == "remax" else {})
    )[0]
    np.testing.assert_allclose(np.asarray(eager), np.asarray(adv), rtol=1e-5, atol=1e-6)


def test_group_edge_cases():
    batch = make_batch(4)
    rewards, mask, ids, _, _ = batch
    score = rewards.sum(-1)
    rloo = np.asarray(_run("rloo", batch)[0])
    opo = np.asarray(_run("opo", batch)[0])
    gpg = np.asarray(_run("gpg", batch)[0])
    for adv in (rloo, opo):
        assert np.all(adv[ids == 2] == 0.0), "all-equal group -> zero advantage"
        np.testing.assert_allclose(adv[5][mask[5] > 0], score[5], rtol=1e-6)  # group of size 1: raw score
    alpha = len(ids) / np.count_nonzero(score)
    np.testing.assert_allclose(gpg[5][mask[5] > 0], alpha * score[5], rtol=1e-5)
    assert np.all(gpg[ids == 2] == 0.0)
    # RLOO: leave-one-out mean of the other rows of group 7
    rows = np.flatnonzero(ids == 7)
    i = rows[0]
    np.testing.assert_allclose(rloo[i][mask[i] > 0][0], score[i] - score[rows[1:]].mean(), rtol=1e-5)


def test_gpg_alpha_counts_nonzero_scores():
    rewards = np.zeros((4, 3), np.float32)
    rewards[0, 2] = 1.0  # one non-zero score in the batch: alpha = 4
    adv, _ = get_adv_estimator("gpg")(rewards, np.ones_like(rewards), np.array([0, 0, 2, 2], np.int32), f_norm=2.0)
    np.testing.assert_allclose(np.asarray(adv)[:, 0], [4 * 0.5 / 2, 4 * -0.5 / 2, 0.0, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match="f_norm must be non-zero"):
        get_adv_estimator("gpg")(rewards, np.ones_like(rewards), np.zeros(4, np.int32), f_norm=0.0)


def test_opo_weights_the_baseline_by_length():
    # group of 2: lengths 1 and 3, scores 1 and 0 -> baseline (1*1 + 3*0) / 4 = 0.25
    rewards = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 0, 0], [1, 1, 1]], np.float32)
    adv, _ = get_adv_estimator("opo")(rewards, mask, np.array([1, 1], np.int32))
    np.testing.assert_allclose(np.asarray(adv), [[0.75, 0, 0], [-0.25, -0.25, -0.25]], rtol=1e-6)
    # all-zero-length group: no NaN
    adv, _ = get_adv_estimator("opo")(rewards, np.zeros_like(mask), np.array([1, 1], np.int32))
    assert np.all(np.asarray(adv) == 0.0)


def test_reinforce_plus_plus_gap_cuts_the_return_and_gamma_discounts():
    rewards = np.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]], np.float32)
    mask = np.array([[1, 0, 1, 1], [1, 1, 1, 1]], np.float32)
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, np.zeros(2, np.int32), gamma=0.5)
    # row 1: 0.125, 0.25, 0.5, 1; row 0: the masked t=1 restarts the running return -> t0 gets 0
    np.testing.assert_allclose(np.asarray(ret), [[0.0, 0.25, 0.5, 1.0], [0.125, 0.25, 0.5, 1.0]], rtol=1e-6)


def test_remax_by_hand_and_errors():
    rewards = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    adv, ret = compute_remax_outcome_advantage(rewards, mask, np.zeros(2, np.int32), reward_baselines=np.array([1.0, 5.0], np.float32))
    np.testing.assert_allclose(np.asarray(ret), [[3, 3, 2], [3, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adv), [[2, 2, 1], [-2, 0, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"reward_baselines must be a float array of shape \(2,\)"):
        compute_remax_outcome_advantage(rewards, mask, np.zeros(2, np.int32), reward_baselines=np.zeros(3, np.float32))


# ----------------------------------------------------------------------------- grpo_passk


@pytest.mark.parametrize("norm", [True, False])
def test_passk_matches_numpy(norm):
    batch = make_batch(5)
    rewards, mask, ids, _, _ = batch
    ids = _pairs(ids)
    adv, ret = _run("grpo_passk", (rewards, mask, ids) + batch[3:], norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(np.asarray(adv), np_passk(rewards, mask, ids, norm), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(ret))
    # exactly one row per group may be non-zero, and it is >= 0
    row_adv = np.asarray(adv).max(-1)
    for rows in groups_of(ids).values():
        assert np.count_nonzero(row_adv[rows]) <= 1 and row_adv[rows].min() >= 0


def test_passk_ties_and_singletons():
    # tied maximum -> zero advantage for everyone
    rewards = np.array([[1.0], [1.0], [0.0]], np.float32)
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, np.ones_like(rewards), np.zeros(3, np.int32))
    assert np.all(np.asarray(adv) == 0.0)
    with pytest.raises(ValueError, match=r"at least 2 responses per group; group\(s\) \[2\]"):
        compute_grpo_passk_outcome_advantage(rewards, np.ones_like(rewards), np.array([0, 0, 2], np.int32))
    jitted = jax.jit(compute_grpo_passk_outcome_advantage)(
        np.array([[2.0], [1.0], [5.0]], np.float32), np.ones((3, 1), np.float32), np.array([0, 0, 2], np.int32)
    )[0]
    np.testing.assert_allclose(np.asarray(jitted)[:, 0], [1.0 / (np.std([2.0, 1.0], ddof=1) + 1e-6), 0.0, 0.0], rtol=1e-5)


# ----------------------------------------------------------------------------- whole-batch whitening edge


def test_whitening_estimators_need_two_valid_tokens():
    rewards = np.zeros((2, 3), np.float32)
    mask = np.zeros_like(rewards)
    mask[0, 0] = 1
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="one valid entry"):
            get_adv_estimator(name)(rewards, mask, np.zeros(2, np.int32))
