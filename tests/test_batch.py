"""RLBatch: derived arrays, row selection and concatenation across generation rounds."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.batch import RLBatch, concat_batches


def make(p, n, r=3, group_base=0, score=0.0):
    mask = np.ones((n, p), np.int32)
    mask[0, 0] = 0  # one left-padded row
    return RLBatch(
        prompt_ids=np.arange(n * p, dtype=np.int32).reshape(n, p) * mask + 1,
        prompt_mask=mask,
        response_ids=np.full((n, r), 7, np.int32),
        response_mask=np.ones((n, r), np.int32),
        group_ids=np.repeat(np.arange(n // 2), 2).astype(np.int32) + group_base,
        token_level_scores=np.full((n, r), score, np.float32),
    )


def test_positions_follow_left_padding():
    b = make(p=3, n=2)
    np.testing.assert_array_equal(b.positions()[0], [0, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(b.positions()[1], [0, 1, 2, 3, 4, 5])
    assert b.input_ids().shape == (2, 6) and b.attention_mask()[0, 0] == 0


def test_concat_left_pads_prompts_and_keeps_groups_apart():
    a, b = make(p=2, n=4, score=1.0), make(p=4, n=2, score=2.0)
    c = concat_batches([a, b])
    assert c.size == 6 and c.prompt_width == 4
    # a's prompts are shifted right by two masked slots; b's are unchanged
    np.testing.assert_array_equal(c.prompt_mask[:4, :2], 0)
    np.testing.assert_array_equal(c.prompt_ids[:4, 2:], a.prompt_ids)
    np.testing.assert_array_equal(c.prompt_ids[4:], b.prompt_ids)
    np.testing.assert_array_equal(c.group_ids, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(c.token_level_scores[:, 0], [1, 1, 1, 1, 2, 2])
    # the same token sequence gets the same positions after re-padding
    np.testing.assert_array_equal(c.positions()[1][2:], a.positions()[1])
    assert c.old_log_probs is None


def test_concat_rejects_mismatched_fields_and_widths():
    a, b = make(p=2, n=2), make(p=2, n=2)
    b.old_log_probs = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="old_log_probs"):
        concat_batches([a, b])
    with pytest.raises(ValueError, match="response widths"):
        concat_batches([make(p=2, n=2, r=3), make(p=2, n=2, r=4)])
    with pytest.raises(ValueError):
        concat_batches([])


def test_select_takes_rows_of_every_field():
    b = make(p=2, n=4)
    s = b.select(np.array([3, 1]))
    np.testing.assert_array_equal(s.group_ids, [1, 0])
    np.testing.assert_array_equal(s.prompt_ids, b.prompt_ids[[3, 1]])
