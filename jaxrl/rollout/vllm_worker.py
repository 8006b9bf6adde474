"""vLLM as a separate worker process, for ``trainer.placement=split``.

Why a separate process
  With split placement the trainer (JAX) and the rollout engine (vLLM, torch) run on *different* devices. One
  process cannot give JAX some GPUs and torch others reliably (both read ``CUDA_VISIBLE_DEVICES`` once, at
  start-up, and JAX by default grabs every visible accelerator), and a crash or hang inside vLLM should not take
  the trainer's state with it. :class:`VllmWorkerEngine` therefore starts vLLM in a child process
  (``multiprocessing`` *spawn*, so nothing of the trainer's JAX/CUDA state is inherited) with its own
  environment: ``JAX_PLATFORMS=cpu`` (the child's JAX is only used to rebuild the model on the host and never
  touches an accelerator), ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's engine core runs inside the child), plus
  the caller's ``env`` -- on a GPU box pass ``CUDA_VISIBLE_DEVICES`` = the rollout GPUs there. Inside the child a
  plain :class:`~jaxrl.rollout.vllm_engine.VllmEngine` does the work; the parent forwards requests over a
  ``multiprocessing.Pipe``. Spawn re-imports the parent's ``__main__`` module in the child, so the trainer's
  entry point must be import-safe (``if __name__ == "__main__":``), as for any spawn-based multiprocessing.

Data path
  * start: the parent writes the initial params as a Hugging Face directory (:func:`jaxrl.models.hf.save_hf`,
    ``<work_dir>/vllm_worker_init_model``); the child rebuilds the :class:`~jaxrl.models.decoder.Decoder` from
    it with the parent's exact :class:`ModelConfig` (``load_hf_dir`` + ``from_hf_tensors``; ``load_pretrained``
    would re-derive the config from ``config.json``, which need not round-trip every field), and starts
    ``VllmEngine`` (which writes its own copy under ``work_dir``). The parent deletes its copy once the child is
    ready.
  * weight sync: one host ``multiprocessing.shared_memory.SharedMemory`` block
    (:class:`~jaxrl.rollout.vllm_shm.WeightBlock`), sized for the complete set of HF tensors (names, offsets,
    shapes and dtypes fixed at start from the initial checkpoint), allocated once and reused by every sync. The
    engine declares the ``"hf_host"`` weight format: :class:`~jaxrl.rollout.weight_sync.WeightSync` lands the HF
    tensors (the translator's ``"hf"`` plan) on the host CPU device; the parent validates them, copies them into
    the block and sends a small ``load`` message; the child (:mod:`jaxrl.rollout.vllm_worker_process`) copies
    them out and calls ``VllmEngine.load_hf_weights``. On GPUs this is a **host round trip** (trainer device ->
    host -> shared memory -> host -> vLLM device), i.e. roughly two model-sized host copies plus two PCIe
    transfers per sync; there is no device-to-device path (NCCL) here.
  * generate: prompts and :class:`SamplingParams` go through the pipe, the padded numpy arrays of
    :class:`RolloutOutput` come back (pickled; small next to the weights).

Failure modes
  * start-up failure in the child (bad config, vLLM error, out of memory): the constructor raises
    :class:`VllmWorkerError` with the child's exception type, text and traceback tail; a child that dies
    without a word is reported with its exit code; no reply within ``start_timeout_s`` kills the child.
  * bad weights (missing/unknown name, wrong shape, non-float dtype): :class:`WeightSyncError` raised in the
    parent before anything is written or sent; the worker keeps its weights and keeps serving. Weights in another
    format (an ``nnx.State``, device arrays): :class:`~jaxrl.rollout.base.WeightFormatError`, nothing sent.
  * sync timeout (the whole sync -- conversion, copy into shared memory, the child's load -- exceeds
    ``sync_timeout_s``): :class:`WeightSyncError` naming ``actor_rollout_ref.rollout.update_weights_timeout_s``.
    The child is *not* killed: it finishes the load in the background. :meth:`~VllmWorkerEngine.generate` is
    refused until a later sync succeeds; that later sync first waits (up to ``sync_timeout_s`` again) for the
    late one, since both use the same shared-memory block. Any other sync failure reported by the child also
    makes generate refuse until a sync succeeds.
  * the child dies (killed, segfault, OOM killer): the next call raises (:class:`VllmWorkerError` from
    ``generate``, :class:`WeightSyncError` from a sync) naming the exit code; the engine is dead from then on.
  * parent exit or garbage collection: the child is shut down (``shutdown`` message, then terminate/kill) and
    the shared memory is unlinked (``weakref.finalize`` and an ``atexit`` hook). The child also exits when the
    parent's end of the pipe closes.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import pickle
import shutil
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from jaxrl.models.config import ModelConfig
from jaxrl.rollout.base import RolloutOutput, SamplingParams, WeightSyncError, check_prompts
from jaxrl.rollout.vllm_engine import _cfg_get
from jaxrl.rollout.vllm_shm import WeightBlock
from jaxrl.rollout.vllm_worker_process import describe_exit, start_worker_process, stop_worker
from jaxrl.rollout.weight_format import WeightFormat

__all__ = ["VllmWorkerEngine", "VllmWorkerError", "WeightSyncError"]

log = logging.getLogger(__name__)

_TIMEOUT_KEY = "actor_rollout_ref.rollout.update_weights_timeout_s"
_POLL_S = 0.5  # how often a waiting parent checks that the child is still alive
_SHUTDOWN_GRACE_S = 30.0  # after the shutdown message, before terminate()
_LIVE: weakref.WeakSet = weakref.WeakSet()
_ATEXIT_REGISTERED = False


class VllmWorkerError(RuntimeError):
    """The vLLM worker process failed to start, died, was shut down, or raised an unexpected error."""


class _WorkerDied(Exception):
    """Internal: the child is gone; the message says how (exit code)."""


def _plain_cfg(section):
    """``rollout_cfg`` in a form that pickles into the child (OmegaConf sections become plain dicts)."""
    if section is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            section = OmegaConf.to_container(section, resolve=True)
    except ImportError:
        pass
    try:
        pickle.dumps(section)
    except Exception as e:  # noqa: BLE001 - reported as a clear ValueError
        raise ValueError(f"rollout_cfg of type {type(section).__name__} cannot be sent to the vLLM worker process "
                         f"({type(e).__name__}: {e}); pass a dict, a dataclass or an OmegaConf section") from e
    return section


def _shutdown_all() -> None:
    for engine in list(_LIVE):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - interpreter exit
            log.exception("shutting down a vLLM worker at exit failed")


def _register_for_exit(engine: "VllmWorkerEngine") -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:  # registered after multiprocessing's own hook, so it runs before its join
        atexit.register(_shutdown_all)
        _ATEXIT_REGISTERED = True
    _LIVE.add(engine)


def _checked_args(max_prompt_length, max_response_length, sync_timeout_s, rollout_cfg, env, start_timeout_s,
                  engine_kwargs) -> tuple[float, dict[str, str], object]:
    """Validate the constructor's arguments; returns ``(sync timeout s, env, rollout_cfg as it pickles)``.

    Raises:
      ValueError: the first bad argument (named).
    """
    for name, v in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    timeout = sync_timeout_s if sync_timeout_s is not None else _cfg_get(rollout_cfg, "update_weights_timeout_s", 600.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"sync timeout {timeout!r} must be a finite number of seconds > 0 ({_TIMEOUT_KEY})")
    if (not isinstance(start_timeout_s, (int, float)) or isinstance(start_timeout_s, bool)
            or not (start_timeout_s > 0 and math.isfinite(start_timeout_s))):
        raise ValueError(f"start_timeout_s={start_timeout_s!r} must be a finite number of seconds > 0")
    env = dict(env or {})
    bad_env = [(k, v) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str) or not k]
    if bad_env:
        raise ValueError(f"env must map non-empty str names to str values; bad entries {bad_env[:5]}")
    rollout_cfg = _plain_cfg(rollout_cfg)
    try:
        pickle.dumps(engine_kwargs)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"engine_kwargs {sorted(engine_kwargs)} cannot be sent to the worker process: {e}") from e
    return float(timeout), env, rollout_cfg


def _write_start_checkpoint(model_cfg, graphdef, params, model_dir: Path) -> tuple[str, str]:
    """Write the initial policy as a Hugging Face directory; returns its ``(param dtype, compute dtype)`` names."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models.hf import save_hf

    model = nnx.merge(graphdef, params)
    save_hf(model, model_cfg, model_dir)
    return jnp.dtype(model.param_dtype).name, jnp.dtype(model.dtype).name


