"""PRIME's prompt filter (verl's recipe/prime: accuracy band, truncation, oversampling) on hand-made batches."""

from __future__ import annotations

import numpy as np

from jaxrl.batch import RLBatch
from jaxrl.experience import PrimeFilter, prime_select
from jaxrl.rewards.shaping import accuracy_band_groups

# 5 groups of 2: mean labels 1.0, 0.5, 0.0, 0.5, 0.25; group 3 has a response at the length limit (R = 6)
ACC = np.array([1, 1, 1, 0, 0, 0, 0, 1, 0.5, 0], np.float32)
GROUPS = np.repeat(np.arange(5), 2).astype(np.int32)
LENGTHS = np.array([2, 3, 4, 1, 2, 2, 6, 3, 2, 2])


def test_groups_in_the_band_come_first_then_the_others_in_batch_order():
    rows, passing = accuracy_band_groups(ACC, GROUPS, LENGTHS, keep=3, filter_accuracy=True, lower=0.2, upper=0.8,
                                         filter_truncate=False, max_length=6)
    assert passing == 3  # groups 1, 3, 4
    np.testing.assert_array_equal(rows, [2, 3, 6, 7, 8, 9])
    rows, passing = accuracy_band_groups(ACC, GROUPS, LENGTHS, keep=3, filter_accuracy=True, lower=0.2, upper=0.8,
                                         filter_truncate=True, max_length=6)
    assert passing == 2  # group 3 reaches max_length - 1: it falls behind, group 0 (first failing) fills in
    np.testing.assert_array_equal(rows, [0, 1, 2, 3, 8, 9])
    rows, passing = accuracy_band_groups(ACC, GROUPS, LENGTHS, keep=2, filter_accuracy=False, lower=0.2, upper=0.8,
                                         filter_truncate=False, max_length=6)
    assert passing == 5
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])


def test_prime_select_keeps_whole_groups_and_renumbers_them():
    n, r = 10, 6
    mask = (np.arange(r)[None] < LENGTHS[:, None]).astype(np.int32)
    batch = RLBatch(prompt_ids=np.ones((n, 3), np.int32), prompt_mask=np.ones((n, 3), np.int32),
                    response_ids=mask * 5, response_mask=mask, group_ids=GROUPS, acc=ACC,
                    token_level_scores=np.zeros((n, r), np.float32))
    metrics = {}
    pf = PrimeFilter(keep=2, filter_accuracy=True, lower=0.2, upper=0.8, filter_truncate=True)
    kept = prime_select(batch, {"seq_reward": ACC * 2 - 1}, pf, metrics)
    np.testing.assert_array_equal(kept.acc, ACC[[2, 3, 8, 9]])
    np.testing.assert_array_equal(kept.group_ids, [0, 0, 1, 1])
    assert metrics["acc"] == float(ACC.mean()) and metrics["train/num_groups_in_band"] == 2
    assert metrics["train/score_all_mean"] == float((ACC * 2 - 1).mean())
