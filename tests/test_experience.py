"""The experience maker (phases gen + reward): a round with a scripted rollout engine and the real reward manager
(in-process), DAPO's dynamic sampling, ReMax's greedy baseline, the overlong penalty and a reward model's scores.

The engine is a test double (the unit is what the maker does with its output: the embedded sampler is tested in
tests/rollout); the tokenizer maps ids to letters; the reward manager, its scoring and shaping are the real ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.config.loader import load_config
from jaxrl.data.pipeline import PromptBatch
from jaxrl.experience import ExperienceMaker, place_scores_on_last_token
from jaxrl.rewards.manager import OverlongBuffer, RewardManager
from jaxrl.rollout.base import RolloutOutput
from jaxrl.workers.reward_model import RewardModelOutput

R = 4  # response width (max_new_tokens)
OFFSET = 3  # token id of "a"


def ids(text: str) -> list[int]:
    return [OFFSET + ord(ch) - ord("a") for ch in text]


class LetterTokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(ord("a") + t - OFFSET) for t in s) for s in seqs]


class ScriptedEngine:
    """Prompt ``[p]`` -> the responses ``sampled[p]`` (``n`` of them), or ``greedy[p]`` for a greedy call."""

    def __init__(self, sampled: dict[int, list[str]], greedy: dict[int, str] | None = None):
        self.sampled, self.greedy, self.calls = sampled, greedy or {}, []

    def generate(self, prompt_ids, sp):
        self.calls.append(sp)
        texts = [self.greedy[p[0]] if not sp.do_sample else self.sampled[p[0]][j]
                 for p in prompt_ids for j in range(sp.n)]
        n = len(texts)
        response_ids = np.zeros((n, R), np.int32)
        response_mask = np.zeros((n, R), np.int32)
        for i, t in enumerate(texts):
            response_ids[i, : len(t)], response_mask[i, : len(t)] = ids(t), 1
        prompt_ids_arr = np.repeat(np.asarray([[0, p[0]] for p in prompt_ids], np.int32), sp.n, axis=0)
        return RolloutOutput(
            prompt_ids=prompt_ids_arr, prompt_mask=np.tile(np.array([0, 1], np.int32), (n, 1)),
            response_ids=response_ids, response_mask=response_mask,
            rollout_log_probs=-0.5 * response_mask.astype(np.float32),
            prompt_index=np.repeat(np.arange(len(prompt_ids)), sp.n).astype(np.int32),
        )


class Prompts:
    """A prompt source: each ``next_batch`` is the next list of prompt numbers; row ``p``'s answer is TRUTH[p]."""

    def __init__(self, *batches: list[int]):
        self.batches = list(batches)

    def next_batch(self) -> PromptBatch:
        ps = self.batches.pop(0)
        rows = [{"data_source": "letters", "reward_model": {"ground_truth": TRUTH[p]}, "prompt": f"p{p}"} for p in ps]
        return PromptBatch(prompt_ids=[[p] for p in ps], rows=rows, indices=list(ps))


TRUTH = {0: "ab", 1: "xy", 2: "abc", 3: "d", 4: "q"}


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else -1.0


@pytest.fixture
def reward():
    made = []

    def make(**kw):
        made.append(RewardManager(exact_match, timeout_s=5.0, num_workers=0, **kw))  # in-process scoring
        return made[-1]

    yield make
    for m in made:
        m.close()


def maker(engine, reward, overrides=(), reward_model=None, train_batch_size=2):
    cfg = load_config(None, ["actor_rollout_ref.rollout.n=2", *overrides])
    return ExperienceMaker(
        rollout=engine, tokenizer=LetterTokenizer(), reward=reward, rollout_cfg=cfg.actor_rollout_ref.rollout,
        max_new_tokens=R, algorithm_cfg=cfg.algorithm, train_batch_size=train_batch_size, reward_model=reward_model,
        reward_model_combine=cfg.reward_model.combine, prompt_key=cfg.data.prompt_key,
    )


def test_one_round_scores_each_response_on_its_last_token(reward):
    engine = ScriptedEngine({0: ["ab", "abcd"], 1: ["c", "xy"]})
    timings: dict[str, float] = {}
    batch, metrics = maker(engine, reward()).make_experience(Prompts([0, 1]), seed=123, timings=timings)

    assert len(engine.calls) == 1 and engine.calls[0].seed == 123 and engine.calls[0].n == 2
    assert engine.calls[0].max_new_tokens == R
    expected = np.zeros((4, R), np.float32)
    expected[0, 1], expected[1, 3], expected[2, 0], expected[3, 1] = 1.0, -1.0, -1.0, 1.0
    np.testing.assert_array_equal(batch.token_level_scores, expected)
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.rollout_log_probs, -0.5 * batch.response_mask)
    assert batch.reward_baselines is None
    assert metrics == {"reward/num_errors": 0, "reward/num_timeouts": 0}
    assert set(timings) == {"gen", "reward"}


def match_with_extras(data_source, solution_str, ground_truth, extra_info=None):
    """A reward with verl-style extra outputs: two numeric ones, a text one, and no value for an empty response."""
    out = {"score": 1.0 if solution_str == ground_truth else -1.0, "acc": float(solution_str == ground_truth),
           "starts_a": solution_str.startswith("a"), "pred": solution_str}
    if not solution_str.startswith(("a", "x")):
        out["long"] = None
    else:
        out["long"] = float(len(solution_str) > 2)
    return out


