"""The run's rollout engine, picked by ``actor_rollout_ref.rollout.name``, behind its :class:`WeightSync`.

``jax``: the embedded :class:`~jaxrl.rollout.jax_sampler.JaxSampler` (on the rollout mesh when the run has a
placement); ``jetstream``: :class:`~jaxrl.rollout.jetstream_rollout.JetStreamRollout` (jaxrl's decoder behind
JetStream's engine interface, continuous batching; the same JAX weight format and mesh as the sampler); ``vllm``: :class:`~jaxrl.rollout.vllm_engine.VllmEngine` in the trainer's process, or
:class:`~jaxrl.rollout.vllm_worker.VllmWorkerEngine` in a worker process for split placement. Reads the config
duck-typed (no ``jaxrl.config`` import); the device layout arrives as plain arguments (the rollout mesh and its
rules), so ``jaxrl.rollout`` never imports ``jaxrl.workers``.
"""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

from jaxrl.rollout.weight_format import WeightFormat
from jaxrl.rollout.weight_sync import WeightSync
from sharding.rules import Rules

__all__ = ["ENGINES", "make_rollout_engine", "rollout_weight_format", "start_rollout"]

ENGINES = ("jax", "vllm", "jetstream")


def _check_name(name: str) -> None:
    if name in ENGINES:
        return
    raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is unknown; valid: {', '.join(ENGINES)}")


def rollout_weight_format(cfg, *, mesh: Mesh | None = None, rules: Rules | None = None,
                          split: bool = False) -> WeightFormat:
    """The weight format the run's engine declares: ``jax`` for the JAX sampler and JetStream (on ``mesh`` by
    ``rules``, or as given without a mesh), ``hf_host`` for vLLM in a worker process (``split``), ``hf_device`` for vLLM in the trainer's process.

    Raises:
      ValueError: ``rollout.name`` is not an engine this installation provides (names the valid ones).
    """
    name = cfg.actor_rollout_ref.rollout.name
    _check_name(name)
    if name in ("jax", "jetstream"):
        return WeightFormat.jax(mesh, rules)
    return WeightFormat.hf_on_host() if split else WeightFormat.hf_on_device()


def _engine_prompt_length(cfg) -> int:
    """Longest prompt the engine takes: ``data.max_prompt_length``; with ``multi_turn.enable`` the whole
    conversation so far (each turn re-prefills prompt + response), and with ``async_training.partial_rollout`` the
    prompt and the response so far (each stage continues it), so prompt + response budget."""
    rc = cfg.actor_rollout_ref.rollout
    if rc.multi_turn.enable or cfg.async_training.partial_rollout:  # partial: a stage continues prompt + response
        return cfg.data.max_prompt_length + (rc.max_new_tokens or cfg.data.max_response_length)
    return cfg.data.max_prompt_length


