"""The experience maker with ``multi_turn.enable``: the round comes from the agent loop (not ``engine.generate``),
its ``multi_turn/*`` metrics join the round's, its environment rewards are added to the reward function's scores,
and only model tokens (mask 1) reach the reward function."""

from __future__ import annotations

import numpy as np

from jaxrl.agent.loop import MultiTurnOutput
from jaxrl.experience import ExperienceMaker
from jaxrl.config.loader import load_config
from jaxrl.rollout.base import RolloutOutput
from tests.test_experience import R, LetterTokenizer, Prompts, ScriptedEngine, ids, reward  # noqa: F401


class FakeAgent:
    """Response "ab" + 1 tool token (mask 0, the letter z) for prompt 0, "xy" for prompt 1; env reward 0.5 on row 0."""

    def __init__(self):
        self.calls = []

    def run(self, rows, sp, *, prompt_key):
        self.calls.append(([r[prompt_key] for r in rows], sp))
        n = len(rows) * sp.n
        resp = np.zeros((n, R), np.int32)
        mask = np.zeros((n, R), np.int32)
        for i in range(n):
            p = i // sp.n
            resp[i, :3] = ids("azb") if p == 0 else ids("xyz")
            mask[i, :3] = [1, 0, 1] if p == 0 else [1, 1, 0]
        out = RolloutOutput(prompt_ids=np.ones((n, 2), np.int32), prompt_mask=np.ones((n, 2), np.int32),
                            response_ids=resp, response_mask=mask, rollout_log_probs=-0.5 * mask.astype(np.float32),
                            prompt_index=np.repeat(np.arange(len(rows)), sp.n).astype(np.int32),
                            response_attention_mask=(resp != 0).astype(np.int32))
        env = np.zeros(n, np.float32)
        env[0] = 0.5
        return MultiTurnOutput(out, env, {"multi_turn/tool_calls": 2.0})


def test_multi_turn_round_uses_the_agent_loop(reward):
    cfg = load_config(None, ["actor_rollout_ref.rollout.n=2"])
    engine, agent = ScriptedEngine({}), FakeAgent()
    mk = ExperienceMaker(rollout=engine, tokenizer=LetterTokenizer(), reward=reward(),
                         rollout_cfg=cfg.actor_rollout_ref.rollout, max_new_tokens=R, algorithm_cfg=cfg.algorithm,
                         train_batch_size=2, prompt_key="prompt", agent=agent)
    batch, metrics = mk.make_experience(Prompts([0, 1]), seed=9, timings={})
    assert engine.calls == [] and agent.calls[0][0] == ["p0", "p1"] and agent.calls[0][1].seed == 9
    assert metrics["multi_turn/tool_calls"] == 2.0
    # model text "ab" (the tool token z is masked out) matches TRUTH[0] = "ab": 1 (+0.5 env on row 0); "xy" too
    np.testing.assert_allclose(batch.token_level_scores.sum(-1), [1.5, 1.0, 1.0, 1.0])
    assert batch.token_level_scores[0, 2] == 1.5  # on the last model token, past the masked tool token
    assert batch.token_level_scores[2, 1] == 1.0
    # the trainer's forward attends to the tool token (mask 0 for the loss only)
    np.testing.assert_array_equal(batch.attention_mask()[0, -R:], [1, 1, 1, 0])
    np.testing.assert_array_equal(batch.response_mask[0], [1, 0, 1, 0])