def test_numeric_reward_extras_are_logged_as_reward_key_mean():
    mgr = RewardManager(match_with_extras, timeout_s=5.0, num_workers=0)
    try:
        engine = ScriptedEngine({0: ["ab", "abcd"], 1: ["c", "xy"]})
        _, metrics = maker(engine, mgr).make_experience(Prompts([0, 1]), seed=0, timings={})
        assert metrics["reward/acc/mean"] == pytest.approx(0.5)
        assert metrics["reward/starts_a/mean"] == pytest.approx(0.5)  # bools count as 0 / 1
        assert metrics["reward/long/mean"] == pytest.approx(1 / 3)  # "c" gave None: out of the mean
        assert "reward/pred/mean" not in metrics and "reward/score/mean" not in metrics
        # with dynamic sampling: the mean over every generated response, dropped groups included
        engine = ScriptedEngine({0: ["ab", "ab"], 1: ["xy", "x"], 2: ["a", "abc"]})
        mk = maker(engine, mgr, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"])
        _, metrics = mk.make_experience(Prompts([0, 1], [2, 2]), seed=0, timings={})
        assert metrics["train/num_gen_batches"] == 2
        # round 1: ab ab (prompt 0, flat: dropped) xy x; round 2: a abc a abc -> 5 of 8 right
        assert metrics["reward/acc/mean"] == pytest.approx(5 / 8)
    finally:
        mgr.close()


def test_overlong_penalty_is_added_before_the_score_is_placed(reward):
    engine = ScriptedEngine({0: ["ab", "abcd"], 1: ["abc", "xy"]})
    mgr = reward(overlong=OverlongBuffer(len=2, penalty_factor=1.0, log=True))
    batch, metrics = maker(engine, mgr).make_experience(Prompts([0, 1]), seed=0, timings={})
    # expected length R - len = 2: 3 tokens cost 0.5, 4 tokens cost 1 (DAPO Eq. 13)
    np.testing.assert_allclose(batch.token_level_scores.sum(-1), [1.0, -2.0, -1.5, 1.0])
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-1.5 / 4)
    assert metrics["reward/overlong_ratio"] == 0.5


def test_dynamic_sampling_keeps_only_groups_with_signal_up_to_the_batch_size(reward):
    # round 1: prompt 0 all right (flat), prompt 1 mixed; round 2: prompts 2 and 4 mixed -> 3 kept, 2 trained on
    engine = ScriptedEngine({0: ["ab", "ab"], 1: ["xy", "x"], 2: ["a", "abc"], 4: ["q", "r"]})
    mk = maker(engine, reward(), ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"])
    timings: dict[str, float] = {}
    batch, metrics = mk.make_experience(Prompts([0, 1], [2, 4], [3, 3]), seed=5, timings=timings)

    assert len(engine.calls) == 2 and {sp.seed for sp in engine.calls} == {5}
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/num_dropped_groups"] == 1
    assert batch.size == 4 and len(np.unique(batch.group_ids)) == 2
    assert batch.prompt_ids[:, -1].tolist() == [1, 1, 2, 2]  # prompts 1 and 2; prompt 4 is past the batch size
    for g in np.unique(batch.group_ids):
        assert sorted(batch.token_level_scores[batch.group_ids == g].sum(-1).tolist()) == [-1.0, 1.0]


def test_dynamic_sampling_stops_at_max_num_gen_batches_and_trains_on_the_last_round(reward):
    engine = ScriptedEngine({0: ["ab", "ab"], 3: ["x", "y"]})
    mk = maker(engine, reward(),
               ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"])
    batch, metrics = mk.make_experience(Prompts([0], [3]), seed=0, timings={})
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/num_dropped_groups"] == 2
    assert batch.prompt_ids[:, -1].tolist() == [3, 3]  # every group flat: the last round, as it was


def test_remax_baseline_is_the_greedy_response_score_of_each_prompt(reward):
    engine = ScriptedEngine({0: ["ab", "b"], 1: ["xy", "y"]}, greedy={0: "ab", 1: "zz"})
    timings: dict[str, float] = {}
    batch, _ = maker(engine, reward(), ["algorithm.adv_estimator=remax"]).make_experience(
        Prompts([0, 1]), seed=9, timings=timings)
    greedy = engine.calls[1]
    assert greedy.n == 1 and not greedy.do_sample and greedy.seed == 9
    np.testing.assert_array_equal(batch.reward_baselines, [1.0, 1.0, -1.0, -1.0])
    assert "gen_max" in timings


class FixedRM:
    retokenizes = False

    def __init__(self, scores):
        self.scores = np.asarray(scores, np.float32)

    def score(self, batch, raw_prompts=None):
        return RewardModelOutput(self.scores[: batch.size], num_truncated=0)


def test_reward_model_scores_are_summed_with_the_rule_reward(reward):
    engine = ScriptedEngine({0: ["ab", "b"], 1: ["xy", "y"]})
    mk = maker(engine, reward(), ["reward_model.combine=sum"], reward_model=FixedRM([0.5, 0.25, -0.5, 2.0]))
    batch, metrics = mk.make_experience(Prompts([0, 1]), seed=0, timings={})
    np.testing.assert_allclose(batch.token_level_scores.sum(-1), [1.5, -0.75, 0.5, 1.0])
    assert metrics["reward/rm_score/max"] == 2.0 and metrics["reward/rule_score/min"] == -1.0


def test_place_scores_on_last_token_leaves_empty_responses_unscored():
    mask = np.array([[1, 1, 0], [0, 0, 0]])
    out = place_scores_on_last_token(np.array([2.0, 3.0], np.float32), mask)
    np.testing.assert_array_equal(out, [[0, 2.0, 0], [0, 0, 0]])
