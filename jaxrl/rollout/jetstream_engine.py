"""jaxrl's decoder behind JetStream's ``Engine`` interface: prefill, insert, generate over fixed decode slots.

:class:`JetStreamEngine` implements the interface of ``google-jetstream``'s ``engine_api.Engine`` (0.2.2) over
:class:`~jaxrl.models.decoder.Decoder` and its :class:`~jaxrl.models.decoder.KVCache`; it subclasses JetStream's
class when ``google-jetstream`` imports (:mod:`jaxrl.rollout.jetstream_compat`), else stand-ins with the same
abstract methods. JetStream's own orchestrator can drive it (:mod:`jaxrl.rollout.jetstream_orchestrator`); the
trainer drives it through :class:`jaxrl.rollout.jetstream_rollout.JetStreamRollout`.

Decode state: ``S`` slots (``max_concurrent_decodes``) each with its own region of one KV cache
(``L`` arrays ``[S, nKV, C, D]``) (``C = max_target_length``, fixed), so :meth:`generate` compiles once. A slot's cache
position ``p`` holds its token at RoPE position ``p`` (prompt tokens from 0), and each slot decodes at its own
position: the decoder runs on all slots at once with a per-slot ``cache_index`` ``[S]``. The causal mask
(key slot <= query slot) is the only attention mask a slot needs: everything after its position is either not
written yet or left over from a previous request, and both sit after the query.

One request's life:

* :meth:`prefill` - one right-padded prompt ``[Pb]`` (``Pb`` a power-of-two bucket >= 16, capped at
  ``max_prefill_length``) through the decoder: its KV cache (``L`` x ``[1, nKV, Pb, D]``), the logits at its last
  token, and the first response token sampled from them with its log-prob (a :class:`Prefix`).
* :meth:`insert` - the prefix into a free slot: cache positions ``[0, Pb)``, the pending first token, the
  request's sampling settings (:class:`SlotControls`).
* :meth:`generate` - one step for every slot: each live slot emits its pending token (token, validity, length,
  log-prob in the :class:`ResultTokens`), feeds it through the decoder at its position and samples the next one.
  A slot stops (``live`` False) after it emitted a stop token, its ``max_new_tokens``-th token, or the token at
  the last cache position.

Tokens are emitted by :meth:`generate`, the first one included (JetStream 0.2.2's orchestrator streams only what
``generate`` returns), so a response of ``k`` tokens takes one prefill and ``k`` generate steps.

Randomness (as :class:`~jaxrl.rollout.jax_sampler.JaxSampler`): token ``t`` of a request is drawn with
``fold_in(fold_in(key(seed), row), t)``; ``row`` and ``seed`` come with the request (:class:`RequestSampling`),
so a response does not depend on the slot it lands in, on the other slots, or on when it was inserted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.distributed import to_global, to_host
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import KVCache, init_cache
from jaxrl.rollout import jetstream_compat as api
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.sampling import select_tokens_per_row
from jaxrl.rollout.weight_format import WeightFormat, check_same_params
from sharding.rules import Rules

__all__ = [
    "DecodeState", "JetStreamEngine", "LOG_PROB_COLUMN", "Prefix", "RequestSampling", "SlotControls",
    "result_log_probs",
]

#: Column of a :class:`ResultTokens` ``data`` row holding the token's log-prob (float32 bits as int32); columns
#: 0-2 are JetStream's tokens / valid / lengths.
LOG_PROB_COLUMN = 3
_MIN_BUCKET = 16


def result_log_probs(result) -> np.ndarray:
    """float32 ``[slots * samples_per_slot]``: the log-prob of each emitted token in a :meth:`JetStreamEngine.generate`
    result (0 where the slot emitted nothing)."""
    data = np.asarray(to_host(result.data))
    return np.ascontiguousarray(data[:, LOG_PROB_COLUMN]).view(np.float32)


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """How one request (one response) is sampled, and when it stops.

    Attributes:
      row: the request's PRNG stream (a generate call's global row index ``prompt_index * n + j``), >= 0.
      seed: PRNG seed in [0, 2**32).
      temperature, top_k, top_p, greedy: as :class:`~jaxrl.rollout.base.SamplingParams` (``greedy`` = argmax, the
        others then ignored; log-probs under temperature 1).
      stop_token_ids: ids that end the response (emitted, then the slot stops); None = the engine's eos ids.
      max_new_tokens: the response's token budget; None = as many as the slot's cache holds.

    Raises:
      ValueError: a field out of range (names it).
    """

    row: int = 0
    seed: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    greedy: bool = True
    stop_token_ids: tuple[int, ...] | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.row, (int, np.integer)) and 0 <= self.row < 2**31):
            raise ValueError(f"RequestSampling.row={self.row!r} must be an int in [0, 2**31)")
        if not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed < 2**32):
            raise ValueError(f"RequestSampling.seed={self.seed!r} must be an int in [0, 2**32)")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"RequestSampling.max_new_tokens={self.max_new_tokens!r} must be >= 1 or None")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"RequestSampling.temperature={self.temperature!r} must be > 0 when sampling")

    @classmethod
    def from_params(cls, params: SamplingParams, *, row: int, seed: int,
                    eos_token_ids: Sequence[int]) -> "RequestSampling":
        """The settings of row ``row`` of a generate call with ``params`` (stops: eos ids unless ``ignore_eos``,
        plus ``stop_token_ids``)."""
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        greedy = params.greedy
        return cls(row=int(row), seed=int(seed), temperature=1.0 if greedy else float(params.temperature),
                   top_k=int(params.top_k), top_p=float(params.top_p), greedy=greedy,
                   stop_token_ids=tuple(sorted(stops)), max_new_tokens=params.max_new_tokens)


class SlotControls(NamedTuple):
    """A request's sampling settings on the device (scalars in a :class:`Prefix`, ``[S]``-leading in a
    :class:`DecodeState`).

    Attributes:
      key: uint32 [2] (``[S, 2]``): the request's key data ``fold_in(key(seed), row)``.
      temperature: float32. top_k: int32. top_p: float32. greedy: bool.
      max_new_tokens: int32, the response's token budget.
      stop_ids: int32 [K] (``[S, K]``), -1 = unused entry.
    """

    key: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    greedy: jax.Array
    max_new_tokens: jax.Array
    stop_ids: jax.Array


class Prefix(NamedTuple):
    """A prefilled prompt (:meth:`JetStreamEngine.prefill`), ready for :meth:`JetStreamEngine.insert`.

    Attributes:
      cache: KVCache (``L`` x ``[1, nKV, Pb, D]``): the prompt's keys/values at positions ``[0, Pb)`` (real up to
        ``true_length``).
      logits: float32 [V] at the last prompt token (for :meth:`JetStreamEngine.prefix_for_request`).
      true_length: int32 scalar, the prompt's token count.
      token, log_prob: int32 / float32 scalars: the first response token and its log-prob.
      controls: :class:`SlotControls` of the request.
    """

    cache: KVCache
    logits: jax.Array
    true_length: jax.Array
    token: jax.Array
    log_prob: jax.Array
    controls: SlotControls


class DecodeState(NamedTuple):
    """The decode slots (:meth:`JetStreamEngine.init_decode_state`); every field has ``S`` leading.

    Attributes:
      cache: KVCache (``L`` x ``[S, nKV, C, D]``).
      tokens: int32 [S], each slot's pending token (sampled, to be emitted and fed next step).
      log_probs: float32 [S], its log-prob.
      lengths: int32 [S], the pending token's position (= cache entries of the slot in use).
      steps: int32 [S], tokens sampled so far (the pending one included): the pending token's 1-based index.
      live: bool [S], the slot holds a request whose pending token is still to be emitted.
      controls: :class:`SlotControls` ``[S, ...]``.
    """

    cache: KVCache
    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    steps: jax.Array
    live: jax.Array
    controls: SlotControls


class StepsResult(NamedTuple):
    """What :meth:`JetStreamEngine.generate_steps` returns to the host (numpy).

    Attributes:
      tokens: int32 [K, S] emitted tokens per step and slot; log_probs: float32 [K, S]; valid: bool [K, S]
        (the slot emitted at that step). Only the first ``steps`` rows are filled.
      steps: int, generate steps run (<= K).
      live: bool [S], the slots still live afterwards (a slot that turned False finished during the call).
    """

    tokens: np.ndarray
    log_probs: np.ndarray
    valid: np.ndarray
    steps: int
    live: np.ndarray


class _TokenizerAdapter(api.Tokenizer):
    """JetStream's ``Tokenizer`` over a Hugging Face tokenizer (or none: then token ids only)."""

    def __init__(self, hf_tokenizer, *, bos_id: int | None, eos_ids: tuple[int, ...], pad_id: int,
                 buckets: Sequence[int]):
        self._tok = hf_tokenizer
        self._bos, self._eos, self._pad = bos_id, eos_ids, pad_id
        self._buckets = tuple(buckets)

    def encode(self, s: str, **kwargs):
        """``s`` -> ``(tokens right-padded to the engine's prefill bucket, true_length)`` (JetStream's
        ``is_bos`` / ``max_prefill_length`` / ``jax_padding`` keywords honoured)."""
        if self._tok is None:
            raise ValueError("this JetStreamEngine has no tokenizer: send token ids (TokenContent), not text")
        ids = list(self._tok.encode(s, add_special_tokens=False))
        if kwargs.get("is_bos", True) and self._bos is not None:
            ids = [self._bos] + ids
        limit = kwargs.get("max_prefill_length") or self._buckets[-1]
        if len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_prefill_length={limit}")
        width = next(b for b in self._buckets + (limit,) if b >= len(ids))
        padded = np.full((width,), self._pad, np.int32)
        padded[: len(ids)] = ids
        return (jnp.asarray(padded) if kwargs.get("jax_padding", True) else padded), len(ids)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        if self._tok is None:
            raise ValueError("this JetStreamEngine has no tokenizer to decode with")
        return self._tok.decode(list(token_ids))

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else self._pad

    @property
    def bos_id(self) -> int:
        return self._bos if self._bos is not None else self._pad

    @property
    def stop_tokens(self) -> set[int]:
        """The engine's eos ids: what ends a response (JetStream's default adds the pad id; here pad may be a
        real token)."""
        return set(self._eos)


