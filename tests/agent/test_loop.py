"""The multi-turn loop with a scripted policy (a test double for the engine that emits fixed turns): masks,
log-prob alignment, turn limits and the token budget, checked exactly against the real chat templates (the Qwen3
tokenizer, SmolLM2's ChatML tokenizer as jaxrl loads it)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.agent.loop import AgentLoop, MultiTurnSettings
from jaxrl.agent.env import RetryAnswerEnv
from jaxrl.agent.tools import CalculatorTool, Tool
from jaxrl.rollout.base import RolloutOutput, SamplingParams

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


class ScriptedEngine:
    """Emits ``script[turn]`` (text, encoded, + the stop token) for every active row at each call; the log-prob
    of the token at position ``j`` of call ``t`` is ``-(t + 1) - j / 1000`` so alignment is checkable. Records the
    contexts it was given."""

    def __init__(self, tok, script, stop_id, max_emit=None):
        self.tok, self.script, self.stop_id, self.max_emit = tok, script, stop_id, max_emit
        self.eos_token_ids = (stop_id,)
        self.calls = []  # [(contexts, per-row emitted ids)]

    def generate(self, prompts, params, *, rng_seed=None):
        t = len(self.calls)
        text = self.script[min(t, len(self.script) - 1)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop_id]
        r = params.max_new_tokens
        ids = ids[:r]
        n = len(prompts)
        out_ids = np.zeros((n, r), np.int32)
        mask = np.zeros((n, r), np.int32)
        logp = np.zeros((n, r), np.float32)
        out_ids[:, : len(ids)] = ids
        mask[:, : len(ids)] = 1
        logp[:, : len(ids)] = -(t + 1) - np.arange(len(ids)) / 1000
        self.calls.append(([list(p) for p in prompts], ids))
        return RolloutOutput(prompt_ids=np.zeros((n, 1), np.int32), prompt_mask=np.ones((n, 1), np.int32),
                             response_ids=out_ids, response_mask=mask, rollout_log_probs=logp,
                             prompt_index=np.arange(n, dtype=np.int32))


@pytest.fixture(scope="module")
def qwen3(shared):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(shared / "tokenizers" / "qwen3"))


@pytest.fixture(scope="module")
def smollm2(shared):
    from jaxrl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(shared / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def _stop(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def _loop(tok, script, budget_settings=None, **kw):
    engine = ScriptedEngine(tok, script, _stop(tok))
    loop = AgentLoop(engine, tok, [CalculatorTool()], budget_settings or MultiTurnSettings(), max_prompt_length=4096,
                     **kw)
    return engine, loop


ROWS = [{"prompt": [{"role": "user", "content": "What is 3 + 4 times 2?"}]},
        {"prompt": "What is 12 / 4?"}]


def _segments(mask_row):
    """[(start, end, value)] runs of the mask."""
    out, start = [], 0
    for j in range(1, len(mask_row) + 1):
        if j == len(mask_row) or mask_row[j] != mask_row[start]:
            out.append((start, j, int(mask_row[start])))
            start = j
    return out


@pytest.mark.parametrize("which", ["qwen3", "smollm2"])
def test_tool_turns_masks_logprobs_and_template(which, request):
    tok = request.getfixturevalue(which)
    script = [f"Let me compute. {CALL % '3 + 4 * 2'}", "The answer is 11."]
    engine, loop = _loop(tok, script)
    res = loop.run(ROWS, SamplingParams(n=2, max_new_tokens=200), rng_seed=5)
    out = res.output
    assert out.response_ids.shape == (4, 200) and out.prompt_ids.shape[1] % 32 == 0
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    stop = _stop(tok)
    turn1, turn2 = engine.calls[0][1], engine.calls[1][1]
    for i in range(4):
        m = out.response_mask[i]
        segs = _segments(m)
        # model turn 1 (1), the tool message (0), model turn 2 (1), then padding (0)
        assert [v for _, _, v in segs] == [1, 0, 1, 0]
        (a0, a1, _), (b0, b1, _), (c0, c1, _), _ = segs
        assert out.response_ids[i, a0:a1].tolist() == turn1
        assert out.response_ids[i, c0:c1].tolist() == turn2
        np.testing.assert_allclose(out.rollout_log_probs[i, a0:a1], -1 - np.arange(a1 - a0) / 1000, rtol=1e-6)
        np.testing.assert_allclose(out.rollout_log_probs[i, c0:c1], -2 - np.arange(c1 - c0) / 1000, rtol=1e-6)
        assert not out.rollout_log_probs[i, b0:b1].any() and not out.rollout_log_probs[i, c1:].any()
        tool_text = tok.decode(out.response_ids[i, b0:b1].tolist(), skip_special_tokens=False)
        if which == "qwen3":  # Qwen3's template: tool results as a user turn in <tool_response> tags
            assert tool_text == ("\n<|im_start|>user\n<tool_response>\n11\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n")
        else:  # plain ChatML: a "tool" role turn
            assert tool_text == "\n<|im_start|>tool\n11<|im_end|>\n<|im_start|>assistant\n"
        assert out.response_ids[i, c1 - 1] == stop and (out.response_ids[i, c1:] == tok.pad_token_id).all()
        # the trainer attends to model and tool tokens alike, and to nothing after the last model token
        assert out.response_attention_mask[i, :c1].all() and not out.response_attention_mask[i, c1:].any()
    # the second call re-prefilled prompt + turn 1 + tool tokens exactly
    ctx2 = engine.calls[1][0][0]
    first = out.prompt_ids[0][out.prompt_mask[0].astype(bool)].tolist()
    assert ctx2 == first + out.response_ids[0, : np.flatnonzero(out.response_mask[0])[-1] - len(turn2) + 1].tolist()
    m = res.metrics
    assert m["multi_turn/num_turns/mean"] == 2 and m["multi_turn/tool_calls"] == 4
    assert m["multi_turn/tool_errors"] == 0 and m["multi_turn/finish/no_call"] == 4
    assert m["multi_turn/gen_calls"] == 2 and m["multi_turn/tool_time_s"] > 0


def test_chatml_conversation_equals_the_template_rendering(smollm2):
    """prompt + response decode to exactly what SmolLM2's template renders for the whole conversation."""
    tok = smollm2
    script = [CALL % "2 ** 10", "It is 1024."]
    engine, loop = _loop(tok, script)
    out = loop.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=300)).output
    end = np.flatnonzero(out.response_mask[0])[-1] + 1  # the last model token (pad == <|im_end|> here)
    full = out.prompt_ids[0][out.prompt_mask[0].astype(bool)].tolist() + out.response_ids[0][:end].tolist()
    from jaxrl.agent.chat import tools_system_text

    # the template ignores `tools`: they arrive as a system message
    assert not loop.codec.template_renders_tools
    msgs = [{"role": "system", "content": tools_system_text([CalculatorTool().schema])}, ROWS[0]["prompt"][0],
            {"role": "assistant", "content": script[0]}, {"role": "tool", "content": "1024"},
            {"role": "assistant", "content": script[1]}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")
    assert tok.decode(full, skip_special_tokens=False) == rendered[:-1]  # the template's newline after the end


def test_max_assistant_turns_stops_before_running_the_last_call(qwen3):
    script = [CALL % "1 + 1"]  # calls a tool every turn
    engine, loop = _loop(qwen3, script, MultiTurnSettings(max_assistant_turns=3))
    res = loop.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=500))
    segs = _segments(res.output.response_mask[0])
    assert [v for _, _, v in segs] == [1, 0, 1, 0, 1, 0]  # 3 model turns, 2 tool results, padding
    assert len(engine.calls) == 3
    m = res.metrics
    assert m["multi_turn/num_turns/max"] == 3 and m["multi_turn/tool_calls"] == 2
    assert m["multi_turn/finish/turn_limit"] == 1


