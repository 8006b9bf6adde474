"""PRIME's math (jaxrl.algorithms.prime) against numpy references and a hand-computed batch."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.algorithms.prime import (compute_prime_advantage, implicit_log_ratio, implicit_process_rewards, prime_norm,
                                    prm_ce_loss, prm_pairwise_accuracy, prm_sign_accuracy)
from jaxrl.algorithms.registry import ADV_ESTIMATORS, needs_critic, needs_prm


def _random(seed=0, b=6, r=7):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-2.0, 1.0, (b, r)).astype(np.float32)
    ref = rng.normal(-2.0, 1.0, (b, r)).astype(np.float32)
    lengths = rng.integers(1, r + 1, b)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    return lp, ref, mask


def test_implicit_process_rewards_token_and_whole_match_numpy():
    lp, ref, mask = _random()
    beta = 0.05
    q = np.asarray(implicit_log_ratio(lp, ref, mask))
    np.testing.assert_allclose(q, (lp - ref) * mask, rtol=1e-6, atol=1e-7)
    tok = np.asarray(implicit_process_rewards(q, mask, beta=beta, granularity="token"))
    np.testing.assert_allclose(tok, beta * (lp - ref) * mask, rtol=1e-5, atol=1e-7)
    whole = np.asarray(implicit_process_rewards(q, mask, beta=beta, granularity="whole"))
    expect = np.zeros_like(tok)
    for i, n in enumerate(mask.sum(1)):
        expect[i, n - 1] = beta * np.sum((lp[i] - ref[i])[:n])
    np.testing.assert_allclose(whole, expect, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="prime_granularity='step'"):
        implicit_process_rewards(q, mask, beta=beta, granularity="step")


def test_prime_norm_divides_by_the_largest_return_to_go():
    lp, ref, mask = _random(1)
    r = 0.05 * (lp - ref) * mask
    to_go = np.flip(np.cumsum(np.flip(r, 1), 1), 1)
    np.testing.assert_allclose(np.asarray(prime_norm(r, "batch_norm")), r / (np.abs(to_go).max() + 1e-6), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(prime_norm(r, "none")), r)
    assert np.abs(np.flip(np.cumsum(np.flip(np.asarray(prime_norm(r)), 1), 1), 1)).max() <= 1.0


def test_prm_ce_loss_matches_numpy_bce_and_splits_exactly_over_micro_batches():
    lp, ref, mask = _random(2, b=8)
    acc = np.array([1, 0, 1, 1, 0, 0.25, 0.75, 1], np.float32)  # soft labels too
    beta = 0.5
    z = beta * ((lp - ref) * mask).sum(1).astype(np.float64)
    p = 1 / (1 + np.exp(-z))
    expect = np.mean(-(acc * np.log(p) + (1 - acc) * np.log(1 - p)))
    got = float(prm_ce_loss(lp, ref, mask, acc, beta=beta))
    assert got == pytest.approx(expect, rel=1e-5)
    halves = sum(float(prm_ce_loss(lp[s], ref[s], mask[s], acc[s], beta=beta, num_seqs=8.0))
                 for s in (slice(0, 5), slice(5, 8)))
    assert halves == pytest.approx(expect, rel=1e-5)
    # a padding row (mask all 0) adds nothing and is not counted
    padded = float(prm_ce_loss(np.vstack([lp, lp[:1]]), np.vstack([ref, ref[:1]]),
                               np.vstack([mask, np.zeros_like(mask[:1])]), np.append(acc, 0.0), beta=beta))
    assert padded == pytest.approx(expect, rel=1e-5)
    # the gradient pushes z up for a correct response: the loss falls as its log-ratio grows
    up = lp.copy()
    up[0] += 0.1 * mask[0]
    assert float(prm_ce_loss(up, ref, mask, acc, beta=beta)) < got


def test_prm_accuracies_on_a_hand_example():
    # group 0: labels 1, 0, 1 and rewards 2, -1, 0.5 -> every ordered pair right; group 1: rewards in the wrong order;
    # group 2: all labels equal -> 0.5
    r = np.array([2.0, -1.0, 0.5, -1.0, 1.0, 3.0, 4.0])
    acc = np.array([1, 0, 1, 1, 0, 1, 1.0])
    g = np.array([0, 0, 0, 1, 1, 2, 2])
    assert prm_pairwise_accuracy(r, acc, g) == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    # an untrained PRM (all rewards 0) sits at chance
    assert prm_pairwise_accuracy(np.zeros(7), acc, g) == pytest.approx(0.5)
    # signs: +,-,+ right; -,+ wrong; +,+ right
    assert prm_sign_accuracy(r, acc) == pytest.approx(5 / 7)


def test_prime_advantage_on_a_hand_computed_batch():
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], np.float32)
    rm = np.array([[0.2, 0.4, 0], [0.3, 0.0, 0.3], [0.5, 0, 0], [-0.1, 0.3, 0]], np.float32)
    outcome = np.zeros((4, 3), np.float32)
    outcome[0, 1], outcome[1, 2], outcome[2, 0], outcome[3, 1] = 1.0, 0.0, 0.0, 1.0
    groups = np.array([0, 0, 1, 1], np.int32)
    adv, ret = compute_prime_advantage(outcome, mask, groups, rm_scores=rm, reward_dpo_coef=2.0, reward_gt_coef=3.0,
                                       gamma=1.0)
    # process: baseline = the other response's mean token reward (means 0.3, 0.2 | 0.5, 0.1); returns-to-go of r - b
    #   row0: b=0.2 -> [0.0, 0.2] -> [0.2, 0.2];  row1: b=0.3 -> [0, -0.3, 0] -> [-0.3, -0.3, 0]
    #   row2: b=0.1 -> [0.4];                    row3: b=0.5 -> [-0.6, -0.2] -> [-0.8, -0.2]
    # outcome RLOO: 1-0, 0-1 | 0-1, 1-0 on every valid token; returns = 2 * process + 3 * outcome
    expect = np.array([[3.4, 3.4, 0], [-3.6, -3.6, -3.0], [-2.2, 0, 0], [1.4, 2.6, 0]], np.float32)
    np.testing.assert_allclose(np.asarray(ret), expect, atol=1e-5)
    valid = expect[mask > 0]
    whitened = (expect - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(adv), whitened, atol=1e-5)


def test_prime_advantage_discount_and_coefficients_match_a_numpy_loop():
    rng = np.random.default_rng(3)
    b, r, n = 6, 5, 3
    lengths = rng.integers(1, r + 1, b)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
    rm = rng.normal(size=(b, r)).astype(np.float32) * mask
    scores = rng.integers(0, 2, b).astype(np.float32)
    outcome = np.zeros((b, r), np.float32)
    outcome[np.arange(b), lengths - 1] = scores
    groups = np.repeat(np.arange(b // n), n).astype(np.int32)
    gamma, cd, cg = 0.9, 0.5, 2.0
    _, ret = compute_prime_advantage(outcome, mask, groups, rm_scores=rm, reward_dpo_coef=cd, reward_gt_coef=cg,
                                     gamma=gamma)
    expect = np.zeros((b, r))
    for i in range(b):
        others = [j for j in range(b) if groups[j] == groups[i] and j != i]
        base = np.mean([rm[j, :lengths[j]].mean() for j in others])
        loo = scores[i] - np.mean([scores[j] for j in others])
        for t in range(lengths[i]):
            proc = sum(gamma ** (s - t) * (rm[i, s] - base) for s in range(t, lengths[i]))
            expect[i, t] = cd * proc + cg * gamma ** (lengths[i] - 1 - t) * loo
    np.testing.assert_allclose(np.asarray(ret), expect, rtol=1e-4, atol=1e-5)


def test_prime_is_a_registered_estimator_that_builds_a_prm_not_a_critic():
    entry = ADV_ESTIMATORS.entry("prime")
    assert entry.inputs == ("rm_scores",)
    assert set(entry.options) == {"reward_dpo_coef", "reward_gt_coef", "gamma"}
    assert needs_prm("prime") and not needs_critic("prime") and not needs_prm("grpo")