class JetStreamEngine(api.Engine):
    """JetStream's ``Engine`` over jaxrl's :class:`~jaxrl.models.decoder.Decoder`.

    Args:
      model_cfg: the decoder's :class:`ModelConfig`.
      graphdef, params: ``nnx.split(model)``; the model is rebuilt with ``nnx.merge`` inside jit.
      pad_token_id: the id written into padding, in ``[0, vocab_size)``.
      eos_token_ids: ids that end a response by default (:class:`RequestSampling` ``stop_token_ids=None``).
      max_prefill_length: longest prompt in tokens (>= 1); prompts pad to power-of-two buckets >= 16 up to it.
      max_target_length: KV-cache length per slot ``C`` (prompt + response), > ``max_prefill_length``.
      max_concurrent_decodes: decode slots ``S`` (>= 1).
      max_stop_ids: stop ids a request may have (the ``K`` of :class:`SlotControls`), >= 1.
      steps_per_call: ``K`` of :meth:`generate_steps`, the most generate steps one device call runs (>= 1).
      tokenizer: a Hugging Face tokenizer for :meth:`build_tokenizer` (text requests); None = token ids only.
      cache_dtype: the KV cache's dtype.
      mesh: the rollout mesh (axes ``data``, ``fsdp``, ``tensor``), or None for one device. With a mesh the
        params must already live on it (the weight sync's ``"jax"`` plan) and the slots are split over ``data``
        when ``S`` is divisible by it.
      rules: with a mesh, the logical-axis rules the weights are laid out by (part of :attr:`weight_format`).

    Attributes:
      weight_format: what :meth:`replace_params` accepts (:class:`WeightFormat` ``"jax"``, on ``mesh`` if given).
      num_prefills, num_inserts, num_decode_steps: counters (decode steps: device generate steps, whether
        through :meth:`generate` or :meth:`generate_steps`).

    Raises:
      ValueError: an argument out of range (names it), or a mesh without a ``data`` axis.
      WeightFormatError: with a mesh, ``params`` not on it.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef,
        params: nnx.State,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        max_prefill_length: int,
        max_target_length: int,
        max_concurrent_decodes: int,
        max_stop_ids: int = 8,
        steps_per_call: int = 64,
        tokenizer: Any = None,
        cache_dtype=jnp.float32,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> None:
        vocab = model_cfg.vocab_size

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        need(isinstance(pad_token_id, (int, np.integer)) and 0 <= pad_token_id < vocab,
             f"pad_token_id={pad_token_id!r} must be an int in [0, {vocab})")
        eos = tuple(int(e) for e in eos_token_ids)
        need(all(0 <= e < vocab for e in eos), f"eos_token_ids {list(eos)} must lie in [0, {vocab})")
        need(isinstance(max_prefill_length, int) and max_prefill_length >= 1,
             f"max_prefill_length={max_prefill_length!r} must be an int >= 1")
        need(isinstance(max_target_length, int) and max_target_length > max_prefill_length,
             f"max_target_length={max_target_length!r} must be an int > max_prefill_length={max_prefill_length}")
        need(isinstance(max_concurrent_decodes, int) and max_concurrent_decodes >= 1,
             f"max_concurrent_decodes={max_concurrent_decodes!r} must be an int >= 1")
        need(isinstance(max_stop_ids, int) and max_stop_ids >= max(1, len(eos)),
             f"max_stop_ids={max_stop_ids!r} must be an int >= max(1, len(eos_token_ids)={len(eos)})")
        need(isinstance(steps_per_call, int) and steps_per_call >= 1,
             f"steps_per_call={steps_per_call!r} must be an int >= 1")
        need(mesh is None or "data" in mesh.axis_names,
             f"the rollout mesh needs a 'data' axis; got axes {None if mesh is None else mesh.axis_names}")
        need(mesh is not None or rules is None, "rules= lays weights out on a mesh; pass mesh= too (or neither)")

        self.model_cfg = model_cfg
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = eos
        self.max_target_length = max_target_length
        self.max_stop_ids = max_stop_ids
        self.steps_per_call = steps_per_call
        self.cache_dtype = cache_dtype
        self.tokenizer = tokenizer
        self._max_prefill_length = max_prefill_length
        self._slots = max_concurrent_decodes
        self._mesh_arg = mesh
        self.weight_format = WeightFormat.jax(mesh, rules)
        if mesh is None:
            self.engine_name = "jetstream engine"
        else:
            self.engine_name = "jetstream engine on mesh " + " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
            self.weight_format.check(params, self.engine_name)
        self._graphdef = graphdef
        self._params = jax.tree.map(jnp.asarray, params)
        self.buckets = tuple(sorted({min(max_prefill_length, _MIN_BUCKET << i)
                                     for i in range(max(1, math.ceil(math.log2(max(max_prefill_length, 1))) + 1))}))
        self.num_prefills = self.num_inserts = self.num_decode_steps = 0
        self._num_traces = 0
        self._prefill_jit = jax.jit(self._prefill_impl)
        self._resample_jit = jax.jit(self._resample_impl)
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._step_jit = jax.jit(self._generate_impl, donate_argnums=(1,))
        self._steps_jit = jax.jit(self._steps_impl, donate_argnums=(1,))
        self._release_jit = jax.jit(self._release_impl, donate_argnums=(0,))
        if mesh is None:
            self._init_state_jit = jax.jit(self._init_state_impl)
        else:
            self._init_state_jit = jax.jit(self._init_state_impl,
                                           out_shardings=self._state_shardings(jax.eval_shape(self._init_state_impl)))

    # ------------------------------------------------------------------ JetStream properties
    @property
    def max_concurrent_decodes(self) -> int:
        """Decode slots ``S``."""
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        """1: a slot holds one response (``n`` samples of a prompt take ``n`` slots sharing one prefill)."""
        return 1

    @property
    def max_prefill_length(self) -> int:
        """Longest prompt (tokens) :meth:`prefill` takes."""
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh:
        """The engine's mesh (a one-device mesh of the params' device without one)."""
        if self._mesh_arg is not None:
            return self._mesh_arg
        device = next(iter(jax.tree.leaves(self._params)[0].sharding.device_set))
        return Mesh(np.array([device]), ("data",))

    @property
    def colocated_cpus(self) -> None:
        """None: no CPU devices are set aside for the engine."""
        return None

    @property
    def num_compiles(self) -> int:
        """Programs traced so far (prefill per bucket, insert per bucket, generate, generate_steps, ...)."""
        return self._num_traces

    # ------------------------------------------------------------------ params and tokenizer
    def load_params(self, *args, **kwargs) -> nnx.State:
        """The engine's current weights (set at construction and by :meth:`replace_params`); arguments ignored."""
        return self._params

    @property
    def params(self) -> nnx.State:
        return self._params

    def replace_params(self, params: nnx.State) -> None:
        """Replace the weights :meth:`load_params` returns (no recompilation); the rollout's ``update_weights``
        (called only by :class:`~jaxrl.rollout.weight_sync.WeightSync`) lands here.

        Args:
          params: an ``nnx.State`` with exactly the current tree, leaf shapes and dtypes (with a mesh: on it).
        Raises:
          WeightFormatError: not an ``nnx.State`` / (with a mesh) arrays off the mesh.
          ValueError: another tree, shape or dtype (names the first differences).
        """
        self.weight_format.check(params, self.engine_name)
        check_same_params(self._params, params, self.engine_name)
        self._params = jax.tree.map(jnp.asarray, params)

    def get_tokenizer(self):
        """JetStream's ``TokenizerParameters`` (the tokenizer's path; :meth:`build_tokenizer` uses the engine's
        own tokenizer object)."""
        return api.TokenizerParameters(path=str(getattr(self.tokenizer, "name_or_path", "") or ""))

    def build_tokenizer(self, metadata=None) -> api.Tokenizer:
        """A JetStream ``Tokenizer`` over the engine's tokenizer: text -> right-padded bucketed ids, ids -> text;
        ``stop_tokens`` = the engine's eos ids. Without a tokenizer it serves token-id requests only."""
        bos = self.model_cfg.bos_token_id
        return _TokenizerAdapter(self.tokenizer, bos_id=None if bos is None else int(bos), eos_ids=self.eos_token_ids,
                                 pad_id=self.pad_token_id, buckets=self.buckets)

    def get_prefix_destination_sharding(self):
        """Where a prefix must be before :meth:`insert`: replicated on the mesh, or the params' device."""
        if self._mesh_arg is not None:
            return NamedSharding(self._mesh_arg, PartitionSpec())
        return SingleDeviceSharding(next(iter(jax.tree.leaves(self._params)[0].sharding.device_set)))

    # ------------------------------------------------------------------ host-side helpers
    def bucket(self, length: int) -> int:
        """The prefill width for a prompt of ``length`` tokens (a power of two >= 16, capped at
        ``max_prefill_length``)."""
        if not 1 <= length <= self._max_prefill_length:
            raise ValueError(f"prompt length {length} is outside [1, max_prefill_length={self._max_prefill_length}]")
        return next(b for b in self.buckets if b >= length)

    def pad_prompt(self, prompt: Sequence[int]) -> tuple[np.ndarray, int]:
        """``(int32 [Pb] right-padded with the pad id, true_length)`` for :meth:`prefill`."""
        ids = np.asarray(prompt, np.int32).reshape(-1)
        padded = np.full((self.bucket(len(ids)),), self.pad_token_id, np.int32)
        padded[: len(ids)] = ids
        return padded, len(ids)

    def _controls(self, req: RequestSampling, true_length: int) -> SlotControls:
        stops = self.eos_token_ids if req.stop_token_ids is None else tuple(req.stop_token_ids)
        if len(stops) > self.max_stop_ids:
            raise ValueError(f"{len(stops)} stop ids {list(stops)[:10]} exceed the engine's max_stop_ids="
                             f"{self.max_stop_ids}; build the engine with a larger max_stop_ids")
        room = self.max_target_length - true_length
        if req.max_new_tokens is not None and req.max_new_tokens > room:
            raise ValueError(f"max_new_tokens={req.max_new_tokens} does not fit a {true_length}-token prompt in "
                             f"max_target_length={self.max_target_length} (at most {room})")
        stop_ids = np.full((self.max_stop_ids,), -1, np.int32)
        stop_ids[: len(stops)] = stops
        return SlotControls(
            key=np.asarray([req.seed, req.row], np.uint32),  # turned into the row key inside the jitted prefill
            temperature=np.float32(req.temperature), top_k=np.int32(req.top_k), top_p=np.float32(req.top_p),
            greedy=np.bool_(req.greedy), max_new_tokens=np.int32(req.max_new_tokens or room), stop_ids=stop_ids,
        )

    def _replicated(self, tree):
        """Host values (the same on every process) -> replicated on the mesh (``jaxrl.distributed.to_global``);
        without a mesh they go to the device as jit arguments."""
        if self._mesh_arg is None:
            return tree
        return to_global(tree, NamedSharding(self._mesh_arg, PartitionSpec()))

    def _state_shardings(self, state: DecodeState):
        """Slots over ``data`` (when divisible), the cache's kv heads over ``tensor`` (when divisible)."""
        mesh = self._mesh_arg
        data = "data" if self._slots % mesh.shape["data"] == 0 else None
        tensor = ("tensor" if "tensor" in mesh.axis_names
                  and self.model_cfg.num_key_value_heads % mesh.shape["tensor"] == 0 else None)

        def spec(x):
            if x.ndim == 4:  # a layer's cache [S, nKV, C, D]
                return NamedSharding(mesh, PartitionSpec(data, tensor, None, None))
            return NamedSharding(mesh, PartitionSpec(data))

        return jax.tree.map(spec, state)

    def _constrain(self, state: DecodeState) -> DecodeState:
        """Inside jit: keep the decode state's layout fixed (so each program compiles once on a mesh)."""
        if self._mesh_arg is None:
            return state
        return jax.lax.with_sharding_constraint(state, self._state_shardings(state))

    # ------------------------------------------------------------------ JetStream API
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """Every slot free: a zero cache (``L`` x ``[S, nKV, C, D]``) and slot fields (arguments ignored); with a mesh,
        built on it in its layout (slots over ``data``, kv heads over ``tensor``)."""
        return self._init_state_jit()

    def _init_state_impl(self) -> DecodeState:
        s, k = self._slots, self.max_stop_ids
        return DecodeState(
            cache=init_cache(self.model_cfg, s, self.max_target_length, self.cache_dtype),
            tokens=jnp.zeros((s,), jnp.int32), log_probs=jnp.zeros((s,), jnp.float32),
            lengths=jnp.zeros((s,), jnp.int32), steps=jnp.zeros((s,), jnp.int32), live=jnp.zeros((s,), jnp.bool_),
            controls=SlotControls(
                key=jnp.zeros((s, 2), jnp.uint32), temperature=jnp.ones((s,), jnp.float32),
                top_k=jnp.zeros((s,), jnp.int32), top_p=jnp.ones((s,), jnp.float32), greedy=jnp.ones((s,), jnp.bool_),
                max_new_tokens=jnp.ones((s,), jnp.int32), stop_ids=jnp.full((s, k), -1, jnp.int32),
            ),
        )

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int,
                sampling: RequestSampling | None = None) -> Prefix:
        """One prompt -> its :class:`Prefix` (KV cache, last-token logits, first token + log-prob).

        Args:
          params: the weights (:meth:`load_params`).
          existing_prefix: must be None (continuing a cached conversation is not supported).
          padded_tokens: int [Pb] right-padded prompt, ``Pb <= max_prefill_length`` (:meth:`pad_prompt`).
          true_length: real tokens in ``padded_tokens``, in ``[1, Pb]``.
          sampling: the request's settings (default: greedy, the engine's eos ids, as many tokens as fit).
        Raises:
          ValueError: ``existing_prefix`` given, a bad width / length, or settings the engine cannot hold.
        """
        if existing_prefix is not None:
            raise ValueError("existing_prefix is not supported by the jaxrl JetStream engine; prefill the whole prompt")
        tokens = np.asarray(to_host(padded_tokens), np.int32).reshape(-1)
        width, true_length = tokens.shape[0], int(true_length)
        if not 1 <= width <= self._max_prefill_length:
            raise ValueError(f"padded_tokens has {width} tokens; expected 1..max_prefill_length="
                             f"{self._max_prefill_length}")
        if not 1 <= true_length <= width:
            raise ValueError(f"true_length={true_length} must be in [1, {width}] (the padded width)")
        controls = self._controls(sampling or RequestSampling(), true_length)
        self.num_prefills += 1
        args = self._replicated((tokens, np.int32(true_length), controls))
        return self._prefill_jit(params, *args)

    def prefix_for_request(self, prefix: Prefix, sampling: RequestSampling) -> Prefix:
        """The same prompt for another request (another row of its ``n`` samples): the prefix's cache, with the
        first token drawn again from its logits under ``sampling`` (no model call)."""
        controls = self._controls(sampling, int(to_host(prefix.true_length)))
        return self._resample_jit(prefix, self._replicated(controls))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Put ``prefix`` into slot ``slot`` (``decode_state`` is donated; use the returned state).

        Raises:
          ValueError: ``slot`` outside ``[0, max_concurrent_decodes)``.
        """
        if not 0 <= int(slot) < self._slots:
            raise ValueError(f"slot={slot} is outside [0, max_concurrent_decodes={self._slots})")
        self.num_inserts += 1
        return self._insert_jit(prefix, decode_state, self._replicated(np.int32(slot)))

    def generate(self, params, decode_state: DecodeState):
        """One step for every slot: each live slot emits its pending token and samples the next.

        Returns:
          ``(decode_state, ResultTokens)``; ``data`` int32 ``[S, 4]``: columns token, valid (0/1), length (tokens
          emitted so far by the slot, this one included), and the log-prob's float32 bits
          (:func:`result_log_probs`).
        """
        self.num_decode_steps += 1
        state, data = self._step_jit(params, decode_state)
        return state, api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                       samples_per_slot=1)

    def free_resource(self, slot: int, decode_state: DecodeState | None = None) -> DecodeState | None:
        """Release slot ``slot``. The cache is dense per slot (nothing pooled): the next :meth:`insert` into the slot
        overwrites it, so without ``decode_state`` there is nothing to free (returns None). With one, returns it
        with the slot stopped (a cancelled request; ``decode_state`` is donated)."""
        if not 0 <= int(slot) < self._slots:
            raise ValueError(f"slot={slot} is outside [0, max_concurrent_decodes={self._slots})")
        if decode_state is None:
            return None
        return self._release_jit(decode_state, self._replicated(np.int32(slot)))

    # ------------------------------------------------------------------ beyond JetStream: the driver's loop
    def generate_steps(self, params, decode_state: DecodeState, *,
                       stop_at_free: bool) -> tuple[DecodeState, StepsResult]:
        """Up to ``steps_per_call`` :meth:`generate` steps in one device call, with one device->host read.

        Stops early when no slot is live, or (``stop_at_free``) right after the step in which a slot finished, so
        a waiting request can take it at once.

        Returns:
          ``(decode_state, StepsResult)`` (host arrays).
        """
        state, out = self._steps_jit(params, decode_state, self._replicated(np.bool_(stop_at_free)))
        tokens, log_probs, valid, steps, live = to_host(out + (state.live,))
        self.num_decode_steps += int(steps)
        return state, StepsResult(tokens, log_probs, valid, int(steps), live)

    # ------------------------------------------------------------------ jitted programs
    def _select(self, logits, controls: SlotControls, step):
        """Tokens + log-probs for ``[B, V]`` logits under per-row controls, keys ``fold_in(row_key, step)``."""
        keys = jax.vmap(lambda kd, t: jax.random.fold_in(jax.random.wrap_key_data(kd), t))(controls.key, step)
        return select_tokens_per_row(logits, keys, temperature=controls.temperature, top_k=controls.top_k,
                                     top_p=controls.top_p, greedy=controls.greedy)

    def _prefill_impl(self, params, tokens, true_length, controls: SlotControls) -> Prefix:
        self._num_traces += 1
        width = tokens.shape[0]
        model = nnx.merge(self._graphdef, params)
        cache = init_cache(self.model_cfg, 1, width, self.cache_dtype)
        positions = jnp.arange(width, dtype=jnp.int32)[None]
        mask = (jnp.arange(width) < true_length).astype(jnp.int32)[None]
        hidden, cache = model(tokens[None], positions, mask, cache=cache, cache_index=jnp.int32(0), return_hidden=True)
        last = jax.lax.dynamic_slice_in_dim(hidden, true_length - 1, 1, axis=1)
        logits = model.logits(last)[0, 0]
        seed, row = controls.key[0], controls.key[1]
        key = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), row.astype(jnp.int32)))
        controls = controls._replace(key=key)
        return self._first_token(cache, logits, true_length, controls)

    def _first_token(self, cache, logits, true_length, controls: SlotControls) -> Prefix:
        batched = jax.tree.map(lambda x: x[None], controls)
        tok, lp = self._select(logits[None], batched, jnp.zeros((1,), jnp.int32))
        return Prefix(cache=cache, logits=logits, true_length=true_length, token=tok[0], log_prob=lp[0],
                      controls=controls)

    def _resample_impl(self, prefix: Prefix, controls: SlotControls) -> Prefix:
        self._num_traces += 1
        seed, row = controls.key[0], controls.key[1]
        key = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), row.astype(jnp.int32)))
        return self._first_token(prefix.cache, prefix.logits, prefix.true_length, controls._replace(key=key))

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot) -> DecodeState:
        self._num_traces += 1
        at = (slot, 0, 0, 0)
        cache = jax.tree.map(lambda whole, one: jax.lax.dynamic_update_slice(whole, one.astype(whole.dtype), at),
                             state.cache, prefix.cache)
        controls = jax.tree.map(lambda s, p: s.at[slot].set(p), state.controls, prefix.controls)
        new = DecodeState(
            cache=cache, tokens=state.tokens.at[slot].set(prefix.token),
            log_probs=state.log_probs.at[slot].set(prefix.log_prob),
            lengths=state.lengths.at[slot].set(prefix.true_length), steps=state.steps.at[slot].set(1),
            live=state.live.at[slot].set(True), controls=controls,
        )
        return self._constrain(new)

    def _release_impl(self, state: DecodeState, slot) -> DecodeState:
        self._num_traces += 1
        return self._constrain(state._replace(live=state.live.at[slot].set(False)))

    def _step(self, params, state: DecodeState):
        """One generate step (traced): ``(new_state, (token, log_prob, valid, length) [S] each)``."""
        c = self.max_target_length
        positions = jnp.minimum(state.lengths, c - 1)
        attend = jnp.ones((self._slots, c), jnp.int32)  # the causal mask does the rest (see the module docstring)
        model = nnx.merge(self._graphdef, params)
        # Every slot at its own position: the decoder's per-row cache_index writes each slot's new key/value at
        # its position (a scatter, in place) and masks keys after it.
        logits, cache = model(state.tokens[:, None], positions[:, None], attend, cache=state.cache,
                              cache_index=positions)
        logits, k, v = logits[:, 0], cache.k, cache.v
        nxt, nxt_lp = self._select(logits, state.controls, state.steps)
        emitted = state.tokens
        stopped = jnp.any(emitted[:, None] == state.controls.stop_ids, axis=-1)
        finished = stopped | (state.steps >= state.controls.max_new_tokens) | (state.lengths + 1 >= c)
        live = state.live & ~finished
        advance = state.live.astype(jnp.int32)
        new = DecodeState(
            cache=KVCache(k, v), tokens=jnp.where(live, nxt, state.tokens),
            log_probs=jnp.where(live, nxt_lp, state.log_probs), lengths=state.lengths + advance,
            steps=state.steps + advance, live=live, controls=state.controls,
        )
        return self._constrain(new), (emitted, jnp.where(state.live, state.log_probs, 0.0), state.live, state.steps)

    def _generate_impl(self, params, state: DecodeState):
        self._num_traces += 1
        new, (tok, lp, valid, length) = self._step(params, state)
        data = jnp.stack([tok, valid.astype(jnp.int32), length, jax.lax.bitcast_convert_type(lp, jnp.int32)], axis=1)
        return new, data

    def _steps_impl(self, params, state: DecodeState, stop_at_free):
        self._num_traces += 1
        k, s = self.steps_per_call, self._slots

        def cond(carry):
            i, st, freed, *_ = carry
            return (i < k) & jnp.any(st.live) & ~(stop_at_free & freed)

        def body(carry):
            i, st, freed, toks, lps, valid = carry
            new, (tok, lp, ok, _) = self._step(params, st)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, tok[None], i, axis=0)
            lps = jax.lax.dynamic_update_slice_in_dim(lps, lp[None], i, axis=0)
            valid = jax.lax.dynamic_update_slice_in_dim(valid, ok[None], i, axis=0)
            return i + 1, new, freed | jnp.any(st.live & ~new.live), toks, lps, valid

        carry = (jnp.int32(0), state, jnp.bool_(False), jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32),
                 jnp.zeros((k, s), jnp.bool_))
        i, state, _, toks, lps, valid = jax.lax.while_loop(cond, body, carry)
        return state, (toks, lps, valid, i)
