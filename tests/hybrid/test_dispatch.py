"""Data-parallel dispatch for a rollout group of independent engines (vLLM per host): the split of a generate call's
prompts, the merge of the members' outputs, and the driver's stand-in doing both over a fake group whose members
run a seeded numpy engine (the unit under test is the dispatch: what each member is asked, what the driver gets)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.hybrid.dispatch import merge_outputs, split_prompts
from jaxrl.rollout.base import RolloutOutput, SamplingParams

PAD = 0


@pytest.mark.parametrize("prompts, parts, expected", [
    (8, 2, [(0, 4), (4, 8)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
    (0, 1, [(0, 0)]),
])
def test_split_prompts_is_contiguous_and_balanced(prompts, parts, expected):
    assert split_prompts(prompts, parts) == expected


def test_split_prompts_refuses_no_members():
    with pytest.raises(ValueError, match=r"parts=0"):
        split_prompts(4, 0)


def fake_generate(prompts, sp: SamplingParams, first_row: int = 0) -> RolloutOutput:
    """A seeded engine: prompts left-padded to their own longest (widths differ per share, as vLLM's buckets);
    row r's tokens drawn from a generator seeded by (seed, first_row + r) and cut at its first 2 (eos)."""
    width = max(len(p) for p in prompts)
    rows, r = len(prompts) * sp.n, sp.max_new_tokens
    pid, pm = np.full((rows, width), PAD, np.int32), np.zeros((rows, width), np.int32)
    rid, rm = np.full((rows, r), PAD, np.int32), np.zeros((rows, r), np.int32)
    lp = np.zeros((rows, r), np.float32)
    for row in range(rows):
        p = prompts[row // sp.n]
        pid[row, width - len(p):], pm[row, width - len(p):] = p, 1
        g = np.random.default_rng([sp.seed, first_row + row])
        toks = g.integers(2, 9, r)
        m = int(np.argmax(toks == 2)) + 1 if 2 in toks else r
        rid[row, :m], rm[row, :m], lp[row, :m] = toks[:m], 1, -g.random(m)
    return RolloutOutput(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm, rollout_log_probs=lp,
                         prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), sp.n))


class SplitGroup:
    """A rollout group of independent members (``own_world=False``) running :func:`fake_generate`."""

    own_world = False

    def __init__(self, members: int):
        self.members, self.asked = [object()] * members, []

    def call_each(self, method, args, timeout_s=None):
        assert method == "generate" and len(args) <= len(self.members)
        self.asked.append(args)
        return [fake_generate(*a) for a in args]


PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1, 12], [1, 13, 14, 15, 16, 17, 18], [1, 19, 20]]


@pytest.mark.parametrize("members", [2, 4, 7])
def test_the_split_generate_equals_one_engine_on_the_whole_batch(members):
    from jaxrl.hybrid.proxies import RemoteRollout

    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    group = SplitGroup(members)
    engine = RemoteRollout(group, {"engine": "vllm", "mesh": "vLLM per host", "eos_token_ids": (2,),
                                   "pad_token_id": PAD})
    merged, whole = engine.generate(PROMPTS, sp), fake_generate(PROMPTS, sp)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_log_probs", "prompt_index"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole, name), err_msg=name)
    (asked,) = group.asked
    shares = [(a, b) for a, b in split_prompts(len(PROMPTS), members) if b > a]
    assert len(asked) == len(shares) == min(members, len(PROMPTS))  # members without prompts are not called
    assert [a[2] for a in asked] == [a * sp.n for a, _ in shares]  # each share's first row in the whole batch
    assert [len(a[0]) for a in asked] == [b - a for a, b in shares]


def test_a_group_that_is_one_world_gets_the_call_whole():
    from jaxrl.hybrid.proxies import RemoteRollout

    class World(SplitGroup):
        own_world = True

        def call(self, method, *args, timeout_s=None):
            return fake_generate(*args)

    sp = SamplingParams(n=1, max_new_tokens=4, seed=1)
    engine = RemoteRollout(World(2), {"engine": "jax", "mesh": "m", "eos_token_ids": (2,)})
    assert not engine.split
    np.testing.assert_array_equal(engine.generate(PROMPTS, sp).response_ids, fake_generate(PROMPTS, sp).response_ids)


def test_merge_refuses_mismatched_members():
    sp = SamplingParams(n=1, max_new_tokens=4, seed=1)
    a = fake_generate(PROMPTS[:2], sp)
    b = fake_generate(PROMPTS[2:], SamplingParams(n=1, max_new_tokens=5, seed=1))
    with pytest.raises(ValueError, match=r"response widths differ \(\[4, 5\]\)"):
        merge_outputs([a, b], first_prompts=[0, 2], pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"2 outputs for 1 members"):
        merge_outputs([a, a], first_prompts=[0], pad_token_id=PAD)
