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
import contextlib
from collections.abc import Iterator, Sequence

from jaxrl.rollout.jetstream_compat import load_orchestrator

__all__ = ["OfflineClient", "serve", "start_driver"]


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


class OfflineClient:
    """Token-id requests through JetStream's ``LLMOrchestrator.Decode`` without a gRPC server, on a private event
    loop that outlives the requests.

    JetStream's detokenize thread closes a request's stream with two ``call_soon_threadsafe`` calls on the loop
    that made the request; the consumer can finish after the first, so the loop must stay open until the driver
    has stopped (a loop closed early makes that thread raise, and JetStream then SIGKILLs the process). Close the
    client after ``driver.stop()``; :func:`serve` does both in that order.
    """

    def __init__(self, driver):
        orchestrator = load_orchestrator()
        self._pb2 = orchestrator.jetstream_pb2  # the request/response messages, as the orchestrator imports them
        self._loop = asyncio.new_event_loop()
        self._servicer = orchestrator.LLMOrchestrator(driver=driver)

    def decode(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """Send the requests all at once and collect each one's streamed token ids.

        JetStream prepends the tokenizer's BOS id to each prompt (``is_bos`` for a request without a session) and
        streams at most ``max_tokens`` tokens, ending before the first stop token (the engine's eos ids).

        Returns:
          one list of token ids per prompt, in order.
        """
        pb2 = self._pb2

        async def one(prompt) -> list[int]:
            request = pb2.DecodeRequest(
                token_content=pb2.DecodeRequest.TokenContent(token_ids=[int(t) for t in prompt]), max_tokens=max_tokens)
            out: list[int] = []
            async for response in self._servicer.Decode(request):
                for sample in response.stream_content.samples:
                    out.extend(sample.token_ids)
            return out

        async def all_of() -> list[list[int]]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        return self._loop.run_until_complete(all_of())

    def close(self) -> None:
        """Close the event loop (after the driver has stopped)."""
        self._loop.close()


@contextlib.contextmanager
def serve(engine, *, params=None) -> Iterator[OfflineClient]:
    """``with serve(engine) as client: client.decode(prompts, max_tokens=...)``: JetStream's driver over ``engine``
    (:func:`start_driver`) and an :class:`OfflineClient` on it; on exit the driver stops, then the client closes."""
    driver = start_driver(engine, params=params)
    client = OfflineClient(driver)
    try:
        yield client
    finally:
        driver.stop()
        client.close()
