"""Serve a :class:`~jaxrl.rollout.jetstream_engine.JetStreamEngine` with JetStream's own orchestrator (the
``jetstream`` extra: ``bash scripts/setup_jetstream.sh``).

The trainer never imports this module (its rollout is :class:`~jaxrl.rollout.jetstream_rollout.JetStreamRollout`);
it exists so JetStream's ``orchestrator.Driver`` (prefill / transfer / generate / detokenize threads) and its gRPC
servicer ``LLMOrchestrator`` can serve a jaxrl policy, and so a test can check they return the engine's tokens.

JetStream is loaded through :func:`jaxrl.rollout.jetstream_compat.load_orchestrator` (the one place with the
documented shims). Importing JetStream's orchestrator sets the root logger to DEBUG with a stdout handler (its
module does that at import).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from jaxrl.rollout.jetstream_compat import load_orchestrator

__all__ = ["decode_tokens", "start_driver"]


def start_driver(engine, *, params=None):
    """A running JetStream ``orchestrator.Driver`` with ``engine`` as its one prefill and one generate engine
    (interleaved mode: both on the same devices, no prefix transfer). Stop it with ``driver.stop()``.

    Args:
      engine: a :class:`~jaxrl.rollout.jetstream_engine.JetStreamEngine`.
      params: the weights to serve (default ``engine.load_params()``; the driver keeps them: after
        ``update_weights`` start a new driver).
    """
    orchestrator = load_orchestrator()
    params = engine.load_params() if params is None else params
    return orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine], prefill_params=[params],
                               generate_params=[params], interleaved_mode=True)


def decode_tokens(driver, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
    """Send token-id requests, all at once, through JetStream's ``LLMOrchestrator.Decode`` (offline: no gRPC
    server) and collect each one's streamed token ids.

    JetStream prepends the tokenizer's BOS id to each prompt (``is_bos`` for a request without a session) and
    streams at most ``max_tokens`` tokens, ending before the first stop token (the engine's eos ids).

    Returns:
      one list of token ids per prompt, in order.
    """
    orchestrator = load_orchestrator()
    jetstream_pb2 = orchestrator.jetstream_pb2  # the request/response messages, as the orchestrator imports them
    servicer = orchestrator.LLMOrchestrator(driver=driver)

    async def one(prompt) -> list[int]:
        request = jetstream_pb2.DecodeRequest(
            token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[int(t) for t in prompt]),
            max_tokens=max_tokens)
        out: list[int] = []
        async for response in servicer.Decode(request):
            for sample in response.stream_content.samples:
                out.extend(sample.token_ids)
        return out

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(all_of())
