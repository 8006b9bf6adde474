"""GRPO / Dr. GRPO advantages vs an independent numpy reference (verl semantics)."""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import (
    compute_grpo_outcome_advantage,
    get_adv_estimator,
    register_adv_estimator,
    registered_adv_estimators,
)


def np_grpo(rewards, mask, ids, norm_by_std, eps=1e-6):
    """Reference written from verl's description: per-group mean and torch.std (ddof=1)."""
    scores = rewards.astype(np.float64).sum(-1)
    groups = defaultdict(list)
    for i, g in enumerate(ids):
        groups[int(g)].append(scores[i])
    adv = np.empty_like(scores)
    for i, g in enumerate(ids):
        vals = np.array(groups[int(g)])
        mean, std = (0.0, 1.0) if len(vals) == 1 else (vals.mean(), vals.std(ddof=1))
        adv[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return adv[:, None] * mask


def make_batch(seed=0):
    """12 rows: group 7 (4 rows, random), group 2 (3 rows, all equal), group 0 (1 row),
    group 11 (4 rows incl. one zero-length response). Outcome reward on the last valid token."""
    rng = np.random.default_rng(seed)
    ids = np.array([7, 7, 2, 7, 2, 0, 11, 11, 2, 7, 11, 11], np.int32)
    b, r = len(ids), 9
    lengths = rng.integers(1, r + 1, size=b)
    lengths[10] = 0  # zero-length response (all-masked row)
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    score = rng.normal(size=b).astype(np.float32)
    score[ids == 2] = 0.5  # all-equal group
    rewards = np.zeros((b, r), np.float32)
    for i in range(b):
        rewards[i, max(lengths[i] - 1, 0)] = score[i]
    return rewards, mask, ids


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_numpy(norm_by_std):
    rewards, mask, ids = make_batch()
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, ids, norm_adv_by_std_in_grpo=norm_by_std)
    ref = np_grpo(rewards, mask, ids, norm_by_std)
    np.testing.assert_allclose(np.asarray(adv), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(ret))
    assert adv.dtype == jnp.float32 and adv.shape == rewards.shape

    adv = np.asarray(adv)
    assert np.all(adv[ids == 2] == 0.0), "all-equal group must get zero advantage"
    assert np.all(adv[mask == 0] == 0.0), "masked tokens must be zeroed"
    assert np.all(adv[10] == 0.0), "zero-length response has no valid token"
    # group of size 1: mean 0, std 1 -> the raw score (divided by 1 + eps)
    single = rewards[5].sum()
    expected = single / (1.0 + 1e-6) if norm_by_std else single
    np.testing.assert_allclose(adv[5][mask[5] > 0], expected, rtol=1e-6)
    # within a multi-row group the per-row advantages sum to zero
    row_adv = np.array([adv[i][mask[i] > 0][0] for i in np.flatnonzero(ids == 7)])
    assert abs(row_adv.sum()) < 1e-5


def test_grpo_uses_unbiased_std():
    # one group of two rows with scores 0 and 2: mean 1, torch.std (ddof=1) = sqrt(2)
    rewards = np.array([[0.0, 0.0], [2.0, 0.0]], np.float32)
    mask = np.ones_like(rewards)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([1, 1], np.int32), adv_std_epsilon=0.0)
    np.testing.assert_allclose(np.asarray(adv)[:, 0], [-1 / np.sqrt(2), 1 / np.sqrt(2)], rtol=1e-6)


def test_grpo_std_epsilon_is_an_option():
    """``adv_std_epsilon`` (algorithm.adv_std_epsilon) is the epsilon added to the group std: 1e-6 as verl by
    default, 1e-4 as TRL's GRPOTrainer. On a group whose scores barely differ it changes the advantages a lot."""
    rewards = np.array([[0.0, 0.0], [0.002, 0.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.0]], np.float32)
    mask = np.ones_like(rewards)
    ids = np.array([0, 0, 2, 2, 2], np.int32)
    default, _ = compute_grpo_outcome_advantage(rewards, mask, ids)
    trl, _ = compute_grpo_outcome_advantage(rewards, mask, ids, adv_std_epsilon=1e-4)
    np.testing.assert_allclose(np.asarray(default), np_grpo(rewards, mask, ids, True, eps=1e-6), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(trl), np_grpo(rewards, mask, ids, True, eps=1e-4), rtol=1e-5)
    # group 0: std = 0.002 / sqrt(2) = 1.414e-3, so 1e-4 shrinks its advantages by ~6.6%
    ratio = np.asarray(trl)[1, 0] / np.asarray(default)[1, 0]
    np.testing.assert_allclose(ratio, (1.4142136e-3 + 1e-6) / (1.4142136e-3 + 1e-4), rtol=1e-4)
    assert ratio < 0.94


def test_grpo_jit_matches_eager():
    rewards, mask, ids = make_batch(seed=3)
    for norm in (True, False):
        eager = compute_grpo_outcome_advantage(rewards, mask, ids, norm_adv_by_std_in_grpo=norm)[0]
        jitted = jax.jit(compute_grpo_outcome_advantage, static_argnames=("norm_adv_by_std_in_grpo",))(
            rewards, mask, ids, norm_adv_by_std_in_grpo=norm
        )[0]
        if jax.default_backend() == "cpu":  # bit-identical on CPU; fused GPU/TPU kernels may round differently
            np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
        np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(jitted), np_grpo(rewards, mask, ids, norm), rtol=1e-5, atol=1e-6)


def test_grpo_rejects_bad_group_ids_and_shapes():
    rewards, mask, ids = make_batch()
    with pytest.raises(ValueError, match=r"group_ids must be in \[0, 12\)"):
        compute_grpo_outcome_advantage(rewards, mask, np.full_like(ids, 12))
    with pytest.raises(ValueError, match="group_ids"):
        compute_grpo_outcome_advantage(rewards, mask, ids[:-1])
    with pytest.raises(ValueError, match="response_mask"):
        compute_grpo_outcome_advantage(rewards, mask[:, :-1], ids)


def test_registry(monkeypatch):
    from jaxrl.algorithms import registry

    # register into a copy, so the global registry (the config's choice list) is untouched afterwards
    monkeypatch.setattr(registry.ADV_ESTIMATORS, "_entries", dict(registry.ADV_ESTIMATORS._entries))
    assert get_adv_estimator("grpo") is compute_grpo_outcome_advantage
    assert "grpo" in registered_adv_estimators()
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*'grpo'"):
        get_adv_estimator("nope")

    @register_adv_estimator("_test_zero")
    def zero(token_level_rewards, response_mask, group_ids):
        z = jnp.zeros_like(token_level_rewards)
        return z, z

    assert get_adv_estimator("_test_zero") is zero
    register_adv_estimator("_test_zero")(zero)  # re-registering the same function is fine
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(zero)