def test_token_budget_is_exact(qwen3):
    script = [CALL % "1 + 1"]
    turn = len(qwen3(script[0], add_special_tokens=False)["input_ids"]) + 1
    engine0, loop0 = _loop(qwen3, script, MultiTurnSettings(max_assistant_turns=2))
    r0 = loop0.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=500)).output
    tool = int(_segments(r0.response_mask[0])[1][1] - _segments(r0.response_mask[0])[1][0])
    # budget ends inside the tool message: it is cut, no further model turn
    budget = turn + tool - 3
    engine, loop = _loop(qwen3, script)
    res = loop.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=budget))
    mask = res.output.response_mask[0]
    assert mask.tolist() == [1] * turn + [0] * (tool - 3) and len(engine.calls) == 1
    assert res.metrics["multi_turn/finish/budget"] == 1
    # budget ends inside the second model turn: the model's tokens are cut at the budget (log-probs too)
    budget = turn + tool + 4
    engine, loop = _loop(qwen3, script)
    res = loop.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=budget))
    mask, lp = res.output.response_mask[0], res.output.rollout_log_probs[0]
    assert mask.tolist() == [1] * turn + [0] * tool + [1] * 4
    np.testing.assert_allclose(lp[turn + tool:], -2 - np.arange(4) / 1000, rtol=1e-6)
    assert res.output.response_ids[0, turn + tool:].tolist() == engine.calls[1][1][:4]
    assert res.metrics["multi_turn/finish/budget"] == 1 and len(engine.calls) == 2


