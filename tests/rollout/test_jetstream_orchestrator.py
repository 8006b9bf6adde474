"""JetStream's own orchestrator (``google-jetstream`` 0.2.2: prefill / transfer / generate / detokenize threads and
the ``LLMOrchestrator`` servicer) driving jaxrl's :class:`JetStreamEngine` returns the engine's tokens.

Needs the ``jetstream`` extra (``bash scripts/setup_jetstream.sh``, then run this file with
``.venv-jetstream/bin/python``). Without it every test here is reported as skipped with the reason; with
``JAXRL_REQUIRE_JETSTREAM=1`` (what ``.ci/run`` sets) a missing or broken install fails instead.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from jaxrl.rollout import JaxSampler, SamplingParams, jetstream_compat
from jaxrl.rollout.jetstream_engine import JetStreamEngine
from tests.rollout.test_jetstream_engine import BOS, EOS, PAD, _model

if not jetstream_compat.AVAILABLE:
    if os.environ.get("JAXRL_REQUIRE_JETSTREAM"):
        raise RuntimeError(f"JAXRL_REQUIRE_JETSTREAM is set but {jetstream_compat.IMPORT_ERROR}")
    pytest.skip(f"not run: {jetstream_compat.IMPORT_ERROR}", allow_module_level=True)

from jaxrl.rollout.jetstream_orchestrator import serve  # noqa: E402

# Token prompts without BOS: JetStream's orchestrator prepends the tokenizer's bos id (is_bos for a new request).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26], [33, 9, 50, 51, 3],
           [44, 45, 46], [7, 8]]
MAX_TOKENS = 10


@pytest.fixture(autouse=True)
def _restore_root_logger():
    """JetStream's orchestrator module sets the root logger to DEBUG with a stdout handler when imported."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)


def _serve(engine, prompts, max_tokens):
    with serve(engine) as client:
        return client.decode(prompts, max_tokens=max_tokens)


def _expected(sampler, prompts, max_tokens, stops):
    """The embedded sampler's greedy responses to ``[BOS] + prompt``, cut before the first stop id (JetStream
    streams tokens up to, not including, a stop token)."""
    out = sampler.generate([[BOS] + p for p in prompts],
                           SamplingParams(do_sample=False, max_new_tokens=max_tokens, stop_token_ids=stops))
    rows = []
    for ids, n in zip(out.response_ids, out.response_lengths):
        ids = [int(t) for t in ids[:n]]
        cut = next((i for i, t in enumerate(ids) if t in stops or t == EOS), len(ids))
        rows.append(ids[:cut])
    return rows


def test_the_engine_is_a_jetstream_engine():
    from jetstream.engine import engine_api, tokenizer_api

    cfg, graphdef, params = _model()
    engine = JetStreamEngine(cfg, graphdef, params, pad_token_id=PAD, eos_token_ids=(EOS,), max_prefill_length=16,
                             max_target_length=32, max_concurrent_decodes=2)
    assert isinstance(engine, engine_api.Engine)
    assert isinstance(engine.build_tokenizer(engine.get_tokenizer()), tokenizer_api.Tokenizer)
    result = engine.generate(engine.load_params(), engine.init_decode_state())[1]
    assert isinstance(result, engine_api.ResultTokens)  # JetStream's own class, read by its detokenize thread


def test_orchestrator_serves_more_requests_than_slots_with_the_engines_tokens():
    """6 concurrent requests on 4 slots: JetStream's threads prefill, insert, generate and detokenize; every request
    streams the greedy tokens the embedded sampler gives (up to its stop token or max_tokens)."""
    cfg, graphdef, params = _model()
    sampler = JaxSampler(cfg, graphdef, params, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16)
    plain = _expected(sampler, PROMPTS, MAX_TOKENS, (EOS,))
    stops = tuple(sorted({EOS, plain[0][3], plain[3][5]}))  # mid-response tokens: some requests end early
    engine = JetStreamEngine(cfg, graphdef, params, pad_token_id=PAD, eos_token_ids=stops, max_prefill_length=16,
                             max_target_length=32, max_concurrent_decodes=4)
    expected = _expected(sampler, PROMPTS, MAX_TOKENS, stops)
    assert len({len(r) for r in expected}) > 1 and any(len(r) == MAX_TOKENS for r in expected)  # ragged, some stop
    got = _serve(engine, PROMPTS, MAX_TOKENS)
    assert got == expected
    assert engine.num_prefills == len(PROMPTS) and engine.num_inserts == len(PROMPTS)


def test_orchestrator_serves_stories260k(shared):
    """The real stories260K model: JetStream's orchestrator returns the embedded sampler's greedy tokens."""
    from flax import nnx

    from jaxrl.models import load_pretrained

    pre = load_pretrained(str(shared / "models" / "stories260K"))
    graphdef, params = nnx.split(pre.model)
    eos = tuple(pre.config.eos_token_id)
    engine = JetStreamEngine(pre.config, graphdef, params, pad_token_id=0, eos_token_ids=eos, max_prefill_length=16,
                             max_target_length=64, max_concurrent_decodes=2, tokenizer=pre.tokenizer)
    sampler = JaxSampler(pre.config, graphdef, params, pad_token_id=0, eos_token_ids=eos, max_prompt_length=16)
    prompts = [[403, 407, 261, 378], [76, 44, 378, 500, 300], [261]]
    got = _serve(engine, prompts, 40)
    assert got == _expected(sampler, prompts, 40, eos)
    assert all(len(r) > 5 for r in got)
    text = pre.tokenizer.decode(got[0])
    assert np.isscalar(text) and len(text.split()) > 3  # real TinyStories words
