"""The rollout-engine protocol: sampling parameters in, padded token arrays out.

Every engine (the embedded JAX sampler, vLLM, JetStream) takes token-id prompts and a
:class:`SamplingParams` and returns a :class:`RolloutOutput` whose arrays have static shapes
(``R == max_new_tokens``), so the trainer's jitted steps compile once per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["SamplingParams", "RolloutOutput", "RolloutEngine", "WeightFormatError", "WeightSyncError"]

_MAX_SEED = 2**32


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses.

    Fields (names and meaning follow vLLM's ``SamplingParams`` / HF ``GenerationConfig``):
      n: responses per prompt (``actor_rollout_ref.rollout.n``), >= 1.
      temperature: logits are divided by it before sampling, >= 0; ``0`` means greedy
        (vLLM's convention). Ignored when ``do_sample`` is False.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it (HF ``TopPLogitsWarper``).
      top_k: keep the k most likely tokens; -1 or 0 disables it (HF ``TopKLogitsWarper``).
      max_new_tokens: response width R, >= 1. Every response array has exactly this width.
      do_sample: False = greedy argmax (temperature/top-k/top-p ignored).
      stop_token_ids: extra ids that end a response, in addition to the model's eos ids (a list
        is converted to a tuple).
      ignore_eos: True = the model's eos ids do not end a response (vLLM's ``ignore_eos``, verl's
        ``rollout.ignore_eos``): every response runs to ``max_new_tokens`` unless it emits one of
        ``stop_token_ids``. For benchmarks and length-controlled experiments.
      seed: PRNG seed in [0, 2**32) used when ``generate`` gets no ``rng_seed``.

    Raises:
      ValueError: a field is outside its valid range (the message names the field).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, valid: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={getattr(self, field)!r} is invalid; expected {valid}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "an int >= 1")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite float >= 0 (0 = greedy)")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "a float in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or -1/0 to disable")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "an int >= 1")
        if not isinstance(self.do_sample, bool):
            raise bad("do_sample", "a bool")
        if isinstance(self.stop_token_ids, (list, range)):  # e.g. from a YAML config
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a tuple of non-negative ints")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not (0 <= self.seed < _MAX_SEED):
            raise bad("seed", f"an int in [0, {_MAX_SEED})")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (``do_sample=False`` or ``temperature == 0``)."""
        return (not self.do_sample) or self.temperature == 0.0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class RolloutOutput:
    """One batch of generated responses (numpy arrays; N = len(prompts) * n).

    Attributes:
      prompt_ids: int32 [N, P], left-padded with the pad id (P is the engine's bucketed width).
      prompt_mask: int32 [N, P], 1 on real prompt tokens.
      response_ids: int32 [N, R], right-padded with the pad id; R == max_new_tokens.
      response_mask: int32 [N, R], 1 on generated tokens up to and including the first
        eos/stop token, 0 after.
      rollout_log_probs: float32 [N, R], log-prob (nats) of each generated token under
        ``log_softmax(logits / temperature)`` (temperature 1 when greedy); 0 where masked.
      prompt_index: int32 [N], the input prompt each row came from; rows ``i*n .. i*n+n-1``
        belong to prompt i.
      response_attention_mask: int32 [N, R] or None. Multi-turn rollouts (:mod:`jaxrl.agent`): 1 on every real
        response token, the model's and the tool / user tokens between its turns (``response_mask`` is 1 on the
        model's only). None: the same as ``response_mask`` (every engine's single-turn output).
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    rollout_log_probs: np.ndarray
    prompt_index: np.ndarray
    response_attention_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.prompt_ids.shape[0]
        for name in ("prompt_mask", "response_ids", "response_mask", "rollout_log_probs", "prompt_index"):
            arr = getattr(self, name)
            if arr.shape[0] != n:
                raise ValueError(f"RolloutOutput.{name} has {arr.shape[0]} rows; prompt_ids has {n}")
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_mask shape {self.prompt_mask.shape} != prompt_ids shape {self.prompt_ids.shape}")
        r = self.response_ids.shape
        if self.response_attention_mask is not None and self.response_attention_mask.shape != r:
            raise ValueError(f"response_attention_mask {self.response_attention_mask.shape} must match "
                             f"response_ids {r}")
        if self.response_mask.shape != r or self.rollout_log_probs.shape != r:
            raise ValueError(
                f"response_mask {self.response_mask.shape} and rollout_log_probs {self.rollout_log_probs.shape} "
                f"must match response_ids {r}"
            )

    @property
    def response_lengths(self) -> np.ndarray:
        """int32 [N]: generated tokens per row (eos/stop token included)."""
        return self.response_mask.sum(axis=-1).astype(np.int32)

    @property
    def num_generated_tokens(self) -> int:
        """Total generated tokens over the batch (sum of ``response_mask``)."""
        return int(self.response_mask.sum())

    def response_token_lists(self) -> list[list[int]]:
        """The generated ids of each row as a Python list, trimmed by ``response_mask``."""
        return [row[m.astype(bool)].tolist() for row, m in zip(self.response_ids, self.response_mask)]


class WeightSyncError(RuntimeError):
    """A weight sync into a rollout engine failed or timed out; the message names the sync and the engine.

    The trainer does not catch it: the run stops (``python -m jaxrl.train`` exits 1 naming the newest complete
    checkpoint, which the failed sync never touches; rerunning the same command resumes from it).
    """


class WeightFormatError(TypeError):
    """Weights handed to a rollout engine in a format it did not declare (``engine.weight_format``); the message
    names the engine, the format it takes and what it got. Nothing was loaded: the engine keeps its weights."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine.

    Every engine also declares ``weight_format`` (a :class:`jaxrl.rollout.weight_format.WeightFormat`): the one
    layout its :meth:`update_weights` accepts. Weights reach it only through
    :class:`jaxrl.rollout.weight_sync.WeightSync`, which translates the trainer's params into that format.
    """

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, rng_seed: int | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per token-id prompt; ``rng_seed`` overrides ``params.seed``."""
        ...

    def update_weights(self, params) -> None:
        """Replace the engine's weights with ``params`` in the engine's ``weight_format`` (else
        :class:`WeightFormatError`)."""
        ...


def check_prompts(
    prompts: Sequence[Sequence[int]], *, vocab_size: int, bos_token_id: int | None, max_prompt_length: int
) -> list[list[int]]:
    """Validate token-id prompts for any rollout engine; returns them as plain ``list[list[int]]``.

    An empty prompt becomes ``[bos_token_id]`` (generation from BOS alone).

    Raises:
      ValueError: not a non-empty list of token-id lists, a string prompt, non-integer ids, an empty prompt
        without a BOS id, a prompt longer than ``max_prompt_length``, or ids outside ``[0, vocab_size)``;
        the message names the prompt index.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one token-id list")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is a string; tokenize it first (expected a list of token ids)")
        arr = np.asarray(p) if len(p) else np.zeros((0,), np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"prompt {i} must be a flat list of int token ids; got {p!r:.80}")
        ids = arr.tolist()
        if not ids:
            if bos_token_id is None:
                raise ValueError(f"prompt {i} is empty and the model has no bos_token_id to start from")
            ids = [int(bos_token_id)]
        if len(ids) > max_prompt_length:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_prompt_length={max_prompt_length}")
        bad = [t for t in ids if not (0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out