def make_rollout_engine(cfg, model_cfg, graphdef, params, tokenizer, *, mesh: Mesh | None = None,
                        rules: Rules | None = None, split: bool = False):
    """Build the rollout engine for a run (use :func:`start_rollout` to get it with its weight sync).

    Args:
      cfg: the full run config; reads ``actor_rollout_ref.rollout``, ``data.max_prompt_length``, (vLLM,
        JetStream) ``data.max_response_length``, (vLLM) ``trainer.default_local_dir`` and (JetStream) the rows of
        one generate call (``data.train_batch_size`` / ``gen_batch_size`` x ``rollout.n``) for its slot count.
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig`.
      graphdef, params: ``nnx.split`` of the policy: the weights the engine starts on (the JAX sampler with
        ``mesh``: already on it; vLLM: written as a Hugging Face directory).
      tokenizer: supplies the pad id (falls back to the model's eos).
      mesh: the rollout mesh (``Placement.rollout_mesh``), or None for one device. vLLM places its own weights;
        for a split worker the mesh's devices are its GPUs.
      rules: the JAX sampler's / JetStream engine's weight layout rules on ``mesh`` (``Placement.rollout_rules``).
      split: vLLM only: run it as a separate worker process (:class:`~jaxrl.rollout.vllm_worker.VllmWorkerEngine`;
        on GPU its ``CUDA_VISIBLE_DEVICES`` are the ``mesh`` devices' ids); otherwise vLLM runs in this process.

    Raises:
      ValueError: ``rollout.name`` is not an engine this installation provides (names the valid ones), or vLLM is
        not installed (says how to install it).
    """
    rc = cfg.actor_rollout_ref.rollout
    _check_name(rc.name)
    if rc.name == "jax":
        from jaxrl.rollout.jax_sampler import JaxSampler

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_cfg.eos_token_id[0]
        kwargs = dict(
            pad_token_id=int(pad), eos_token_ids=tuple(model_cfg.eos_token_id),
            max_prompt_length=_engine_prompt_length(cfg), max_batch_size=rc.micro_batch_size or None,
            dtype=rc.dtype, max_decode_segments=rc.max_decode_segments,
            compact_finished_rows=rc.compact_finished_rows,
        )
        if mesh is None:
            return JaxSampler(model_cfg, graphdef, params, packed_prefill=rc.packed_prefill, **kwargs)
        return JaxSampler(model_cfg, graphdef, params, mesh=mesh, rules=rules, **kwargs)
    if rc.name == "jetstream":
        return _jetstream(cfg, model_cfg, graphdef, params, tokenizer, mesh=mesh, rules=rules)
    try:  # vLLM places its own weights/KV cache (tensor_model_parallel_size)
        import vllm  # noqa: F401  (fail here, with the install hint, rather than inside the engine)
        from vllm.platforms import current_platform  # noqa: I001
    except ImportError as e:  # vllm missing or broken in this environment
        raise ValueError(
            f"actor_rollout_ref.rollout.name='vllm' needs vLLM in this environment ({e}); install it with "
            "`pip install -e .[vllm]` (GPU) or `bash scripts/setup_vllm_cpu.sh` (CPU), or use rollout.name=jax"
        ) from e
    kwargs = dict(
        rollout_cfg=rc, max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=rc.max_new_tokens or cfg.data.max_response_length,
        work_dir=Path(cfg.trainer.default_local_dir), sync_timeout_s=rc.update_weights_timeout_s,
        # sleep/wake exists on CUDA only; elsewhere free_cache_engine means "reset the prefix cache" (always done)
        enable_sleep_mode=bool(rc.free_cache_engine) and current_platform.is_cuda(),
        dtype=rc.dtype,  # None: float32 on CPU, the params' dtype on GPU
    )
    if split:
        from jaxrl.rollout.vllm_worker import VllmWorkerEngine

        env = {}
        devices = [] if mesh is None else list(mesh.devices.flat)
        if devices and devices[0].platform == "gpu":  # the worker's GPUs: the rollout devices, not the trainer's
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.id) for d in devices)
        return VllmWorkerEngine(model_cfg, graphdef, params, tokenizer, env=env, **kwargs)
    from jaxrl.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_cfg, graphdef, params, tokenizer, **kwargs)


def _jetstream(cfg, model_cfg, graphdef, params, tokenizer, *, mesh, rules):
    """:class:`~jaxrl.rollout.jetstream_rollout.JetStreamRollout`: one decode slot per row of a generate call
    (``(data.gen_batch_size or data.train_batch_size) x rollout.n``), at most ``rollout.max_num_seqs``; each slot's
    KV cache holds the longest prompt (``data.max_prompt_length``; with partial rollouts prompt + response so far)
    ``+ (rollout.max_new_tokens or data.max_response_length)`` positions."""
    from jaxrl.rollout.jetstream_rollout import JetStreamRollout

    rc, d = cfg.actor_rollout_ref.rollout, cfg.data
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_cfg.eos_token_id[0]
    stops = len(set(model_cfg.eos_token_id) | set(rc.stop_token_ids))
    rows = (getattr(d, "gen_batch_size", None) or d.train_batch_size) * rc.n
    slots = min(rows, rc.max_num_seqs) if rc.max_num_seqs else rows
    return JetStreamRollout(
        model_cfg, graphdef, params, pad_token_id=int(pad), eos_token_ids=tuple(model_cfg.eos_token_id),
        max_prompt_length=_engine_prompt_length(cfg), max_new_tokens=rc.max_new_tokens or d.max_response_length,
        slots=int(slots), max_stop_ids=max(8, stops), tokenizer=tokenizer, mesh=mesh, rules=rules,
    )


def start_rollout(cfg, model_cfg, graphdef, params, tokenizer, *, mesh: Mesh | None = None,
                  rules: Rules | None = None, split: bool = False) -> WeightSync:
    """The run's rollout engine behind its :class:`WeightSync` (``.engine``); arguments as
    :func:`make_rollout_engine`, with ``params`` the trainer's initial params as placed for training.

    The JAX sampler (and the JetStream engine) on a mesh starts on the initial sync's output (the translator's ``"jax"`` plan, logged); the
    sampler without a mesh on ``params`` as they are; vLLM on ``params`` written as a Hugging Face directory, its
    weight sync an ``"hf"`` plan (on ``jax.devices()[0]``, or on the host for a split worker).

    Raises:
      ValueError: see :func:`make_rollout_engine` and :func:`jaxrl.rollout.weight_sync.make_translator`.
    """
    fmt = rollout_weight_format(cfg, mesh=mesh, rules=rules, split=split)
    return WeightSync.start(
        fmt, params,
        lambda initial: make_rollout_engine(cfg, model_cfg, graphdef, initial, tokenizer, mesh=mesh, rules=rules,
                                            split=split),
        model_cfg=model_cfg,
        engine_takes_scan_layout=cfg.actor_rollout_ref.rollout.name == "jax" and mesh is None,
    )
