"""The JetStream rollout engine (``actor_rollout_ref.rollout.name=jetstream``): continuous batching over a
:class:`~jaxrl.rollout.jetstream_engine.JetStreamEngine`.

:meth:`JetStreamRollout.generate` turns one ``generate(prompts, sampling)`` call into the engine's prefill /
insert / generate, the way MaxText's offline engine drives JetStream's engine from its GRPO loop (no server):

1. requests are the call's rows in order (row ``i * n + j`` = sample ``j`` of prompt ``i``); each prompt is
   prefilled once and its other ``n - 1`` rows take the same prefix with their own first token
   (:meth:`~jaxrl.rollout.jetstream_engine.JetStreamEngine.prefix_for_request`);
2. every free slot gets the next request (prefill, insert);
3. :meth:`~jaxrl.rollout.jetstream_engine.JetStreamEngine.generate_steps` runs decode steps on the device until a
   slot finishes (while requests wait) or ``steps_per_call`` steps, then one device->host read returns the
   emitted tokens and log-probs;
4. finished slots are free again: back to 2 until every row is done.

A row that stops early frees its slot at once, so ragged response lengths (GSM8K, MATH) do not leave slots idle
until the longest row ends, which is what the embedded sampler's fixed batch does. Every program has a fixed
shape (``S`` slots, cache length ``C``), so decode compiles once; prefill and insert once per prompt bucket.

The output is the embedded sampler's (:class:`~jaxrl.rollout.jax_sampler.JaxSampler`): same :class:`RolloutOutput`
layout (prompt width bucketed to a multiple of ``prompt_length_bucket``), same stops (eos unless ``ignore_eos``,
plus ``stop_token_ids``), same per-row random streams, so responses do not depend on slots, slot count or order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models.config import ModelConfig
from jaxrl.rollout.base import RolloutOutput, SamplingParams, check_prompts
from jaxrl.rollout.jetstream_engine import JetStreamEngine, RequestSampling
from sharding.rules import Rules

__all__ = ["JetStreamRollout"]


class JetStreamRollout:
    """A :class:`~jaxrl.rollout.base.RolloutEngine` over a :class:`JetStreamEngine` with continuous batching.

    Args:
      model_cfg, graphdef, params: the policy (``nnx.split``); with a mesh the params already on it.
      pad_token_id: pad id, in ``[0, vocab_size)``.
      eos_token_ids: ids that end a response (unless ``ignore_eos``).
      max_prompt_length: longest prompt (tokens), >= 1.
      max_new_tokens: the longest response any call may ask for; with ``max_prompt_length`` it sizes each slot's
        KV cache (``C = max_prompt_length + max_new_tokens``).
      slots: decode slots ``S`` (``max_concurrent_decodes``), >= 1.
      prompt_length_bucket: ``RolloutOutput`` prompt widths are multiples of it (as the embedded sampler's).
      steps_per_call: most decode steps per device call (:meth:`JetStreamEngine.generate_steps`).
      max_stop_ids: most stop ids (eos + ``stop_token_ids``) a call may use.
      tokenizer: optional Hugging Face tokenizer, for the engine's JetStream tokenizer accessors.
      cache_dtype, mesh, rules: as :class:`JetStreamEngine`.

    Attributes:
      engine: the :class:`JetStreamEngine`.
      weight_format: the engine's (``"jax"``, on ``mesh`` when given).

    Raises:
      ValueError: an argument out of range (names it).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef,
        params: nnx.State,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        max_prompt_length: int,
        max_new_tokens: int,
        slots: int,
        prompt_length_bucket: int = 32,
        steps_per_call: int = 64,
        max_stop_ids: int = 8,
        tokenizer: Any = None,
        cache_dtype=jnp.float32,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
        if not isinstance(prompt_length_bucket, int) or prompt_length_bucket < 1:
            raise ValueError(f"prompt_length_bucket={prompt_length_bucket!r} must be an int >= 1")
        self.engine = JetStreamEngine(
            model_cfg, graphdef, params, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
            max_prefill_length=max_prompt_length, max_target_length=max_prompt_length + max_new_tokens,
            max_concurrent_decodes=slots, max_stop_ids=max(max_stop_ids, len(tuple(eos_token_ids))),
            steps_per_call=steps_per_call, tokenizer=tokenizer, cache_dtype=cache_dtype, mesh=mesh, rules=rules,
        )
        self.model_cfg = model_cfg
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_prompt_length = max_prompt_length
        self.max_new_tokens = max_new_tokens
        self.prompt_length_bucket = prompt_length_bucket
        self.weight_format = self.engine.weight_format
        self.engine_name = self.engine.engine_name

    @property
    def params(self) -> nnx.State:
        """The current weights."""
        return self.engine.params

    def update_weights(self, params: nnx.State) -> None:
        """Replace the weights (called by :class:`~jaxrl.rollout.weight_sync.WeightSync`); see
        :meth:`JetStreamEngine.replace_params` (``WeightFormatError`` / ``ValueError``)."""
        self.engine.replace_params(params)

    def _prompt_width(self, longest: int) -> int:
        b = self.prompt_length_bucket
        return min(max(1, math.ceil(longest / b)) * b, self.max_prompt_length)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, rng_seed: int | None = None
                 ) -> RolloutOutput:
        """Sample ``params.n`` responses for each token-id prompt by continuous batching.

        Args:
          prompts: token-id lists of 0..max_prompt_length tokens (empty = ``[bos_token_id]``).
          params: :class:`SamplingParams`; ``max_new_tokens`` at most the engine's.
          rng_seed: overrides ``params.seed``; in [0, 2**32).
        Returns:
          :class:`RolloutOutput`: N = len(prompts) * n rows, P = longest prompt bucketed to a multiple of
          ``prompt_length_bucket``, R = ``params.max_new_tokens``.
        Raises:
          TypeError: ``params`` is not a SamplingParams.
          ValueError: bad prompts (names the index), a bad ``rng_seed``, ``max_new_tokens`` beyond the engine's,
            or more stop ids than the engine holds.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        seed = params.seed if rng_seed is None else rng_seed
        if not isinstance(seed, (int, np.integer)) or not (0 <= int(seed) < 2**32):
            raise ValueError(f"rng_seed={rng_seed!r} must be an int in [0, 2**32)")
        if params.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens} exceeds this JetStream engine's "
                             f"max_new_tokens={self.max_new_tokens} (its KV cache length)")
        prompts = check_prompts(prompts, vocab_size=self.model_cfg.vocab_size, bos_token_id=self.model_cfg.bos_token_id,
                                max_prompt_length=self.max_prompt_length)
        n, r = params.n, params.max_new_tokens
        rows = len(prompts) * n
        requests = [RequestSampling.from_params(params, row=row, seed=int(seed), eos_token_ids=self.eos_token_ids)
                    for row in range(rows)]
        tokens, log_probs = self._run(prompts, n, requests)

        width = self._prompt_width(max(len(p) for p in prompts))
        prompt_ids = np.full((rows, width), self.pad_token_id, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        response_ids = np.full((rows, r), self.pad_token_id, np.int32)
        response_mask = np.zeros((rows, r), np.int32)
        rollout_log_probs = np.zeros((rows, r), np.float32)
        for row in range(rows):
            p = prompts[row // n]
            prompt_ids[row, width - len(p):] = p
            prompt_mask[row, width - len(p):] = 1
            k = len(tokens[row])
            response_ids[row, :k] = tokens[row]
            response_mask[row, :k] = 1
            rollout_log_probs[row, :k] = log_probs[row]
        return RolloutOutput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                             response_mask=response_mask, rollout_log_probs=rollout_log_probs,
                             prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), n))

    def _run(self, prompts: list[list[int]], n: int, requests: list[RequestSampling]
             ) -> tuple[list[list[int]], list[list[float]]]:
        """Continuous batching: each request's emitted tokens and log-probs, in request order."""
        engine = self.engine
        params = engine.load_params()
        state = engine.init_decode_state()
        tokens: list[list[int]] = [[] for _ in requests]
        log_probs: list[list[float]] = [[] for _ in requests]
        slot_row = [-1] * engine.max_concurrent_decodes
        prefix = None
        next_row = 0
        while True:
            for slot in range(engine.max_concurrent_decodes):
                if slot_row[slot] != -1 or next_row == len(requests):
                    continue
                prompt_index, sample = divmod(next_row, n)
                if sample == 0:
                    padded, true_length = engine.pad_prompt(prompts[prompt_index])
                    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=true_length,
                                            sampling=requests[next_row])
                    row_prefix = prefix
                else:
                    row_prefix = engine.prefix_for_request(prefix, requests[next_row])
                state = engine.insert(row_prefix, state, slot)
                slot_row[slot] = next_row
                next_row += 1
            if all(row == -1 for row in slot_row):
                return tokens, log_probs
            state, res = engine.generate_steps(params, state, stop_at_free=next_row < len(requests))
            for step in range(res.steps):
                for slot in np.flatnonzero(res.valid[step]):
                    tokens[slot_row[slot]].append(int(res.tokens[step, slot]))
                    log_probs[slot_row[slot]].append(float(res.log_probs[step, slot]))
            for slot in np.flatnonzero(~res.live):
                slot_row[slot] = -1
