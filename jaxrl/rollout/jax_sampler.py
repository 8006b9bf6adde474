"""The embedded JAX rollout engine (``actor_rollout_ref.rollout.name=jax``).

Generation is two jitted programs per shape bucket:

* **prefill** ``[B, P]`` (or packed, below): left-padded prompts (``positions = cumsum(mask) - 1``) are run once through
  the decoder (hidden states only, no ``[B, P, V]`` logits), filling slots ``[0, P-1)`` of a KV cache
  of length ``P + R - 1`` with every prompt token but the last.
* **decode**: one ``jax.lax.while_loop`` over at most ``R`` steps inside one jit; step ``t`` feeds
  the last prompt token (``t = 0``) or the previous sample at cache slot ``P - 1 + t``, samples token
  ``t``, and the loop stops early once every row has emitted an eos/stop token. Finished rows keep
  running (static shapes) but their outputs are masked to the pad id / log-prob 0.

**Decode in segments over a growing cache** (:func:`decode_segment_ends`): a decode step attends over every slot of
the cache it is given, filled or not, and reading the cache is most of a long response's step (SmolLM2-135M, batch
32, 64 new tokens on 2 CPU cores: 7.1 s with a 127-slot cache, 16.9 s with 639 slots). So long responses are decoded
in up to ``max_decode_segments`` segments of at least ``decode_segment_min_tokens`` steps: segment ``k`` runs its own
compiled loop over a cache just long enough for its last step (``P - 1 + end_k`` slots), and between segments each
layer's cache is copied into the next, longer one (:meth:`JaxSampler._grow_layers`). The tokens and log-probs are those
of one loop over the whole cache (attention over more zeroed, masked slots changes nothing but float32 summation
order); the cost is one more compiled loop per segment.

**Finished rows compacted away** (without a mesh, ``compact_finished_rows=True``, the default): a row that stopped
still costs a full row of every later step (static shapes), so the decode loop also yields to the host once at most
half of its rows are still generating (and that half has at least ``compact_min_rows`` rows); the host gathers the
live rows' state and cache rows into a batch of ``_batch_bucket(live)`` rows and the loop goes on with it. Rows keep
their global row index, so their random streams and samples are unchanged (up to float32 summation order in a
differently sized batch, as with batch bucketing below). Each smaller batch is one more compiled decode program, built
only when a compaction happens.

**Packed prefill** (without a mesh, ``packed_prefill=True``, the default): the prefill runs only the prompts' real
tokens, laid end to end in one row (:mod:`jaxrl.rollout.prompt_packing`, :meth:`Decoder.prefill_packed`), and
scatters each token's keys/values to its slot of the left-padded cache layout above: the same cache (up to float32
summation order) for ``sum(prompt lengths)`` positions of projections instead of ``B x P``, attention per prompt.
SmolLM2-135M, 64 prompts of 15-24 tokens (``P`` = 32), 2-core CPU: prefill 2.06 -> 1.32 s; 32 prompts 1.10 -> 0.65 s.

**One prefill per distinct prompt** (without a mesh): the ``n`` samples of a prompt share its prompt, so the prefill
runs on the chunk's distinct prompts only (batch bucketed as below) and copies each prompt's cache slots to its ``n``
rows (``jnp.take`` over the batch axis) before the decode loop: GRPO's ``n = 4..16`` prefills ``n`` times fewer
tokens, as vLLM's prefix cache would. On a mesh every row is prefilled (rows stay sharded over ``data``).

Shapes are bucketed so a handful of programs compile: the prompt width ``P`` is rounded up to a
multiple of ``prompt_length_bucket`` (capped at ``max_prompt_length``), the batch to a power of two
(capped at ``max_batch_size``), and the stop-id list to a power of two >= 8. ``R`` is
``max_new_tokens`` exactly (one program per distinct value). Sampling controls (temperature, top-k,
top-p, greedy, seed) are traced scalars and never recompile.

Randomness: the key of row ``r`` at step ``t`` is ``fold_in(fold_in(key(seed), r), t)`` where ``r``
is the row's global index in the call (``prompt_index * n + j``). A row's random stream thus
depends only on (seed, row index, step): not on batch chunking (``max_batch_size``), batch
bucketing, prompt-width bucketing, or the lengths of the other prompts in the call. What is *not*
guaranteed: bitwise-equal logits across different padded shapes (XLA may pick other reduction
orders for other ``[B, P]``), so a near-tie between two tokens can in rare cases resolve
differently when the same prompt is generated in a differently shaped batch.

On a device mesh (``JaxSampler(..., mesh=...)``, the rollout mesh of a placement) the weights arrive already laid
out on the mesh by the weight sync (tensor-parallel over ``tensor``, replicated over ``data``), and each chunk's
per-row inputs are placed with rows over the mesh's ``data`` axis (data-parallel replicas); the KV cache and
logits follow by sharding propagation inside the same jitted programs. Sampling is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.distributed import to_global, to_host
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import KVCache, init_cache
from jaxrl.models.scan_layout import is_scan_layout, unstack_layers, unstacked_copy
from jaxrl.rollout.base import RolloutOutput, SamplingParams, WeightFormatError, check_prompts
from jaxrl.rollout.prompt_packing import pack_prompts
from jaxrl.rollout.sampling import select_tokens
from jaxrl.rollout.weight_format import WeightFormat, check_same_params
from sharding.rules import Rules

__all__ = ["JaxSampler"]

_MIN_STOP_SLOTS = 8
_ROLLOUT_DTYPES = (None, "float32", "bfloat16")
DECODE_SEGMENT_MIN_TOKENS = 128  # the fewest decode steps a segment runs (shorter responses: one loop)
COMPACT_MIN_ROWS = 4  # the decode compacts its batch only down to this many rows (each size: one more program)


def decode_segment_ends(max_new_tokens: int, max_segments: int, min_tokens: int = DECODE_SEGMENT_MIN_TOKENS
                        ) -> tuple[int, ...]:
    """The decode steps at which each segment of :meth:`JaxSampler.generate`'s decode ends (exclusive; the last is
    ``max_new_tokens``): ``k = min(max_segments, max_new_tokens // min_tokens)`` segments (at least 1) of
    ``ceil(max_new_tokens / k)`` steps, the last one shorter when it does not divide. E.g. 512 new tokens, 4 segments:
    ``(128, 256, 384, 512)``; 200: ``(200,)``.

    Raises:
      ValueError: a count below 1.
    """
    for name, v in (("max_new_tokens", max_new_tokens), ("max_segments", max_segments), ("min_tokens", min_tokens)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    k = max(1, min(int(max_segments), int(max_new_tokens) // int(min_tokens)))
    step = -(-int(max_new_tokens) // k)
    return tuple(min(int(max_new_tokens), step * i) for i in range(1, k + 1))


@partial(jax.jit, static_argnums=1)
def _per_layer_matrices_as(params, dtype):
    """``params`` per layer (:func:`unstack_layers`) with every floating leaf of 2+ dimensions (the weight matrices,
    the embedding) in ``dtype``; other leaves as they are. One jitted program: XLA fuses each layer's slice with its
    cast, so the output is the only copy (unstacking first, then casting, held a float32 copy of the layers too)."""
    return jax.tree.map(lambda w: w.astype(dtype) if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating) else w,
                        unstack_layers(params))


def _rollout_attributes(model_dtype, dtype: str | None) -> dict:
    """The decoder attributes a rollout in ``dtype`` sets (:meth:`JaxSampler._model`) on a model computing in
    ``model_dtype``: none when ``dtype`` is None or ``model_dtype``; ``matmul_dtype`` for bfloat16 on a float32 model;
    ``dtype`` (every module's compute dtype) for float32 on a bfloat16 model."""
    if dtype is None or jnp.dtype(dtype) == jnp.dtype(model_dtype):
        return {}
    if jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(model_dtype) == jnp.float32:
        return {"matmul_dtype": jnp.dtype(jnp.bfloat16)}
    return {"dtype": jnp.dtype(dtype)}


def _per_layer(params):
    """``params``' per-layer tree (abstract: shapes and dtypes only) when in the scan layout, else ``params``."""
    return jax.eval_shape(unstack_layers, params) if is_scan_layout(params) else params


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _keep_rows(out: tuple, got: tuple, slot_row: np.ndarray) -> None:
    """Copy the decode's host outputs ``got`` (response ids, log-probs, mask ``[B, R]``) of every batch slot that
    decodes a real row (``slot_row[b] < len(out[0])``) into that row of ``out`` (the same three arrays, one row per
    real row)."""
    real = slot_row < len(out[0])
    for dst, src in zip(out, got):
        dst[slot_row[real]] = src[real]


def _cache_mask(prompt_mask: jax.Array, max_new_tokens: int) -> jax.Array:
    """Key mask over the cache slots [B, P + R - 1]: the prompt mask, then ones for generated slots."""
    gen = jnp.ones((prompt_mask.shape[0], max_new_tokens - 1), prompt_mask.dtype)
    return jnp.concatenate([prompt_mask, gen], axis=1)


class JaxSampler:
    """KV-cached batched sampler over a Flax NNX :class:`~jaxrl.models.decoder.Decoder`.

    Args:
      model_cfg: the decoder's :class:`ModelConfig` (``bos_token_id`` is used for empty prompts,
        ``vocab_size`` to validate ids, layer/head sizes for the cache).
      graphdef, params: ``nnx.split(model)``; the model is rebuilt with ``nnx.merge`` inside jit.
      pad_token_id: id written into padding (prompt left padding, response right padding); in
        ``[0, vocab_size)``.
      eos_token_ids: ids that end a response (non-empty is usual; may be empty).
      max_prompt_length: longest accepted prompt, in tokens (>= 1).
      prompt_length_bucket: prompt widths are padded up to a multiple of this (>= 1), capped at
        ``max_prompt_length``.
      max_batch_size: rows per generated chunk (>= 1); ``None`` = all rows in one chunk.
      cache_dtype: dtype of the KV cache.
      mesh: the rollout mesh (axes ``(data, fsdp, tensor)``, e.g. ``Placement.rollout_mesh``), or None for one
        device. With a mesh, ``params`` (initial and every :meth:`update_weights`) must already live on it (the
        weight sync's output; the sampler does not move weights), and each chunk's per-row inputs (prompt ids and
        mask ``[B, P]``, row ids and validity ``[B]``) are placed with ``B`` over ``data`` when the bucketed ``B``
        is divisible by it, else replicated on the mesh.
      rules: with a mesh: the logical-axis rules the weights are laid out by (default
        :data:`sharding.rules.TENSOR_PARALLEL_RULES`); part of the declared :attr:`weight_format`.
      packed_prefill: without a mesh, prefill the prompts' real tokens laid end to end in one row (default)
        instead of the left-padded ``[B, P]`` batch; the same cache up to float32 summation order. Ignored on a mesh.
      max_decode_segments: decode a long response in at most this many segments over a cache grown between them
        (module docstring, :func:`decode_segment_ends`); 1 = one loop over the whole cache (one compiled decode
        program per shape instead of one per segment).
      decode_segment_min_tokens: the fewest steps of a segment (default :data:`DECODE_SEGMENT_MIN_TOKENS`).
      compact_finished_rows: without a mesh, drop the rows that stopped from the decode: once at most half of the
        batch is still generating (and that half is at least ``compact_min_rows`` rows), the live rows' state and
        cache rows are gathered into a batch of half the size or less, which decodes on (module docstring).
      compact_min_rows: the smallest batch a compaction makes (default :data:`COMPACT_MIN_ROWS`).
      dtype: the rollout's compute dtype (verl's ``actor_rollout_ref.rollout.dtype``): None (default) = the
        model's (``graphdef``'s) compute dtype. ``"bfloat16"`` for a float32 model: each ``generate`` call reads a
        bfloat16 copy of the weight matrices (the embedding, projections and q/k/v biases; the norms' scales stay as
        they are) and runs every projection and the LM head as a bfloat16 x bfloat16 -> float32 matmul
        (:func:`jaxrl.models.decoder.project`); activations, attention, the KV cache and the sampling stay float32.
        ``"float32"`` for a bfloat16 model: the whole forward in float32. Sampled log-probs then differ from the
        policy's by the rounding, as a bfloat16 vLLM's do: the trainer's old-log-prob pass
        (``actor.recompute_old_log_prob``) rescores the samples with the policy.

    Attributes:
      weight_format: the one weight format :meth:`update_weights` accepts (:class:`WeightFormat` ``"jax"``, on
        ``mesh`` when given).

    Raises:
      ValueError: an argument is out of range (the message names it), or ``mesh`` has no ``"data"`` axis.
      WeightFormatError: with a mesh, ``params`` do not live on it.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef,
        params: nnx.State,
        *,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...],
        max_prompt_length: int,
        prompt_length_bucket: int = 32,
        max_batch_size: int | None = None,
        cache_dtype=jnp.float32,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        packed_prefill: bool = True,
        dtype: str | None = None,
        max_decode_segments: int = 4,
        decode_segment_min_tokens: int = DECODE_SEGMENT_MIN_TOKENS,
        compact_finished_rows: bool = True,
        compact_min_rows: int = COMPACT_MIN_ROWS,
    ) -> None:
        vocab = model_cfg.vocab_size
        if not isinstance(pad_token_id, (int, np.integer)) or not (0 <= pad_token_id < vocab):
            raise ValueError(f"pad_token_id={pad_token_id!r} must be an int in [0, {vocab})")
        eos_token_ids = tuple(int(e) for e in eos_token_ids)
        bad_eos = [e for e in eos_token_ids if not (0 <= e < vocab)]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} are outside the vocabulary [0, {vocab})")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length!r} must be an int >= 1")
        if not isinstance(prompt_length_bucket, int) or prompt_length_bucket < 1:
            raise ValueError(f"prompt_length_bucket={prompt_length_bucket!r} must be an int >= 1")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size={max_batch_size!r} must be None or an int >= 1")
        if mesh is not None and "data" not in mesh.axis_names:
            raise ValueError(f"the rollout mesh needs a 'data' axis; got axes {mesh.axis_names}")
        if mesh is None and rules is not None:
            raise ValueError("rules= lays weights out on a mesh; pass mesh= too (or neither)")
        for name, v in (("max_decode_segments", max_decode_segments),
                        ("decode_segment_min_tokens", decode_segment_min_tokens),
                        ("compact_min_rows", compact_min_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if dtype not in _ROLLOUT_DTYPES:
            raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype!r} is invalid; valid: "
                             + ", ".join(map(str, _ROLLOUT_DTYPES)) + " (None: the model's dtype)")

        self.model_cfg = model_cfg
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = eos_token_ids
        self.max_prompt_length = max_prompt_length
        self.prompt_length_bucket = prompt_length_bucket
        self.max_batch_size = max_batch_size
        self.cache_dtype = cache_dtype
        self.mesh = mesh
        self.packed_prefill = bool(packed_prefill) and mesh is None
        self.max_decode_segments = max_decode_segments
        self.decode_segment_min_tokens = decode_segment_min_tokens
        self.compact_finished_rows = bool(compact_finished_rows)
        self.compact_min_rows = compact_min_rows
        # what _model sets on the decoder's modules: {} = the model as built
        self._rollout_attrs = _rollout_attributes(nnx.merge(graphdef, _per_layer(params)).dtype, dtype)
        self.weight_format = WeightFormat.jax(mesh, rules)
        if mesh is None:
            self.engine_name = "jax sampler"
        else:
            self.engine_name = "jax sampler on mesh " + " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
            self.weight_format.check(params, self.engine_name)
            self._rows = NamedSharding(mesh, PartitionSpec("data"))
            self._replicated = NamedSharding(mesh, PartitionSpec())
        self._graphdef = graphdef
        # without a mesh the weights may come in the trainer's scan layout (layers stacked, jaxrl.models.scan_layout,
        # the actor's own buffers): generate() unstacks them for its call only, so no per-layer copy outlives it
        self.takes_scan_layout = mesh is None
        self._check_layout(params)
        self._params = jax.tree.map(jnp.asarray, params)
        self._num_traces = 0
        self.last_decode_steps = 0  # decode-loop steps of the last generate() (max over chunks)
        self._prefill_jit = jax.jit(self._prefill_impl, static_argnames=("max_new_tokens",))
        self._prefill_packed_jit = jax.jit(self._prefill_packed_impl, static_argnames=("shape",))
        self._decode_jit = jax.jit(self._decode_impl, donate_argnames=("cache", "carry"))
        self._grow_jit = jax.jit(self._grow_impl, static_argnames=("length",))
        self._take_jit = jax.jit(self._take_impl)

    @classmethod
    def from_model(cls, model: nnx.Module, model_cfg: ModelConfig, **kwargs) -> "JaxSampler":
        """Build from a live NNX model: ``graphdef, params = nnx.split(model)``; kwargs as ``__init__``."""
        graphdef, params = nnx.split(model)
        return cls(model_cfg, graphdef, params, **kwargs)

    # ------------------------------------------------------------------ weights
    @property
    def params(self) -> nnx.State:
        """The current weights (the state passed to the last :meth:`update_weights`)."""
        return self._params

    @property
    def num_compiles(self) -> int:
        """How many programs (prefill, decode per segment and batch size, cache growth, row gathers) have been traced
        and compiled so far."""
        return self._num_traces

    def update_weights(self, params: nnx.State) -> None:
        """Replace the weights used by later :meth:`generate` calls (no recompilation).

        Called by :meth:`jaxrl.rollout.weight_sync.WeightSync.sync` (which wraps every failure in
        ``WeightSyncError``).

        Args:
          params: an ``nnx.State`` with exactly the same tree structure, leaf shapes and dtypes as the
            current one (e.g. the trainer's updated ``nnx.state(model)`` after layout translation); with a mesh,
            every array on it. Without a mesh the same weights in the scan layout (a trained role's stacked layers)
            are accepted too (compared after unstacking).
        Raises:
          WeightFormatError: not an ``nnx.State``, or (with a mesh) arrays that do not live on the mesh.
          ValueError: names the missing/extra leaf paths, or the first leaves whose shape or dtype differ.
        """
        self.weight_format.check(params, self.engine_name)
        self._check_layout(params)
        check_same_params(_per_layer(self._params), _per_layer(params), "sampler")
        new = jax.tree.map(jnp.asarray, params)
        self._params = new

    def _check_layout(self, params) -> None:
        """Refuse the scan layout on a mesh (``WeightFormatError``): the translator hands this engine per-layer
        weights there."""
        if is_scan_layout(params) and not self.takes_scan_layout:
            raise WeightFormatError(f"{self.engine_name} takes per-layer weights; got the scan layout (stacked layers)")

    # ------------------------------------------------------------------ jitted programs
    def _model(self, params):
        """The decoder on ``params`` inside a jitted program, computing in the rollout's ``dtype``
        (``nnx.Module.set_attributes`` on the merged copy; the graphdef and the trainer's model are untouched)."""
        model = nnx.merge(self._graphdef, params)
        if self._rollout_attrs:
            model.set_attributes(**self._rollout_attrs, raise_if_not_found=False)
        return model

    def _call_weights(self):
        """The weights one ``generate`` call reads: per-layer (a copy of the layers when held stacked); with a
        bfloat16 rollout of a float32 model a bfloat16 copy of every weight matrix (``ndim >= 2``; the norms' scales
        stay as they are), unstacked and cast by one program (:func:`_per_layer_matrices_as`), so no float32
        per-layer copy is held beside the bfloat16 one."""
        md = self._rollout_attrs.get("matmul_dtype")
        if md is None:
            return unstacked_copy(self._params)  # the layers only: the embedding stays the actor's array
        return _per_layer_matrices_as(self._params, md)

    def _prefill(self, params, input_ids, prompt_mask, *, max_new_tokens: int):
        """The jitted prefill (:meth:`_prefill_impl`), its row inputs placed on the mesh first (with one)."""
        if self.mesh is not None:
            input_ids, prompt_mask = self._place_rows(input_ids, prompt_mask)
        return self._prefill_jit(params, input_ids, prompt_mask, max_new_tokens=max_new_tokens)

    def _prefill_rows(self, input_ids: np.ndarray, prompt_mask: np.ndarray, prompt_index: np.ndarray):
        """The prompts a chunk's host ``[B, P]`` rows (the first ``len(prompt_index)`` real, the rest batch filler)
        prefill, each once: ``(ids [U, P], mask [U, P], row_map [B])``, ``U`` the distinct prompts bucketed to a
        power of two and ``row_map[b]`` row ``b``'s prompt (filler rows read prompt 0's slots, which their mask
        hides). ``None`` when every row is prefilled as it is: on a mesh, or with padded prefill and no repeated
        prompt. With packed prefill and no repeated prompt: the rows as they are and ``row_map`` None (the cache is
        the prefill's own; a row gather would hold a second cache-sized buffer at the prefill's end). ``prompt_index``
        int32 [m]: the prompt of each real row, non-decreasing.
        """
        m = len(prompt_index)
        _, firsts, row_of = np.unique(prompt_index, return_index=True, return_inverse=True)
        if self.mesh is not None or (len(firsts) == m and not self.packed_prefill):
            return None
        if len(firsts) == m:
            return input_ids, prompt_mask, None
        u = self._batch_bucket(len(firsts))
        ids_u = np.full((u, input_ids.shape[1]), self.pad_token_id, np.int32)
        mask_u = np.zeros_like(ids_u)
        ids_u[: len(firsts)], mask_u[: len(firsts)] = input_ids[firsts], prompt_mask[firsts]
        mask_u[len(firsts):, -1] = 1  # filler prompts: one pad token, as filler rows
        row_map = np.zeros((input_ids.shape[0],), np.int32)
        row_map[:m] = row_of.reshape(-1)
        return ids_u, mask_u, row_map

    def _decode(self, params, cache, carry, prompt_mask, row_ids, stop_ids, controls, t_stop, shrink_at=0):
        """One jitted decode segment (:meth:`_decode_impl`), its inputs placed on the mesh first (with one): rows
        over ``data``; the step counter, stop ids, sampling controls, ``t_stop`` and ``shrink_at`` replicated."""
        t_stop, shrink_at = np.int32(t_stop), np.int32(shrink_at)
        if self.mesh is not None:
            t, *rows = carry
            prompt_mask, row_ids, *rows = self._place_rows(prompt_mask, row_ids, *rows)
            t, stop_ids, controls, t_stop, shrink_at = to_global((t, stop_ids, controls, t_stop, shrink_at),
                                                                 self._replicated)
            carry = (t, *rows)
        return self._decode_jit(params, cache, carry, prompt_mask, row_ids, stop_ids, controls, t_stop, shrink_at)

    def _decode_rows(self, weights, cache, carry, prompt_mask, row_ids, stop_ids, controls, *, width: int,
                     ends: tuple[int, ...], rows: int):
        """Decode one chunk: its segments (``ends``, :func:`decode_segment_ends`), the cache grown between them, and,
        without a mesh, its finished rows compacted away (:meth:`_compact`) whenever at most half of the batch is
        still generating and that half has at least ``compact_min_rows`` rows.

        Args: as :meth:`_decode_impl` (``prompt_mask`` on the device, ``row_ids`` host int32 [B]); width: the prompt
        width ``P``; rows: the chunk's real rows (the first ``rows`` of the batch; the rest are filler).
        Returns: ``(steps, (response_ids int32 [rows, R], log_probs float32 [rows, R], response_mask int32 [rows,
        R]))``, host arrays; ``steps`` the decode steps run.
        """
        r = ends[-1]
        out = (np.full((rows, r), self.pad_token_id, np.int32), np.zeros((rows, r), np.float32),
               np.zeros((rows, r), np.int32))
        slot_row = np.arange(len(row_ids))  # the chunk row each batch slot decodes (>= rows: a filler)
        # between decode calls the cache lives only in these lists of its layers' keys and values, so that growing
        # or compacting it can drop each old layer as soon as its replacement is dispatched
        k, v = list(cache.k), list(cache.v)
        del cache
        for i, end in enumerate(ends):
            if i:  # the next segment's cache: its last step's slot is P - 1 + end - 1
                self._grow_layers(k, v, width - 1 + end)
            while True:
                batch = len(slot_row)
                compacts = (self.compact_finished_rows and self.mesh is None
                            and batch // 2 >= self.compact_min_rows)
                carry, (k, v) = self._decode(weights, KVCache(tuple(k), tuple(v)), carry, prompt_mask, row_ids,
                                             stop_ids, controls, end, batch // 2 if compacts else 0)
                k, v = list(k), list(v)
                steps, done = int(to_host(carry[0])), to_host(carry[2])
                if steps >= end or done.all():
                    break
                _keep_rows(out, to_host(carry[3:]), slot_row)  # the rows dropped next keep their outputs here
                carry, prompt_mask, row_ids, slot_row = self._compact(k, v, carry, prompt_mask, row_ids, slot_row,
                                                                      np.flatnonzero(~done), rows)
            if done.all():  # every row stopped: no later segment runs
                break
        _keep_rows(out, to_host(carry[3:]), slot_row)
        return steps, out

    def _compact(self, k: list, v: list, carry, prompt_mask, row_ids, slot_row, live, rows):
        """The decode state of the ``live`` batch slots only (host int array, ascending), in a batch bucketed to
        ``_batch_bucket(len(live))`` rows; the extra rows repeat the first live row's state but start stopped (their
        outputs are never read: ``slot_row`` marks them with ``rows``). The cache comes as the lists of its layers'
        keys and values (``k`` / ``v``, the caller's only references), whose rows are gathered one layer at a time
        (:meth:`_take_layers`), so about one old layer is held beside the smaller cache.

        Returns ``(carry, prompt_mask, row_ids, slot_row)`` for the smaller batch (``k`` / ``v`` replaced in place)."""
        size = self._batch_bucket(len(live))
        idx = np.concatenate([live, np.full(size - len(live), live[0])]).astype(np.int32)
        take = jnp.asarray(idx)
        self._take_layers(k, v, take)
        t, prev, _, ids, logp, mask = carry
        done = jnp.asarray(np.arange(size) >= len(live))
        prev, ids, logp, mask = (jnp.take(x, take, axis=0) for x in (prev, ids, logp, mask))
        carry = (t, prev, done, ids, logp, mask)
        slot_row = np.concatenate([slot_row[live], np.full(size - len(live), rows)])
        return carry, jnp.take(prompt_mask, take, axis=0), np.asarray(row_ids)[idx], slot_row

    def _take_layers(self, k: list, v: list, idx) -> None:
        """Replace each layer's keys and values in ``k`` / ``v`` (as :meth:`_grow_layers`) by their rows ``idx``
        (int32 [B'])."""
        for i in range(len(k)):
            k[i], v[i] = self._take_jit(k[i], v[i], idx)

    def _grow_layers(self, k: list, v: list, length: int) -> None:
        """Replace each layer's keys and values in ``k`` / ``v`` (lists of ``[B, nKV, S, D]`` arrays, the callers'
        only references to them) by copies with ``length`` slots (the new slots zero), one layer at a time: a
        layer's old buffers are dropped as soon as its copy is dispatched, so the growth holds about one old layer
        beside the new cache, not two caches."""
        for i in range(len(k)):
            k[i], v[i] = self._grow_jit(k[i], v[i], length=length)

    def _place_rows(self, *arrays):
        """Put ``[B, ...]`` host arrays on the mesh: ``B`` over ``data`` when divisible, else replicated (arrays
        already placed pass as they are)."""
        rows = int(np.shape(arrays[0])[0])
        sharding = self._rows if rows % self.mesh.shape["data"] == 0 else self._replicated
        return to_global(arrays, sharding)

    def _prefill_impl(self, params, input_ids, prompt_mask, row_map=None, *, max_new_tokens: int):
        """Fill the KV cache with every prompt token but the last.

        Args: input_ids/prompt_mask int32 [U, P] (left-padded); row_map int32 [B] or None: row ``b`` of the
        returned cache is prompt ``row_map[b]``'s (None: one row per prompt, B = U); max_new_tokens: the decode
        steps ``R`` the cache is sized for (the first decode segment's).
        Returns: KVCache (L arrays [B, nKV, P + R - 1, D] each); slots [0, P-1) hold the prompt (all but its last
        token, which the decode loop feeds first, so prefill never materialises [B, P, V] logits).
        """
        self._num_traces += 1
        batch, width = input_ids.shape
        cache = init_cache(self.model_cfg, batch, width + max_new_tokens - 1, self.cache_dtype)
        if width > 1:
            model = self._model(params)
            positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1) - 1, 0).astype(jnp.int32)
            attn = _cache_mask(prompt_mask, max_new_tokens)
            _, cache = model(
                input_ids[:, :-1], positions[:, :-1], attn, cache=cache, cache_index=jnp.int32(0), return_hidden=True
            )
        return cache if row_map is None else jax.tree.map(lambda x: jnp.take(x, row_map, axis=0), cache)

    def _prefill_packed_impl(self, params, packed, row_map, *, shape: tuple[int, int]):
        """:meth:`_prefill_impl` from prompts packed into one row (:func:`~jaxrl.rollout.prompt_packing.pack_prompts`).

        Args: packed: the :class:`~jaxrl.rollout.prompt_packing.PackedPrompts` arrays ([1, N]); row_map int32
        [B] (row ``b`` of the returned cache is prompt ``row_map[b]``'s) or None (row ``b`` is prompt ``b``, B = U);
        shape: static ``(U, cache_len)``, the prompts and slots per row of the cache the packed tokens are written
        into.
        Returns: KVCache (L arrays [B, nKV, cache_len, D] each), the same slots filled as by :meth:`_prefill_impl`.
        """
        self._num_traces += 1
        cache = init_cache(self.model_cfg, *shape, self.cache_dtype)
        model = self._model(params)
        cache = model.prefill_packed(packed.input_ids, packed.positions, packed.segment_cols, cache, packed.rows,
                                     packed.slots)
        return cache if row_map is None else jax.tree.map(lambda x: jnp.take(x, row_map, axis=0), cache)

    def _take_impl(self, k, v, idx):
        """One layer's keys and values ``[B, nKV, S, D]``, rows ``idx`` (int32 [B'])."""
        self._num_traces += 1
        return jnp.take(k, idx, axis=0), jnp.take(v, idx, axis=0)

    def _grow_impl(self, k, v, *, length: int):
        """One layer's keys and values ``[B, nKV, S, D]`` padded with zero slots to ``[B, nKV, length, D]``."""
        self._num_traces += 1
        pad = ((0, 0), (0, 0), (0, length - k.shape[2]), (0, 0))
        return jnp.pad(k, pad), jnp.pad(v, pad)

    def _decode_impl(self, params, cache, carry, prompt_mask, row_ids, stop_ids, controls, t_stop, shrink_at):
        """Sample tokens ``t`` in ``[carry.t, t_stop)``, one while_loop step per token: a segment of the decode
        (:func:`decode_segment_ends`). The loop ends early once at most ``shrink_at`` rows are still generating
        (``shrink_at`` 0: once every row has stopped), so the caller can compact the batch (:meth:`_decode_rows`).

        Step t feeds token ``x_t`` (t = 0: the last prompt token; then the previous sample) at cache
        slot ``P - 1 + t`` and RoPE position ``prompt_len - 1 + t``, and samples token t.

        Args (all arrays): cache from prefill or the previous segment (grown), ``S >= P - 1 + t_stop`` slots, every
          slot it has attended over (so ``S - P + 1`` steps could run on it); carry: ``(t, prev, done, ids, logp,
          mask)``: the next step (int32 scalar), the token it feeds int32 [B], rows already stopped bool [B] (batch
          filler rows start stopped, so they never delay the early exit), response_ids int32 [B, R], log_probs
          float32 [B, R], response_mask int32 [B, R] so far; prompt_mask int32 [B, P]; row_ids int32 [B] (global
          row index, for PRNG); stop_ids int32 [S] (-1 = unused slot); controls: dict of scalars seed (uint32),
          temperature, top_k, top_p (float32/int32), greedy (bool); t_stop int32 scalar, at most ``S - P + 1``;
          shrink_at int32 scalar >= 0.
        Returns:
          ``(carry, cache)``: the carry after the segment (``t < t_stop`` when every row stopped early) and the
          cache (returned so the donated input buffers are updated in place by the loop instead of copied).
        """
        self._num_traces += 1
        batch, width = prompt_mask.shape
        model = self._model(params)
        attn = _cache_mask(prompt_mask, cache.k[0].shape[2] - width + 1)
        prompt_len = prompt_mask.sum(axis=-1).astype(jnp.int32)
        pad = jnp.int32(self.pad_token_id)

        base = jax.random.key(controls["seed"])
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, row_ids)

        def cond(state):
            t, _, _, done, *_ = state
            return (t < t_stop) & (jnp.sum(~done, dtype=jnp.int32) > shrink_at)

        def body(state):
            t, prev, cache, done, ids, logp, mask = state
            logits, cache = model(
                prev[:, None], (prompt_len - 1 + t)[:, None], attn, cache=cache, cache_index=width - 1 + t
            )
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
            tok, lp = select_tokens(
                logits[:, 0],
                keys,
                temperature=controls["temperature"],
                top_k=controls["top_k"],
                top_p=controls["top_p"],
                greedy=controls["greedy"],
            )
            alive = ~done
            tok = jnp.where(alive, tok, pad)
            ids = jax.lax.dynamic_update_slice_in_dim(ids, tok[:, None], t, axis=1)
            logp = jax.lax.dynamic_update_slice_in_dim(logp, jnp.where(alive, lp, 0.0)[:, None], t, axis=1)
            mask = jax.lax.dynamic_update_slice_in_dim(mask, alive.astype(jnp.int32)[:, None], t, axis=1)
            stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            return t + 1, tok, cache, done | (alive & stopped), ids, logp, mask

        t, prev, done, ids, logp, mask = carry
        t, prev, cache, done, ids, logp, mask = jax.lax.while_loop(cond, body, (t, prev, cache, done, ids, logp, mask))
        return (t, prev, done, ids, logp, mask), cache

    # ------------------------------------------------------------------ host side
    def _prompt_width(self, longest: int) -> int:
        b = self.prompt_length_bucket
        return min(max(1, math.ceil(longest / b)) * b, self.max_prompt_length)

    def _batch_bucket(self, rows: int) -> int:
        size = _next_pow2(rows)
        return min(size, self.max_batch_size) if self.max_batch_size else size

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return check_prompts(
            prompts, vocab_size=self.model_cfg.vocab_size, bos_token_id=self.model_cfg.bos_token_id,
            max_prompt_length=self.max_prompt_length,
        )

    def _stop_array(self, extra: tuple[int, ...], ignore_eos: bool = False) -> np.ndarray:
        stops = sorted(set(extra) if ignore_eos else set(self.eos_token_ids) | set(extra))
        size = max(_MIN_STOP_SLOTS, _next_pow2(len(stops)))
        arr = np.full((size,), -1, np.int32)
        arr[: len(stops)] = stops
        return arr

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, rng_seed: int | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses for each token-id prompt.

        Args:
          prompts: token-id lists, each of length 0..max_prompt_length. An empty prompt stands for
            ``[bos_token_id]`` (allowed only when the model config has a bos id).
          params: :class:`SamplingParams`.
          rng_seed: overrides ``params.seed`` (the trainer passes one per step); in [0, 2**32).
        Returns:
          :class:`RolloutOutput` with N = len(prompts) * n rows, P = bucketed prompt width,
          R = ``params.max_new_tokens``.
        Raises:
          ValueError: empty prompt list, an overlong prompt (names its index and lengths), an
            out-of-vocabulary id, an empty prompt without a bos id, or a bad ``rng_seed``.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        seed = params.seed if rng_seed is None else rng_seed
        if not isinstance(seed, (int, np.integer)) or not (0 <= int(seed) < 2**32):
            raise ValueError(f"rng_seed={rng_seed!r} must be an int in [0, 2**32)")
        prompts = self._check_prompts(prompts)
        n, r = params.n, params.max_new_tokens
        width = self._prompt_width(max(len(p) for p in prompts))

        rows = len(prompts) * n
        prompt_ids = np.full((rows, width), self.pad_token_id, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        prompt_index = np.repeat(np.arange(len(prompts), dtype=np.int32), n)
        for i, p in enumerate(prompts):
            prompt_ids[i * n : (i + 1) * n, width - len(p) :] = p
            prompt_mask[i * n : (i + 1) * n, width - len(p) :] = 1

        greedy = params.greedy
        controls = {  # host scalars: placed (replicated) by _decode on a mesh, else by jit
            "seed": np.uint32(int(seed)),
            "temperature": np.float32(1.0 if greedy else params.temperature),
            "top_k": np.int32(params.top_k),
            "top_p": np.float32(params.top_p),
            "greedy": np.bool_(greedy),
        }
        stop_ids = self._stop_array(params.stop_token_ids, params.ignore_eos)

        chunk = self.max_batch_size or rows
        self.last_decode_steps = 0
        # per-layer weights for this call only (the decode reads each layer's arrays; slicing a stacked weight inside
        # the loop would copy it every step)
        weights = self._call_weights()
        out_ids, out_mask, out_logp = [], [], []
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            m = stop - start
            bsz = self._batch_bucket(m)
            ids_c = np.full((bsz, width), self.pad_token_id, np.int32)
            mask_c = np.zeros((bsz, width), np.int32)
            ids_c[:m], mask_c[:m] = prompt_ids[start:stop], prompt_mask[start:stop]
            mask_c[m:, -1] = 1  # filler rows: one pad token, so no row attends to nothing
            row_ids = np.arange(start, start + bsz, dtype=np.int32)
            row_valid = np.arange(bsz) < m
            distinct = self._prefill_rows(ids_c, mask_c, prompt_index[start:stop])
            # the decode's first step feeds each row's last prompt token; filler rows start stopped
            carry = (np.int32(0), ids_c[:, -1].copy(), ~row_valid, np.full((bsz, r), self.pad_token_id, np.int32),
                     np.zeros((bsz, r), np.float32), np.zeros((bsz, r), np.int32))
            ends = decode_segment_ends(r, self.max_decode_segments, self.decode_segment_min_tokens)
            first = width - 1 + ends[0]  # cache slots of the first segment
            ids_c, mask_c = (jnp.asarray(ids_c), jnp.asarray(mask_c)) if self.mesh is None else \
                self._place_rows(ids_c, mask_c)
            if distinct is None:
                cache = self._prefill(weights, ids_c, mask_c, max_new_tokens=ends[0])
            elif self.packed_prefill:  # each distinct prompt's real tokens once, packed into rows
                ids_u, mask_u, row_map = distinct
                packed = pack_prompts(ids_u, mask_u, cache_len=first, pad_token_id=self.pad_token_id)
                cache = self._prefill_packed_jit(weights, jax.tree.map(jnp.asarray, packed),
                                                 None if row_map is None else jnp.asarray(row_map),
                                                 shape=(len(ids_u), first))
            else:  # one prefill per distinct prompt, its slots copied to the prompt's rows
                cache = self._prefill_jit(weights, *map(jnp.asarray, distinct), max_new_tokens=ends[0])
            steps, (ids, logp, mask) = self._decode_rows(weights, cache, carry, mask_c, row_ids, stop_ids, controls,
                                                         width=width, ends=ends, rows=m)
            del cache
            self.last_decode_steps = max(self.last_decode_steps, steps)
            out_ids.append(ids)
            out_mask.append(mask)
            out_logp.append(logp)

        return RolloutOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=np.concatenate(out_ids).astype(np.int32),
            response_mask=np.concatenate(out_mask).astype(np.int32),
            rollout_log_probs=np.concatenate(out_logp).astype(np.float32),
            prompt_index=prompt_index,
        )
