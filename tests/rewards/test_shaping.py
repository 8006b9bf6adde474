"""DAPO reward shaping: overlong punishment and the dynamic-sampling group filter (numpy references)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.rewards.shaping import groups_with_signal, overlong_penalty


def test_overlong_penalty_matches_dapo_formula():
    lengths = np.array([0, 10, 32, 33, 40, 48])
    got = overlong_penalty(lengths, max_response_length=48, buffer_len=16, penalty_factor=0.5)
    # expected length 32; beyond it the penalty falls linearly to -0.5 at 48 tokens
    want = np.array([0, 0, 0, -0.5 / 16, -0.5 * 8 / 16, -0.5])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == np.float32


@pytest.mark.parametrize("kw", [dict(buffer_len=0), dict(buffer_len=49), dict(penalty_factor=-1.0)])
def test_overlong_penalty_rejects_bad_settings(kw):
    args = dict(max_response_length=48, buffer_len=16, penalty_factor=1.0) | kw
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(np.array([1]), **args)


def test_groups_with_signal_drops_flat_groups_and_singletons():
    metric = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0.5])
    groups = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3])
    keep = groups_with_signal(metric, groups)
    np.testing.assert_array_equal(keep, [False, False, False, True, True, False, False, False, False])
