"""The vLLM worker process: how it is started (spawn, its own environment) and what runs inside it.

:func:`start_worker_process` spawns the child with ``multiprocessing``'s *spawn* start method (nothing of the
trainer's JAX/CUDA state is inherited) and the environment the caller gives it; :func:`worker_main` is the
child: it rebuilds the policy from the start-up Hugging Face directory, starts a plain
:class:`~jaxrl.rollout.vllm_engine.VllmEngine`, maps the shared-memory weight block
(:class:`~jaxrl.rollout.vllm_shm.WeightBlock`) and serves the parent's requests over a pipe; :func:`stop_worker`
ends it (shutdown message, then terminate/kill) and frees what it held. The parent side is
:class:`jaxrl.rollout.vllm_worker.VllmWorkerEngine`.

Protocol (tuples over the pipe): parent -> child ``(seq, kind, payload)`` with kind ``"generate"`` (payload
``(prompts, SamplingParams, rng_seed)``), ``"load"`` (payload: the sync number; the tensors are in the shared
block) or ``"shutdown"``; child -> parent ``(seq, "ok", result)`` or ``(seq, "error", (type name, message,
traceback))``. Start-up answers with seq 0: ``"ready"`` (engine facts) or ``"error"``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
import traceback
from types import SimpleNamespace
from typing import Any

__all__ = ["describe_exit", "error_payload", "start_worker_process", "stop_worker", "worker_main"]

log = logging.getLogger("jaxrl.rollout.vllm_worker")

_ENV_LOCK = threading.Lock()  # os.environ is swapped around Process.start(); one start at a time


def error_payload(e: BaseException) -> tuple[str, str, str]:
    """``(type name, message, traceback tail)`` of an exception, as sent over the pipe."""
    return type(e).__name__, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


def start_worker_process(spec: dict, env: dict[str, str]) -> tuple[multiprocessing.Process,
                                                                    multiprocessing.connection.Connection]:
    """Spawn :func:`worker_main` with ``spec``; returns ``(process, the parent's end of the pipe)``.

    The child's environment is this process's plus ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's engine core runs
    inside the child), ``JAX_PLATFORMS=cpu`` (the child's JAX only rebuilds the model on the host) and ``env``
    (applied last, so it can override them); this process's own environment is restored right after the start.
    The child's end of the pipe is closed here, so the child's death shows up as EOF.
    """
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=worker_main, args=(child_conn, spec), name="jaxrl-vllm-worker", daemon=False)
    child_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "JAX_PLATFORMS": "cpu", **env}
    with _ENV_LOCK:  # spawn's child inherits os.environ as it is during start()
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    child_conn.close()
    return proc, parent_conn


def describe_exit(code: int | None) -> str:
    """How the child ended, for messages: ``"exited with code -9 (killed by signal SIGKILL)"``."""
    if code is None:
        return "is unreachable (its pipe closed) but still running"
    if code < 0:
        try:
            return f"exited with code {code} (killed by signal {signal.Signals(-code).name})"
        except ValueError:
            return f"exited with code {code} (killed by signal {-code})"
    return f"exited with code {code}"


def stop_worker(res: SimpleNamespace, grace_s: float) -> None:
    """Stop the child (shutdown message, join, terminate, kill), close the pipe, unlink the shared memory and
    remove the start-up model directory if it is still there. ``res`` holds ``proc``, ``conn``, ``block`` (the
    :class:`WeightBlock`), ``model_dir`` (each may be None)."""
    proc, conn, block = res.proc, res.conn, res.block
    try:
        if proc is not None and proc.is_alive():
            try:
                conn.send((-1, "shutdown", None))
            except (OSError, ValueError, AttributeError):
                pass
            proc.join(grace_s)
            if proc.is_alive():
                log.warning("vLLM worker pid %s did not exit within %.0f s; terminating it", proc.pid, grace_s)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        elif proc is not None and proc.pid is not None:
            proc.join(0)  # reap
    finally:
        if conn is not None:
            conn.close()
        if block is not None:
            block.close()
            block.unlink()
        if res.model_dir is not None:
            shutil.rmtree(res.model_dir, ignore_errors=True)


def worker_main(conn: multiprocessing.connection.Connection, spec: dict) -> None:
    """Entry point of the child process: build a ``VllmEngine`` and serve requests until told to stop.

    ``spec`` holds ``model_dir`` (the start-up HF directory), ``model_cfg``, ``param_dtype``, ``dtype``,
    ``pad_token_id``, ``rollout_cfg``, ``max_prompt_length``, ``max_response_length``, ``work_dir``,
    ``sync_timeout_s``, ``engine_kwargs``, ``shm_name`` and ``layout`` (the weight block's).
    """
    engine = block = None
    try:
        try:
            from flax import nnx

            from jaxrl.models import parse_dtype
            from jaxrl.models.hf import from_hf_tensors, load_hf_dir
            from jaxrl.rollout.vllm_engine import VllmEngine
            from jaxrl.rollout.vllm_shm import WeightBlock

            # the parent's exact ModelConfig (load_pretrained would re-derive it from config.json)
            _, tensors = load_hf_dir(spec["model_dir"])
            model = from_hf_tensors(spec["model_cfg"], tensors, param_dtype=parse_dtype(spec["param_dtype"]),
                                    dtype=parse_dtype(spec["dtype"]))
            del tensors
            graphdef, state = nnx.split(model)
            del model
            pad = spec["pad_token_id"]
            engine = VllmEngine(
                spec["model_cfg"], graphdef, state, None if pad is None else SimpleNamespace(pad_token_id=pad),
                rollout_cfg=spec["rollout_cfg"], max_prompt_length=spec["max_prompt_length"],
                max_response_length=spec["max_response_length"], work_dir=spec["work_dir"],
                sync_timeout_s=spec["sync_timeout_s"], **spec["engine_kwargs"],
            )
            del state
            block = WeightBlock.attach(spec["shm_name"], spec["layout"])
            conn.send((0, "ready", {"pad_token_id": int(engine.pad_token_id),
                                    "eos_token_ids": tuple(int(e) for e in engine.eos_token_ids),
                                    "engine_name": str(engine.engine_name), "pid": os.getpid()}))
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            conn.send((0, "error", error_payload(e)))
            return
        while True:
            try:
                seq, kind, payload = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            try:
                if kind == "generate":
                    prompts, params, seed = payload
                    result: Any = engine.generate(prompts, params, rng_seed=seed)
                elif kind == "load":
                    # Copy out first: the parent may overwrite the block as soon as this request is answered,
                    # even if vLLM's own (timed-out) load is still reading in a background thread.
                    engine.load_hf_weights(block.read())
                    result = None
                elif kind == "shutdown":
                    engine.shutdown()
                    engine = None
                    conn.send((seq, "ok", None))
                    return
                else:
                    raise ValueError(f"unknown request kind {kind!r}; expected 'generate', 'load' or 'shutdown'")
                conn.send((seq, "ok", result))
            except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
                conn.send((seq, "error", error_payload(e)))
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                log.exception("vLLM worker: engine shutdown failed")
        if block is not None:
            block.close()
        conn.close()