def test_tool_errors_reach_the_model_and_are_counted(qwen3):
    class Boom(Tool):
        default_schema = {"type": "function", "function": {"name": "boom", "parameters": {"type": "object"}}}

        def execute(self, arguments):
            raise RuntimeError("kaput")

    script = ['<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{"name": "nope"}</tool_call>'
              '<tool_call>not json</tool_call>', "done"]
    engine = ScriptedEngine(qwen3, script, _stop(qwen3))
    loop = AgentLoop(engine, qwen3, [Boom()], MultiTurnSettings(max_parallel_calls=2), max_prompt_length=4096)
    res = loop.run(ROWS[:1], SamplingParams(n=1, max_new_tokens=400))
    seg = [s for s in _segments(res.output.response_mask[0]) if s[2] == 0][0]
    text = qwen3.decode(res.output.response_ids[0, seg[0]:seg[1]].tolist())
    assert "RuntimeError: kaput" in text and "no tool named 'nope'" in text and "at most 2 tool calls" in text
    assert res.metrics["multi_turn/tool_errors"] == 3 and res.metrics["multi_turn/tool_calls"] == 2


def test_environment_user_turns(qwen3):
    script = ["I think it is 10.", "I think it is 11."]
    engine, loop = _loop(qwen3, script, MultiTurnSettings(max_user_turns=3), env_factory=RetryAnswerEnv)
    rows = [{"prompt": "3 + 4 * 2?", "reward_model": {"ground_truth": "11"}},
            {"prompt": "5 * 5?", "reward_model": {"ground_truth": "25"}}]
    res = loop.run(rows, SamplingParams(n=1, max_new_tokens=300))
    assert res.env_rewards.tolist() == [1.0, 0.0]
    segs0 = _segments(res.output.response_mask[0])
    assert [v for _, _, v in segs0] == [1, 0, 1, 0]
    user = qwen3.decode(res.output.response_ids[0, segs0[1][0]:segs0[1][1]].tolist())
    assert user.startswith("\n<|im_start|>user\nThat is not correct.") and user.endswith("<|im_start|>assistant\n")
    # row 1 never answers 25: 1 + 3 user turns, then the user-turn limit ends it
    assert res.metrics["multi_turn/finish/env_done"] == 1 and res.metrics["multi_turn/finish/turn_limit"] == 1
    assert [v for _, _, v in _segments(res.output.response_mask[1])][:8] == [1, 0] * 4


def test_prompt_over_the_limit_names_the_row(qwen3):
    engine = ScriptedEngine(qwen3, ["x"], _stop(qwen3))
    loop = AgentLoop(engine, qwen3, [CalculatorTool()], MultiTurnSettings(), max_prompt_length=50)
    with pytest.raises(ValueError, match="prompt 0 has .* tokens with the tool schemas, more than "
                                         "data.max_prompt_length=50"):
        loop.run(ROWS, SamplingParams(n=1, max_new_tokens=10))