class VllmWorkerEngine:
    """A :class:`~jaxrl.rollout.RolloutEngine` whose vLLM runs in a separate worker process (see module doc).

    Args:
      model_cfg, graphdef, params, tokenizer, rollout_cfg, max_prompt_length, max_response_length, work_dir,
        sync_timeout_s: as for :class:`~jaxrl.rollout.vllm_engine.VllmEngine` (the child builds one with them;
        ``tokenizer`` only supplies ``pad_token_id``; ``rollout_cfg`` must pickle -- OmegaConf sections are
        converted to dicts). ``sync_timeout_s`` (else ``rollout_cfg.update_weights_timeout_s``, else 600 s) bounds
        each whole sync as seen from the parent; the attribute may be changed later. The child's engine gets
        the initial value as its own backstop.
      env: extra environment variables for the child (``str -> str``), applied after
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``JAX_PLATFORMS=cpu`` (so they can override them); e.g.
        ``{"CUDA_VISIBLE_DEVICES": "4,5,6,7"}``. The parent's own environment is restored right after start.
      start_timeout_s: seconds the child may take to load the model and start vLLM (> 0).
      **engine_kwargs: further ``VllmEngine`` keyword arguments (``prompt_length_bucket``,
        ``enable_prefix_caching``, ``enable_sleep_mode``, ``dtype``, ``llm_kwargs``), forwarded unchanged.

    Attributes:
      pad_token_id, eos_token_ids, engine_name: as reported by the child's engine.
      num_syncs: successful weight syncs. last_sync_bytes: bytes copied into shared memory by the last sync
        that was sent to the child (0 before any). pid: the child's process id. shm_name: the block's name.

    Raises:
      ValueError: a bad argument (named).
      VllmWorkerError: the child failed to start (its exception text included), died during start-up (exit
        code), or was not ready within ``start_timeout_s``.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef,
        params,
        tokenizer=None,
        *,
        rollout_cfg=None,
        max_prompt_length: int,
        max_response_length: int,
        work_dir: str | os.PathLike,
        sync_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 900.0,
        **engine_kwargs,
    ) -> None:
        timeout, env, rollout_cfg = _checked_args(max_prompt_length, max_response_length, sync_timeout_s, rollout_cfg,
                                                  env, start_timeout_s, engine_kwargs)
        self.model_cfg = model_cfg
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.sync_timeout_s = timeout
        self.weight_format = WeightFormat.hf_on_host()
        self.num_syncs = 0
        self.last_sync_bytes = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._late: set[int] = set()  # requests whose replies we stopped waiting for (timed-out syncs)
        self._pending: str | None = None  # the last sync did not succeed: generate() refuses
        self._dead: str | None = None  # the child is gone
        self._closed = False
        self._proc = self._conn = None
        self.pid: int | None = None
        self.engine_name = "vllm worker (starting)"

        # The start-up checkpoint (the child rebuilds the policy from it) fixes the weight block's layout.
        work = Path(work_dir)
        init_dir = work / "vllm_worker_init_model"
        param_dtype, compute_dtype = _write_start_checkpoint(model_cfg, graphdef, params, init_dir)
        self._block = WeightBlock.create(init_dir / "model.safetensors")
        self.shm_name = self._block.name
        # Everything the cleanup needs, without a reference to self (so that garbage collection can run it).
        self._res = SimpleNamespace(proc=None, conn=None, block=self._block, model_dir=init_dir)
        self._finalizer = weakref.finalize(self, stop_worker, self._res, _SHUTDOWN_GRACE_S)

        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        spec = dict(
            model_dir=str(init_dir), model_cfg=model_cfg, param_dtype=param_dtype, dtype=compute_dtype,
            pad_token_id=None if pad is None else int(pad), rollout_cfg=rollout_cfg,
            max_prompt_length=max_prompt_length, max_response_length=max_response_length, work_dir=str(work),
            sync_timeout_s=self.sync_timeout_s, engine_kwargs=engine_kwargs, shm_name=self._block.name,
            layout=self._block.layout,
        )
        proc, self._conn = start_worker_process(spec, env)
        self._proc, self.pid = proc, proc.pid
        self._res.proc, self._res.conn = proc, self._conn
        _register_for_exit(self)
        self._await_ready(float(start_timeout_s))
        shutil.rmtree(init_dir, ignore_errors=True)  # the child's engine wrote its own copy
        self._res.model_dir = None

    def _await_ready(self, start_timeout_s: float) -> None:
        """Wait for the child's start-up answer; on failure stop it and raise :class:`VllmWorkerError`."""
        proc = self._proc
        t0 = time.monotonic()
        try:
            reply = self._next_reply(t0 + start_timeout_s)
        except _WorkerDied as e:
            self._abort_start()
            raise VllmWorkerError(f"the vLLM worker process (pid {proc.pid}) died while starting: {e}") from None
        if reply is None:
            self._abort_start()
            raise VllmWorkerError(f"the vLLM worker process (pid {proc.pid}) was not ready within "
                                  f"start_timeout_s={start_timeout_s:g} s; it was killed")
        _, status, payload = reply
        if status != "ready":
            self._abort_start()
            kind, msg, tb = payload
            raise VllmWorkerError(f"the vLLM worker process (pid {proc.pid}) failed to start: {kind}: {msg}\n"
                                  f"--- worker traceback ---\n{tb}")
        self.pad_token_id = int(payload["pad_token_id"])
        self.eos_token_ids = tuple(payload["eos_token_ids"])
        self.engine_name = f"vllm worker pid {proc.pid}: {payload['engine_name']}"
        log.info("started %s in %.1f s (weight block %.1f MiB)", self.engine_name, time.monotonic() - t0,
                 self._block.nbytes / 2**20)

    # ------------------------------------------------------------------ plumbing
    def _abort_start(self) -> None:
        self._closed = True
        self._finalizer()

    def _mark_dead(self) -> str:
        proc = self._proc
        proc.join(5.0)
        self._dead = f"the vLLM worker process (pid {proc.pid}) {describe_exit(proc.exitcode)}"
        return self._dead

    def _next_reply(self, deadline: float | None):
        """The next message from the child, ``None`` once ``deadline`` (monotonic s) passed; ``_WorkerDied``."""
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            try:
                if self._conn.poll(max(wait, 0.0)):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise _WorkerDied(self._mark_dead()) from None
            if not self._proc.is_alive():
                try:  # it may have answered just before exiting
                    if self._conn.poll(0):
                        return self._conn.recv()
                except (EOFError, OSError):
                    pass
                raise _WorkerDied(self._mark_dead())
            if deadline is not None and wait <= 0:
                return None

    def _reply_to(self, seq: int, deadline: float | None):
        """Wait for the reply to request ``seq``, discarding late replies to timed-out requests."""
        while True:
            reply = self._next_reply(deadline)
            if reply is None:
                return None
            if reply[0] == seq:
                return reply
            self._absorb_late(reply)

    def _absorb_late(self, reply) -> None:
        seq, status, payload = reply
        if seq not in self._late:
            raise VllmWorkerError(f"protocol error: unexpected reply #{seq} ({status}) from {self.engine_name}")
        self._late.discard(seq)
        if status == "error":
            log.warning("%s: a timed-out request (#%s) finally failed: %s: %s", self.engine_name, seq, *payload[:2])
        else:
            log.info("%s: a timed-out request (#%s) finished late", self.engine_name, seq)

    def _drain_late(self, deadline: float) -> bool:
        """Wait until every late reply arrived; False if some are still outstanding at ``deadline``."""
        while self._late:
            reply = self._next_reply(deadline)
            if reply is None:
                return False
            self._absorb_late(reply)
        return True

    def _send(self, kind: str, payload) -> int:
        if not self._proc.is_alive():
            raise _WorkerDied(self._mark_dead())
        self._seq += 1
        try:
            self._conn.send((self._seq, kind, payload))
        except (OSError, ValueError):
            raise _WorkerDied(self._mark_dead()) from None
        return self._seq

    def _check_open(self) -> None:
        if self._closed:
            raise VllmWorkerError(f"{self.engine_name} was shut down; it cannot be used any more")

    def _raise_remote(self, payload, prefix: str, sync: bool):
        kind, msg, tb = payload
        text = f"{prefix}{kind}: {msg}"
        if sync or kind == "WeightSyncError":
            raise WeightSyncError(text)
        if kind in ("ValueError", "TypeError"):
            raise {"ValueError": ValueError, "TypeError": TypeError}[kind](msg)
        raise VllmWorkerError(f"{text}\n--- worker traceback ---\n{tb}")

    # ------------------------------------------------------------------ weights
    def update_weights(self, tensors) -> None:
        """Load new policy weights into the worker's vLLM through the shared-memory block.

        Called by :meth:`jaxrl.rollout.weight_sync.WeightSync.sync`, which lands the tensors on the host with the
        translator's ``"hf"`` plan.

        Args:
          tensors: ``{hf_name: array}`` in host memory (numpy arrays or jax arrays on a CPU device: the engine's
            ``weight_format``) with exactly the initial checkpoint's names and shapes. Floating arrays are cast to
            the block's dtype (the initial checkpoint's, e.g. float32).
        Raises:
          WeightFormatError: another format (an ``nnx.State``, not a mapping, arrays on an accelerator); nothing
            is written or sent.
          WeightSyncError (the message names the sync number and the engine):
            * names/shapes/dtype kind differ: nothing is written or sent; the worker keeps its weights;
            * the sync took longer than ``sync_timeout_s`` (key ``actor_rollout_ref.rollout.update_weights_timeout_s``):
              the child finishes it in the background; :meth:`generate` refuses until a later sync succeeds;
              a still-unfinished late sync is waited for (``sync_timeout_s``) before the next one starts;
            * the child reported a failure (its text included): generate refuses until a sync succeeds;
            * the worker died (exit code named).
          VllmWorkerError: the engine was shut down.
        """
        with self._lock:
            sync = self.num_syncs + 1
            where = f"weight sync #{sync} into {self.engine_name}"
            self._check_open()
            if self._dead is not None:
                raise WeightSyncError(f"{where}: refused, {self._dead}; restart the run")
            self.weight_format.check(tensors, self.engine_name)
            timeout = float(self.sync_timeout_s)
            try:
                if not self._drain_late(time.monotonic() + timeout):
                    raise WeightSyncError(
                        f"{where}: the previous sync (timed out) is still running in the worker after another "
                        f"{timeout:g} s ({_TIMEOUT_KEY}); the worker looks stuck, restart the run")
                t0 = time.monotonic()
                nbytes = self._block.write(self._block.check(tensors, where))
                self.last_sync_bytes = nbytes
                seq = self._send("load", sync)
                reply = self._reply_to(seq, t0 + timeout)
            except _WorkerDied as e:
                raise WeightSyncError(f"{where} failed: {e}; restart the run") from None
            if reply is None:
                self._late.add(seq)
                self._pending = f"{where} timed out"
                raise WeightSyncError(
                    f"{where} did not finish within {timeout:g} s ({_TIMEOUT_KEY}); the worker finishes it in the "
                    "background, generate() is refused until a later sync succeeds")
            if reply[1] != "ok":
                self._pending = f"{where} failed in the worker"
                self._raise_remote(reply[2], f"{where} failed in the worker: ", sync=True)
            self.num_syncs = sync
            self._pending = None
            log.debug("%s: %.1f MiB in %.2f s", where, nbytes / 2**20, time.monotonic() - t0)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, rng_seed: int | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per token-id prompt in the worker (see ``VllmEngine.generate``).

        Args:
          prompts: token-id lists of length 0..max_prompt_length (empty = ``[bos_token_id]``); validated here.
          params: :class:`SamplingParams`; ``max_new_tokens`` <= ``max_response_length``.
          rng_seed: the step seed (overrides ``params.seed``), an int in [0, 2**32).
        Returns:
          :class:`RolloutOutput` of numpy arrays (N = len(prompts) * n rows), exactly as ``VllmEngine`` returns.
        Raises:
          TypeError: ``params`` is not a jaxrl :class:`SamplingParams`.
          ValueError: bad prompts/seed, or ``max_new_tokens`` > ``max_response_length``.
          WeightSyncError: the last weight sync timed out or failed (weights may be stale), or the worker's engine
            refused (its text included).
          VllmWorkerError: the worker died (exit code named), was shut down, or failed unexpectedly.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a jaxrl SamplingParams, got {type(params).__name__}")
        seed = params.seed if rng_seed is None else rng_seed
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not (0 <= int(seed) < 2**32):
            raise ValueError(f"rng_seed={rng_seed!r} must be an int in [0, 2**32)")
        if params.max_new_tokens > self.max_response_length:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} exceeds the engine's max_response_length="
                             f"{self.max_response_length} (vLLM's max_model_len is max_prompt_length + "
                             "max_response_length)")
        prompts = check_prompts(prompts, vocab_size=self.model_cfg.vocab_size,
                                bos_token_id=self.model_cfg.bos_token_id, max_prompt_length=self.max_prompt_length)
        with self._lock:
            self._check_open()
            if self._dead is not None:
                raise VllmWorkerError(f"{self._dead}; refusing to generate, restart the run")
            if self._pending is not None:
                raise WeightSyncError(f"{self._pending}; refusing to generate with weights that may be stale or "
                                      "mixed until a weight sync succeeds")
            try:
                seq = self._send("generate", (prompts, params, int(seed)))
                reply = self._reply_to(seq, None)
            except _WorkerDied as e:
                raise VllmWorkerError(f"generate on {self.engine_name} failed: {e}; restart the run") from None
        if reply[1] != "ok":
            self._raise_remote(reply[2], f"generate on {self.engine_name} failed in the worker: ", sync=False)
        return reply[2]

    # ------------------------------------------------------------------ lifetime
    def is_alive(self) -> bool:
        """Whether the worker process is running (False after :meth:`shutdown` or its death)."""
        return self._proc is not None and self._proc.is_alive()

    def shutdown(self) -> None:
        """Stop the worker and free the shared memory; idempotent, also run on garbage collection and at exit.

        Sends ``shutdown`` (the child shuts its vLLM down and exits), waits up to 30 s, then terminates and at
        last kills the process; closes the pipe and unlinks the shared-memory block. Every later call raises
        :class:`VllmWorkerError`.
        """
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self._finalizer()

    def __del__(self) -> None:
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
