"""A Qwen3-template multi-turn rollout on a tiny random Qwen3 with the real Qwen3 tokenizer and the real embedded
sampler: the tool call is parsed, its result rendered by Qwen3's template with mask 0, and the real model's next
turn keeps log-probs that equal a plain forward pass over the whole conversation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.agent.loop import AgentLoop, MultiTurnSettings
from jaxrl.agent.tools import CalculatorTool
from jaxrl.batch import RLBatch
from jaxrl.models.decoder import Decoder
from jaxrl.rollout import JaxSampler, SamplingParams
from tests.helpers import tiny_model_config

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


class FirstTurnScripted:
    """Turn 1 is a fixed tool call (a random model never writes one); every later turn is the real sampler's."""

    def __init__(self, sampler, tok):
        self.sampler, self.tok, self.calls = sampler, tok, 0
        self.eos_token_ids = sampler.eos_token_ids

    def generate(self, prompts, params, *, rng_seed=None):
        self.calls += 1
        if self.calls > 1:
            return self.sampler.generate(prompts, params, rng_seed=rng_seed)
        from tests.agent.test_loop import ScriptedEngine

        return ScriptedEngine(self.tok, [CALL], self.eos_token_ids[0]).generate(prompts, params)


def test_qwen3_tool_call_parsed_masked_and_log_probs_aligned(shared):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shared / "tokenizers" / "qwen3"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = tiny_model_config("qwen3", vocab_size=151936, max_position_embeddings=1024, eos_token_id=(im_end,),
                            bos_token_id=None, pad_token_id=tok.pad_token_id)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    sampler = JaxSampler.from_model(model, cfg, pad_token_id=tok.pad_token_id, eos_token_ids=(im_end,),
                                    max_prompt_length=1024)
    engine = FirstTurnScripted(sampler, tok)
    loop = AgentLoop(engine, tok, [CalculatorTool()], MultiTurnSettings(), max_prompt_length=512)
    assert loop.codec.template_renders_tools  # Qwen3's template puts the schemas in its own system block
    res = loop.run([{"prompt": "What is 6 times 7?"}], SamplingParams(n=1, max_new_tokens=96, do_sample=False))
    out = res.output
    mask = out.response_mask[0]
    turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [im_end]
    a = len(turn1)
    assert mask[:a].all() and out.response_ids[0, :a].tolist() == turn1
    b = a + int(np.argmax(mask[a:] == 1))  # first token of the real model's turn
    tool_text = tok.decode(out.response_ids[0, a:b].tolist(), skip_special_tokens=False)
    assert tool_text == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert not mask[a:b].any() and not out.rollout_log_probs[0, a:b].any()
    assert res.metrics["multi_turn/tool_calls"] == 1 and res.metrics["multi_turn/tool_errors"] == 0
    # the real turn: greedy tokens whose rollout log-probs equal a forward over the trainer's own inputs
    # (RLBatch: left-padded prompt + response, attention on model and tool tokens, positions from that mask)
    end = b + int(mask[b:].sum())
    assert end > b and mask[b:end].all()
    assert out.response_attention_mask[0, :end].all() and not out.response_attention_mask[0, end:].any()
    batch = RLBatch(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, response_ids=out.response_ids,
                    response_mask=out.response_mask, group_ids=out.prompt_index,
                    response_attention_mask=out.response_attention_mask)
    p = batch.prompt_width
    logits = model(jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()), jnp.asarray(batch.attention_mask()))[0]
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    for t in range(b, end):
        tokid = out.response_ids[0, t]
        assert tokid == int(np.argmax(lp[p + t - 1]))  # greedy
        assert abs(out.rollout_log_probs[0, t] - lp[p + t - 1, tokid]) < 2e-4
    # with the loss mask as attention mask (the tool tokens hidden) the same tokens would score differently
    hidden = dataclasses.replace(batch, response_attention_mask=None)
    logits2 = model(jnp.asarray(hidden.input_ids()), jnp.asarray(hidden.positions()),
                    jnp.asarray(hidden.attention_mask()))[0]
    lp2 = np.asarray(jax.nn.log_softmax(logits2[0].astype(jnp.float32), axis=-1))
    diffs = [abs(out.rollout_log_probs[0, t] - lp2[p + t - 1, out.response_ids[0, t]]) for t in range(b, end)]
    assert max(diffs) > 1e-3
