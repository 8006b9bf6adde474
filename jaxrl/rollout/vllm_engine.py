"""The vLLM rollout engine (``actor_rollout_ref.rollout.name=vllm``), in the trainer's process.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the V1 engine core and its single worker live in this
Python process, next to the JAX trainer), so a weight sync is a function call, not a data transfer between
processes:

* **start**: the initial params are written as a Hugging Face directory (:func:`jaxrl.models.hf.save_hf`) under
  ``work_dir`` and ``vllm.LLM`` loads it (``skip_tokenizer_init=True``: prompts arrive as token ids and responses
  leave as token ids, so vLLM never needs the tokenizer).
* **generate**: one vLLM request per response row (``n`` rows per prompt, each ``n=1``) with its own seed, so a
  row's random stream depends only on (step seed, row index), as in :class:`~jaxrl.rollout.JaxSampler`; prefix
  caching makes the ``n`` copies of a prompt share its KV blocks. Outputs are padded into the same arrays the
  JAX sampler returns (prompts left-padded to the bucketed width, responses right-padded to ``max_new_tokens``).
* **update_weights**: the engine declares the ``"hf_device"`` weight format
  (:class:`~jaxrl.rollout.weight_format.WeightFormat`): whole Hugging Face checkpoint tensors, ``[out, in]``, as
  ``jax.Array`` s on ``jax.devices()[0]``, and refuses anything else. :class:`~jaxrl.rollout.weight_sync.WeightSync`
  produces them with the translator's ``"hf"`` plan from the train mesh -> each ``jax.Array`` becomes a torch
  tensor by DLPack (same buffer, same device: on GPU no host round trip, on CPU no copy) ->
  ``llm.collective_rpc("reload_weights", ...)`` on every worker (vLLM's in-place reload: ``model.load_weights``
  wrapped in its layerwise-reload hooks, which redo post-load processing such as CPU weight repacking) ->
  ``reset_prefix_cache`` (cached KV blocks were computed by the old weights). The whole sync runs under a timeout
  and any failure raises :class:`WeightSyncError`.
* **memory** (``enable_sleep_mode``, from ``rollout.free_cache_engine`` on CUDA): after each generate
  ``llm.sleep(level=1)`` frees the KV cache and offloads the weights so the trainer's update has the GPU; a sync
  first wakes the weights only (``wake_up(tags=["weights"])``), the next generate wakes the KV cache. vLLM's CPU
  platform has no sleep mode; there the prefix-cache reset after every sync is what keeps stale entries out.

Why checkpoint-format tensors and not the translator's fused ``"vllm"`` target: vLLM's ``model.load_weights``
takes checkpoint-format tensors (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``, full unsharded
shapes) and each worker's ``weight_loader`` fuses them into ``qkv_proj``/``gate_up_proj`` and cuts its own
tensor-parallel shard (``stacked_params_mapping`` in ``vllm/model_executor/models/{llama,qwen2,qwen3}.py``).
That is correct for every TP degree. The ``"vllm"`` target produces the already-fused per-rank layout, which is
what vLLM's kernel-format reload (``is_checkpoint_format=False``: a direct ``param.copy_``) would need, and that
path is wrong wherever vLLM repacks weights after loading (its CPU GEMMs do).

Split placement (``trainer.placement=split``) runs this engine in its own process instead:
:class:`jaxrl.rollout.vllm_worker.VllmWorkerEngine`.

Log-probs: the engine sets ``logprobs_mode="processed_logprobs"`` (``vllm/config/model.py``), i.e. the
log-softmax after temperature *and* after top-k/top-p. jaxrl's convention (:class:`RolloutOutput`) is
``log_softmax(logits / temperature)`` without truncation. The two agree exactly when top-k/top-p are off (the
usual RL setting) and for greedy rows (vLLM uses temperature 1 there, like jaxrl); with top-k/top-p on, vLLM's
values are renormalised over the kept tokens and are >= jaxrl's by ``-log(kept mass)``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.rollout.base import RolloutOutput, SamplingParams, WeightSyncError, check_prompts
from jaxrl.rollout.weight_format import WeightFormat

__all__ = ["VllmEngine", "WeightSyncError", "row_seeds"]

log = logging.getLogger(__name__)


def row_seeds(seed: int, rows: int, first_row: int = 0) -> list[int]:
    """Per-row vLLM seeds derived from one step seed: ``SeedSequence([seed, row])``'s first 32-bit word.

    Args:
      seed: the step seed, int in [0, 2**32).
      rows: number of response rows (N = prompts * n).
      first_row: the index of the first of these rows in the whole batch (a data-parallel share of it).
    Returns:
      ``rows`` ints in [0, 2**32) for rows ``first_row .. first_row + rows - 1``; row r's seed depends only on
      (seed, r).
    """
    return [int(np.random.SeedSequence([int(seed), r]).generate_state(1)[0])
            for r in range(first_row, first_row + rows)]


def _refresh_tied_lm_head(worker) -> bool:
    """Runs inside each vLLM worker (``collective_rpc``) after a reload, for tied-embedding models on CPU.

    On CPU, vLLM's embedding/LM-head ``process_weights_after_loading`` packs a *copy* of the weight for its GEMM
    (``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``). With tied embeddings the
    checkpoint has no ``lm_head.weight``, so the in-place reload updates the shared embedding but leaves the LM
    head's packed copy stale (greedy tokens then drift from the trainer's). Re-running the LM head's
    post-load processing repacks it from the new weight. Returns whether it was repacked.
    """
    lm_head = getattr(worker.get_model(), "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    weight = getattr(lm_head, "weight", None)
    if method is None or weight is None or weight.numel() == 0:
        return False
    method.process_weights_after_loading(lm_head)
    return True


def _cfg_get(section, key: str, default):
    """``section.key`` for an OmegaConf section, a dataclass or a dict; ``default`` when absent or None."""
    if section is None:
        return default
    try:
        value = section[key] if isinstance(section, Mapping) else getattr(section, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


class VllmEngine:
    """A :class:`~jaxrl.rollout.RolloutEngine` backed by an in-process ``vllm.LLM``.

    Args:
      model_cfg: the policy's :class:`ModelConfig` (eos/bos ids, vocab size).
      graphdef, params: ``nnx.split`` of the policy (:class:`jaxrl.models.decoder.Decoder`); vLLM starts on these
        weights (written as a Hugging Face directory); every :meth:`update_weights` passes the same checkpoint's
        tensors.
      tokenizer: supplies the pad id (``None`` or a tokenizer without one: the model's pad, else its first eos).
      rollout_cfg: the ``actor_rollout_ref.rollout`` section; reads ``tensor_model_parallel_size``,
        ``gpu_memory_utilization``, ``seed`` and ``update_weights_timeout_s`` (each optional).
      max_prompt_length: longest accepted prompt P (tokens, >= 1).
      max_response_length: longest response R (tokens, >= 1); vLLM's ``max_model_len`` is P + R.
      work_dir: where the initial HF model directory is written (``<work_dir>/vllm_init_model``).
      sync_timeout_s: seconds one weight sync may take (> 0); overrides ``rollout_cfg.update_weights_timeout_s``.
      prompt_length_bucket: prompt widths are padded up to a multiple of this (as the JAX sampler does).
      enable_prefix_caching: vLLM prefix caching (the n rows of a prompt share its KV blocks).
      enable_sleep_mode: CUDA only: ``llm.sleep(level=1)`` after every generate (frees the KV cache and offloads
        the weights so the trainer can use the memory) and ``wake_up`` before the next sync/generate.
      dtype: vLLM compute dtype; ``None`` = float32 on CPU, the params' dtype on GPU.
      llm_kwargs: extra keyword arguments for ``vllm.LLM``.

    Attributes:
      weight_format: ``WeightFormat.hf_on_device()``: the only format :meth:`update_weights` accepts.

    Raises:
      ValueError: a bad argument (named), or ``enable_sleep_mode`` on a platform that is not CUDA.
      ImportError: vLLM is not installed (``pip install -e .[vllm]``; on CPU ``scripts/setup_vllm_cpu.sh``).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef,
        params: nnx.State,
        tokenizer=None,
        *,
        rollout_cfg=None,
        max_prompt_length: int,
        max_response_length: int,
        work_dir: str | os.PathLike,
        sync_timeout_s: float | None = None,
        prompt_length_bucket: int = 32,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        dtype: str | None = None,
        llm_kwargs: dict | None = None,
    ) -> None:
        for name, v in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length),
                        ("prompt_length_bucket", prompt_length_bucket)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        timeout = sync_timeout_s if sync_timeout_s is not None else _cfg_get(rollout_cfg, "update_weights_timeout_s", 600.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"sync timeout {timeout!r} must be a finite number of seconds > 0 "
                             "(actor_rollout_ref.rollout.update_weights_timeout_s)")
        tp = _cfg_get(rollout_cfg, "tensor_model_parallel_size", 1)
        mem = _cfg_get(rollout_cfg, "gpu_memory_utilization", 0.5)
        seed = _cfg_get(rollout_cfg, "seed", 0)
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp!r} must be an int >= 1")
        if not (0.0 < float(mem) <= 1.0):
            raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={mem!r} must be in (0, 1]")

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: collective_rpc is a call
        import vllm
        from vllm.platforms import current_platform

        from jaxrl.models.hf import save_hf

        self.model_cfg = model_cfg
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.prompt_length_bucket = prompt_length_bucket
        self.sync_timeout_s = float(timeout)
        self.eos_token_ids = tuple(int(e) for e in model_cfg.eos_token_id)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else (self.eos_token_ids or (0,))[0]
        if not (0 <= int(pad) < model_cfg.vocab_size):
            raise ValueError(f"pad id {pad!r} is outside the vocabulary [0, {model_cfg.vocab_size})")
        self.pad_token_id = int(pad)
        self.weight_format = WeightFormat.hf_on_device()
        self.num_syncs = 0
        self._pending: str | None = None  # a sync timed out and no later sync succeeded: generate() refuses
        self._dead: str | None = None  # a sync failed inside vLLM: weights half-loaded, the engine is unusable
        self._sync_thread: threading.Thread | None = None
        self._sync_result: dict | None = None

        is_cpu = current_platform.is_cpu()
        if enable_sleep_mode and not current_platform.is_cuda():
            raise ValueError(f"enable_sleep_mode=True needs a CUDA platform; vLLM runs on {current_platform.device_name!r}")
        self._sleep = bool(enable_sleep_mode)
        self._repack_tied_head = is_cpu and model_cfg.tie_word_embeddings
        self._asleep: set[str] = set()  # sleep mode: the memory tags ("weights", "kv_cache") currently released

        self.model_dir = Path(work_dir) / "vllm_init_model"
        model = nnx.merge(graphdef, params)
        save_hf(model, model_cfg, self.model_dir)
        from safetensors import safe_open

        with safe_open(str(self.model_dir / "model.safetensors"), framework="np") as f:
            self._hf_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        if dtype is None:
            dtype = "float32" if is_cpu else jax.numpy.dtype(model.param_dtype).name
        del model
        self.engine_name = f"vllm {vllm.__version__} ({current_platform.device_name}, tp={tp}, model {self.model_dir})"
        kwargs = dict(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
            tensor_parallel_size=tp, gpu_memory_utilization=float(mem), max_model_len=max_prompt_length + max_response_length,
            seed=int(seed), enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
            generation_config="vllm", enable_sleep_mode=self._sleep,
        )
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        log.info("started %s in %.1f s", self.engine_name, time.perf_counter() - t0)

    # ------------------------------------------------------------------ weights
    def update_weights(self, tensors: Mapping[str, jax.Array]) -> None:
        """Load new weights into vLLM (all workers), then drop the prefix cache.

        Called by :meth:`jaxrl.rollout.weight_sync.WeightSync.sync`, which makes the tensors with the translator's
        ``"hf"`` plan.

        Args:
          tensors: ``{hf_name: jax.Array}`` on ``jax.devices()[0]`` (the engine's ``weight_format``) with exactly
            the names and shapes of the initial checkpoint.
        Raises:
          WeightFormatError: another format (an ``nnx.State``, numpy arrays, arrays on another device); nothing
            is sent.
          WeightSyncError (the message names the sync number and the engine), in three kinds:
            * a name is missing/unknown or a shape differs: nothing is sent, the engine keeps its previous weights;
            * the sync took longer than ``sync_timeout_s``: it goes on in the background; :meth:`generate`
              refuses to run until a later sync succeeds (which first waits for the late one);
            * vLLM failed while loading: its in-place reload cannot be rolled back, so the engine is unusable
              from then on (every later call raises; restart the run).
        """
        self.weight_format.check(tensors, self.engine_name)
        self.load_hf_weights(tensors)

    def load_hf_weights(self, tensors: Mapping[str, "np.ndarray | jax.Array"]) -> None:
        """Load a complete set of HF-named ``[out, in]`` tensors (:func:`sharding.hf_table` naming) under the sync
        timeout: the loader behind :meth:`update_weights`, without its format check (the vLLM worker process
        calls it with the host arrays it copied out of shared memory).

        Args:
          tensors: ``{hf_name: array}`` (jax or numpy) with exactly the names and shapes of the initial checkpoint.
        Raises:
          WeightSyncError: a name is missing/unknown or a shape differs (nothing is sent; the engine keeps its
            weights), vLLM failed while loading (the engine is then unusable), or the sync timed out.
        """
        self._run_sync(self.num_syncs + 1, lambda: dict(tensors))

    @staticmethod
    def _as_torch(a):
        """A torch tensor over ``a``'s memory: DLPack for jax arrays (no copy, same device: CPU memory on CPU,
        the GPU buffer on GPU - no host round trip), ``torch.from_numpy`` for numpy arrays (copied if read-only)."""
        import torch

        if isinstance(a, jax.Array):
            try:
                return torch.from_dlpack(a)
            except (RuntimeError, TypeError, BufferError):  # e.g. a dtype DLPack cannot express: host copy
                a = np.asarray(a)
        arr = np.asarray(a)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def _check_hf(self, where: str, tensors: dict) -> None:
        missing = sorted(set(self._hf_shapes) - set(tensors))
        extra = sorted(set(tensors) - set(self._hf_shapes))
        wrong = [f"{k}: expected {self._hf_shapes[k]}, got {tuple(np.shape(v))}" for k, v in sorted(tensors.items())
                 if k in self._hf_shapes and tuple(np.shape(v)) != self._hf_shapes[k]]
        if missing or extra or wrong:
            # vLLM's in-place reload cannot be undone half-way (layers wait on the meta device for their missing
            # tensors), so an incomplete or mis-shaped set is refused before anything is sent.
            raise ValueError(f"{where}: the tensors do not match the engine's checkpoint (missing {missing[:5]}, "
                             f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}); nothing was sent, the engine keeps "
                             "its previous weights")

    def _run_sync(self, sync: int, make_tensors) -> None:
        where = f"weight sync #{sync} into {self.engine_name}"
        if self._dead is not None:
            raise WeightSyncError(f"{where}: refused, {self._dead}")
        previous, prev_result = self._sync_thread, self._sync_result
        if previous is not None and previous.is_alive():
            previous.join(self.sync_timeout_s)
            if previous.is_alive():
                raise WeightSyncError(f"{where}: the previous sync (timed out) is still running after another "
                                      f"{self.sync_timeout_s:g} s; the engine is stuck, restart the run")
            self._note_dead(prev_result)
            if self._dead is not None:
                raise WeightSyncError(f"{where}: refused, {self._dead}")
        result: dict = {"where": where}

        def work():
            try:
                t0 = time.perf_counter()
                tensors = make_tensors()
                self._check_hf(where, tensors)
                weights = [(name, self._as_torch(a)) for name, a in tensors.items()]
                result["sent"] = True  # from here on a failure leaves vLLM's layers half-reloaded
                self._wake(["weights"])  # sleep mode: weights back on the GPU; the KV cache stays released
                # Worker.reload_weights (vllm/v1/worker/gpu_worker.py; the CPU worker inherits it) runs
                # model.load_weights on checkpoint-format tensors between vLLM's layerwise-reload hooks, which
                # redo process_weights_after_loading (e.g. the CPU GEMM weight repacking). A bare
                # model.load_weights fails after that repacking ("Parameter has no attribute weight_loader").
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                )
                if self._repack_tied_head:
                    self.llm.collective_rpc(_refresh_tied_lm_head)
                self.llm.reset_prefix_cache()
                result["ok"] = (len(weights), time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = e

        thread = threading.Thread(target=work, name=f"vllm-weight-sync-{sync}", daemon=True)
        self._sync_thread, self._sync_result = thread, result
        thread.start()
        thread.join(self.sync_timeout_s)
        if thread.is_alive():
            self._pending = f"{where} timed out"
            raise WeightSyncError(
                f"{where} did not finish within {self.sync_timeout_s:g} s "
                "(actor_rollout_ref.rollout.update_weights_timeout_s); generate() is refused until a sync succeeds"
            )
        if "error" in result:
            e = result["error"]
            self._note_dead(result)
            tail = (f"the engine is unusable ({self._dead}); restart the run" if self._dead is not None
                    else "the engine keeps its previous weights")
            raise WeightSyncError(f"{where} failed: {type(e).__name__}: {e}; {tail}") from e
        self.num_syncs = sync
        self._pending = None
        loaded, secs = result["ok"]
        log.debug("%s: %s tensors loaded in %.2f s", where, loaded, secs)

    def _note_dead(self, result: dict | None) -> None:
        """Mark the engine unusable when a finished sync failed after its tensors reached vLLM."""
        if result and "error" in result and result.get("sent"):
            e = result["error"]
            self._dead = f"{result['where']} failed inside vLLM ({type(e).__name__}: {e}) and left its weights half-loaded"

    def _wake(self, tags: list[str]) -> None:
        """Sleep mode: re-allocate the released memory of ``tags`` (vLLM ``LLM.wake_up(tags=...)``)."""
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    # ------------------------------------------------------------------ generation
    def _prompt_width(self, longest: int) -> int:
        b = self.prompt_length_bucket
        return min(max(1, math.ceil(longest / b)) * b, self.max_prompt_length)

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return check_prompts(
            prompts, vocab_size=self.model_cfg.vocab_size, bos_token_id=self.model_cfg.bos_token_id,
            max_prompt_length=self.max_prompt_length,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, rng_seed: int | None = None, first_row: int = 0
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per token-id prompt with vLLM.

        Args:
          prompts: token-id lists of length 0..max_prompt_length (empty = ``[bos_token_id]``).
          params: :class:`SamplingParams`; ``max_new_tokens`` <= ``max_response_length``.
          rng_seed: the step seed (overrides ``params.seed``), in [0, 2**32); row r uses ``row_seeds(seed)[r]``.
          first_row: these prompts are a data-parallel share of a larger batch whose rows start here (the hybrid
            rollout group's split, :mod:`jaxrl.hybrid.dispatch`): row r uses the seed of batch row
            ``first_row + r``, so the shares together sample what one engine would for the whole batch.
        Returns:
          :class:`RolloutOutput`: N = len(prompts) * n rows, prompts left-padded to the bucketed width P,
          responses right-padded to R = ``max_new_tokens``, log-probs as described in the module docstring.
        Raises:
          ValueError: bad prompts/seed, or ``max_new_tokens`` > ``max_response_length``.
          WeightSyncError: the last weight sync failed (the engine's weights are not the trainer's).
        """
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a jaxrl SamplingParams, got {type(params).__name__}")
        if self._dead is not None:
            raise WeightSyncError(f"{self._dead}; refusing to generate, restart the run")
        if self._pending is not None:
            raise WeightSyncError(f"{self._pending}; refusing to generate with weights that may be stale or mixed")
        seed = params.seed if rng_seed is None else rng_seed
        if not isinstance(seed, (int, np.integer)) or not (0 <= int(seed) < 2**32):
            raise ValueError(f"rng_seed={rng_seed!r} must be an int in [0, 2**32)")
        n, r = params.n, params.max_new_tokens
        if r > self.max_response_length:
            raise ValueError(f"max_new_tokens={r} exceeds the engine's max_response_length={self.max_response_length} "
                             "(vLLM's max_model_len is max_prompt_length + max_response_length)")
        prompts = self._check_prompts(prompts)
        width = self._prompt_width(max(len(p) for p in prompts))
        rows = len(prompts) * n
        stops = sorted(set(params.stop_token_ids) if params.ignore_eos
                       else set(self.eos_token_ids) | set(params.stop_token_ids))
        greedy = params.greedy
        if not isinstance(first_row, (int, np.integer)) or first_row < 0:
            raise ValueError(f"first_row={first_row!r} must be an int >= 0")
        seeds = row_seeds(int(seed), rows, int(first_row))
        requests, sps = [], []
        for i, p in enumerate(prompts):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=p))
                sps.append(VllmSamplingParams(
                    n=1, temperature=0.0 if greedy else float(params.temperature),
                    top_p=1.0 if greedy else float(params.top_p), top_k=0 if greedy or params.top_k <= 0 else params.top_k,
                    max_tokens=r, stop_token_ids=stops, ignore_eos=params.ignore_eos, logprobs=0, detokenize=False,
                    seed=seeds[i * n + j],
                ))
        self._wake(["weights", "kv_cache"])
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        if self._sleep:  # free the KV cache (level 1 also offloads weights to host) for the trainer's update
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

        prompt_ids = np.full((rows, width), self.pad_token_id, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        response_ids = np.full((rows, r), self.pad_token_id, np.int32)
        response_mask = np.zeros((rows, r), np.int32)
        logp = np.zeros((rows, r), np.float32)
        stop_set = set(stops)
        for row, out in enumerate(outs):
            p = prompts[row // n]
            prompt_ids[row, width - len(p):] = p
            prompt_mask[row, width - len(p):] = 1
            comp = out.outputs[0]
            toks = list(comp.token_ids)[:r]
            for k, t in enumerate(toks):  # cut after the first stop token (inclusive), like the JAX sampler
                if t in stop_set:
                    toks = toks[: k + 1]
                    break
            m = len(toks)
            response_ids[row, :m] = toks
            response_mask[row, :m] = 1
            if comp.logprobs is None or len(comp.logprobs) < m:
                raise RuntimeError(f"vLLM returned {0 if comp.logprobs is None else len(comp.logprobs)} log-prob "
                                   f"entries for {m} tokens (row {row}); expected one per token")
            logp[row, :m] = [comp.logprobs[k][t].logprob for k, t in enumerate(toks)]
        return RolloutOutput(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, rollout_log_probs=logp,
            prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), n),
        )

    def shutdown(self) -> None:
        """Release vLLM's engine (memory, threads). The engine cannot be used afterwards."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
