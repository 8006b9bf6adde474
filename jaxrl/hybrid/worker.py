"""The members of the hybrid controller's worker groups: what runs inside each group's JAX world.

Both classes are plain Python; :mod:`jaxrl.hybrid.groups` makes them Ray actors, one per host of a group's resource
pool, each holding its bundle's devices. Every method takes and returns picklable host values (numpy arrays,
:class:`~jaxrl.batch.RLBatch`, dicts), because a group's arrays never leave its world: what crosses to the driver or
to the other group goes through Ray's object store.

* :class:`TrainWorker` (the train group: actor, reference, critic) builds the roles exactly as a single-process run
  does (:mod:`jaxrl.build`), on a train mesh over its own devices (``trainer.mesh``), and runs each phase the driver
  asks for. Its weights leave it as one host copy put into the object store (:meth:`TrainWorker.weights`).
* :class:`RolloutWorker` (the rollout group) starts the run's rollout engine (the embedded sampler or the JetStream
  engine) on a rollout mesh over its own devices and loads each weight copy through the translator
  (:class:`jaxrl.rollout.weight_sync.WeightSync`, the ``"jax"`` plan onto that mesh); with vLLM, each member is an
  engine of its own on its host (vLLM per host; the ``"hf"`` plan on the host CPU).

Nothing here imports Ray at import time; jax is imported only once the worker has applied its environment
(``JAXRL_LOCAL_DEVICE_COUNT`` for simulated CPU devices, ``JAXRL_SHARED``, ...).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import types
from typing import Any

log = logging.getLogger("jaxrl")

__all__ = ["RolloutWorker", "TrainWorker"]


class _Member:
    """What every group member does: take the driver's environment and working directory, say where it runs."""

    def __init__(self, env: dict[str, str], cwd: str | None = None):
        os.environ.update(env)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)  # the driver's relative paths (data files, the run folder) mean the same here
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def describe(self) -> dict[str, Any]:
        """``node_ip``, ``node_id``, ``hostname``, ``pid`` of this member (for the driver's messages)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def free_port(self) -> tuple[str, int]:
        """``(node IP, free port)``: rank 0's answer is where its world's coordinator listens."""
        from jaxrl.ray_backend.host import free_port_on_node

        return free_port_on_node()

    def set_rank(self, rank: int) -> None:
        """This member's rank in its group (names its own files, e.g. a vLLM member's model folder)."""
        self.rank = rank

    def set_world(self, coordinator: str, num_processes: int, process_id: int) -> None:
        """Make this member process ``process_id`` of its group's world of ``num_processes`` (several hosts): the
        :mod:`jaxrl.distributed` env contract, read when :meth:`_join` initializes; the coordinator listens on its
        own address only."""
        from jaxrl.distributed import ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID

        os.environ.update({ENV_COORDINATOR_ADDRESS: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                           ENV_PROCESS_ID: str(process_id)})
        self._bind = coordinator

    def memory(self) -> dict[str, float]:
        """This member's ``perf/*`` metrics of the step that just ended, read once per step: its memory
        (:func:`jaxrl.metrics.memory_metrics`: its RSS after its free memory went back to the OS, by
        :func:`jaxrl.host_memory.release_free_memory`, and its devices' peaks) and the time it spent making XLA
        programs since the last call (:data:`jaxrl.metrics.compile_clock`)."""
        from jaxrl.host_memory import release_free_memory
        from jaxrl.metrics import compile_clock, memory_metrics

        release_free_memory()
        return {**memory_metrics(), **compile_clock.take()}

    def ping(self) -> bool:
        """Answered from the member's second thread while a phase runs: the driver's liveness check."""
        return True

    def _join(self, cfg, group: str):
        """Join this group's world (one host: nothing to join, the CPU devices set; several: ``jax.distributed``
        with the group's own coordinator) with :func:`group_config`; returns that config."""
        import jax

        from jaxrl import distributed
        from jaxrl.compilation_cache import use_compilation_cache
        from jaxrl.host_memory import set_up_host_memory
        from jaxrl.metrics import compile_clock

        g = group_config(cfg, group)
        if getattr(self, "_bind", None):
            g.trainer.distributed.coordinator_bind_address = self._bind
        use_compilation_cache(g.trainer.jax_compilation_cache_dir)  # before the member's first compile
        set_up_host_memory(jax.monitoring.register_event_duration_secs_listener)  # (jaxrl.host_memory)
        compile_clock.take()  # starts counting: the first step's report includes the build's and step 1's compiles
        distributed.initialize(g)
        return g


def group_config(cfg, group: str):
    """The config a group's world runs (a copy; the driver's is unchanged).

    ``train``: the rollout engine and the async pipeline are not in this world (the rollout group, the driver), so
    its copy names the embedded engine and no staleness (what :func:`jaxrl.distributed.check_world` refuses of a
    world of several processes does not apply to them). ``rollout``: the world's size is the rollout pool's
    (``trainer.nnodes`` / ``n_gpus_per_node`` := ``actor_rollout_ref.rollout.nnodes`` / ``n_gpus_per_node``), and its
    mesh is the rollout mesh (:meth:`RolloutWorker.start`), so ``trainer.mesh`` spans the world's devices; with vLLM
    each member is a world of its own (one host: ``trainer.nnodes`` := 1; vLLM places its weights on its GPUs, the
    member's JAX only translates weights on the host).
    """
    import copy

    g = copy.deepcopy(cfg)
    g.async_training.staleness, g.async_training.partial_rollout = 0, False
    g.trainer.launcher, g.trainer.max_restarts = "local", 0
    r = g.actor_rollout_ref.rollout
    if group == "train":
        r.name = "jax"
    else:
        g.trainer.nnodes, g.trainer.n_gpus_per_node = (1 if r.name == "vllm" else r.nnodes), r.n_gpus_per_node
        g.trainer.mesh.data, g.trainer.mesh.fsdp, g.trainer.mesh.tensor = -1, 1, 1
    return g


class TrainWorker(_Member):
    """The train group's member: the actor, the frozen reference and the critic on the train mesh of its world.

    Call order (the driver's): :meth:`load` -> :meth:`build` -> phases (:meth:`compute_log_probs`,
    :meth:`compute_values`, :meth:`update`, :meth:`weights`, :meth:`state` / :meth:`load_state`) ->
    :meth:`export_final_model`.
    """

    def load(self, cfg) -> dict[str, Any]:
        """Join this group's world, place the train mesh over its devices and load the policy.

        Returns:
          ``{"tokenizer", "model_cfg", "placement"}`` (the placement described in one line).

        Raises:
          ConfigError: a ``trainer.mesh`` that does not fit this group's devices, a context too short; the model
            loader's errors (``ModelFileError``, ``FileNotFoundError``).
        """
        from jaxrl import build
        from jaxrl.workers.placement import describe_mesh, placement_from_config

        cfg = self.cfg = self._join(cfg, "train")
        self.placement = placement_from_config(cfg)  # the train mesh over this world's devices (None: one device)
        self.pre, self.tokenizer = build._load_policy(cfg.actor_rollout_ref.model)
        build._check_context_lengths(cfg, self.pre.config)
        # its placement's rollout mesh (over the same devices) is unused here: only the train mesh is described
        mesh = "one device" if self.placement is None else describe_mesh(self.placement.train_mesh)
        return {"tokenizer": self.tokenizer, "model_cfg": self.pre.config, "placement": mesh}

    def build(self, total_training_steps: int) -> dict[str, Any]:
        """Build the roles as :func:`jaxrl.build.build` does (LoRA, the reference, the critic).

        Returns:
          ``{"model_meta", "roles", "lora", "graphdef"}``: the checkpoint's model entry, the names of the roles built
          (``actor``, ``ref``, ``critic``), whether the actor trains LoRA adapters, and the policy's graph without
          adapters (what the rollout engine runs).
        """
        from flax import nnx

        from jaxrl import build
        from jaxrl.algorithms.registry import needs_critic
        from jaxrl.checkpoint import model_meta

        cfg, pre = self.cfg, self.pre
        graphdef, params = nnx.split(pre.model)
        actor, ref = build._build_actor_and_reference(cfg, graphdef, params, total_training_steps, self.placement)
        critic = (build._build_critic(cfg, pre, total_training_steps, self.placement)
                  if needs_critic(cfg.algorithm.adv_estimator) else None)
        self.roles = {k: v for k, v in (("actor", actor), ("ref", ref), ("critic", critic)) if v is not None}
        arr = cfg.actor_rollout_ref
        meta = model_meta(pre.config, path=arr.model.path, param_dtype=arr.model.param_dtype,
                          lora=build._lora_meta(actor.lora), scan_layout=actor.scan_layout)
        self.pre = types.SimpleNamespace(config=pre.config)  # the loaded weights are the roles' now: not kept twice
        return {"model_meta": meta, "roles": sorted(self.roles), "lora": actor.lora is not None,
                "graphdef": actor.base_graphdef}

    def compute_log_probs(self, role: str, batch) -> tuple[Any, Any]:
        """``(log_probs, entropy)`` float32 ``[N, R]`` of ``batch`` under role ``actor`` or ``ref``."""
        return self.roles[role].compute_log_probs(batch)

    def compute_values(self, batch) -> Any:
        """The critic's values float32 ``[N, R]``."""
        return self.roles["critic"].compute_values(batch)

    def update(self, role: str, batch) -> dict[str, float]:
        """One update of role ``actor`` or ``critic`` on ``batch``; its metrics."""
        return self.roles[role].update(batch)

    def weights(self) -> dict[str, Any]:
        """The policy's current weights (``ActorWorker.merged_params``: with LoRA merged), gathered to host memory
        and put into Ray's object store by this member (its owner).

        Returns:
          ``{"ref": [ObjectRef of the nnx.State with numpy leaves], "bytes", "tensors", "gather_s"}``; the ref is
          wrapped in a list so that the driver passes it on unresolved.
        """
        import jax
        import ray

        from jaxrl import distributed

        t0 = time.perf_counter()
        host = distributed.to_host(self.roles["actor"].merged_params())  # a collective: every member gathers
        leaves = jax.tree.leaves(host)
        ref = ray.put(host) if distributed.is_primary() else None  # the primary's copy is the one that travels
        return {"ref": [ref], "bytes": int(sum(x.nbytes for x in leaves)), "tensors": len(leaves),
                "gather_s": time.perf_counter() - t0}

    def state(self, role: str) -> tuple[Any, dict]:
        """What a checkpoint holds of ``role`` (:meth:`TrainedRole.state`), its arrays copied to host memory."""
        from jaxrl import distributed

        arrays, meta = self.roles[role].state()
        return distributed.to_host(arrays), meta

    def load_state(self, role: str, arrays: Any, meta: dict) -> None:
        """Restore ``role`` from host ``arrays`` (the layout :meth:`state` returned), placed on the role's live
        shardings."""
        import jax
        import numpy as np

        from jaxrl.distributed import to_global

        live = self.roles[role].state()[0]
        host = jax.tree.map(lambda new, old: np.asarray(new, dtype=old.dtype), arrays, live)
        placed = to_global(host, jax.tree.map(lambda x: x.sharding, live))  # each process: its devices' pieces
        self.roles[role].load_state(placed, meta)

    def export_final_model(self, out_dir: str) -> None:
        """Write the trained policy as a Hugging Face folder ``<out_dir>/hf_model`` (and ``lora_adapter/``):
        :func:`jaxrl.loop.export_final_model`, here, where the weights are."""
        from pathlib import Path

        from jaxrl.loop import export_final_model

        c = types.SimpleNamespace(actor=self.roles["actor"], out_dir=Path(out_dir), model_cfg=self.pre.config,
                                  tokenizer=self.tokenizer)
        export_final_model(c, base_model_path=self.cfg.actor_rollout_ref.model.path)


class RolloutWorker(_Member):
    """The rollout group's member: the rollout engine on a rollout mesh over its world's devices, or (vLLM) its own
    vLLM engine on its host's GPUs.

    Call order: :meth:`start` (with the train group's first weight copy) -> :meth:`generate` / :meth:`update_weights`.
    """

    def start(self, cfg, model_cfg, graphdef, weights, tokenizer) -> dict[str, Any]:
        """Join this group's world and start the engine on ``weights`` (the train group's host copy).

        The mesh is ``(data = devices / tp, fsdp = 1, tensor = tp)`` over every device of this world with ``tp =
        actor_rollout_ref.rollout.tensor_model_parallel_size``, as the rollout mesh of a single-process placement.
        Each weight copy is placed by the rollout rules' shardings on that mesh (each process puts the pieces its
        devices hold, from its node's copy), then goes through the run's :class:`WeightSync` (its translator's
        ``"jax"`` plan, here from that layout to itself) into the engine (:func:`jaxrl.rollout.factory.start_rollout`).

        vLLM (``rollout.name=vllm``, "vLLM per host"): every member is an engine of its own, in this process
        (:class:`~jaxrl.rollout.vllm_engine.VllmEngine`, tensor-parallel over the GPUs Ray gave this member's bundle;
        the member's JAX runs on the host CPU, ``JAX_PLATFORMS=cpu`` from the driver), its model folder
        ``<trainer.default_local_dir>/vllm_rollout_<rank>``; each weight copy goes through the translator's ``"hf"``
        plan on the host into vLLM. The driver splits each generate call's prompts across the members
        (:mod:`jaxrl.hybrid.dispatch`).

        Returns:
          ``{"engine", "mesh", "eos_token_ids", "pad_token_id"}``.

        Raises:
          ConfigError: a tensor-parallel degree that does not divide this group's devices.
        """
        import jax

        from jaxrl.distributed import to_global
        from jaxrl.rollout.factory import start_rollout
        from jaxrl.workers.placement import describe_mesh, make_placement
        from sharding import param_shardings

        cfg = self._join(cfg, "rollout")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_cfg.eos_token_id[0]
        if cfg.actor_rollout_ref.rollout.name == "vllm":
            from pathlib import Path

            cfg.trainer.default_local_dir = str(Path(cfg.trainer.default_local_dir) / f"vllm_rollout_{self.rank}")
            Path(cfg.trainer.default_local_dir).mkdir(parents=True, exist_ok=True)
            host = jax.devices()[0]  # the host CPU: the hf plan's input
            self._place = lambda w: jax.device_put(w, host)
            self.weight_sync = start_rollout(cfg, model_cfg, graphdef, self._place(weights), tokenizer)
            self.engine = self.weight_sync.engine
            return {"engine": str(self.engine.engine_name), "mesh": f"vLLM per host, member {self.rank}",
                    "eos_token_ids": tuple(self.engine.eos_token_ids), "pad_token_id": int(pad)}
        devices = jax.devices()  # every process of this world
        placement = make_placement("colocated", {"data": len(devices), "fsdp": 1, "tensor": 1},
                                   rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
        mesh = placement.rollout_mesh
        # the layout the translator plans for the engine (the rollout rules on this mesh); each host copy lands on
        # it directly (every process places the pieces its devices hold)
        shardings = param_shardings(weights, mesh, placement.rollout_rules)
        self._place = lambda w: to_global(w, shardings)
        self.weight_sync = start_rollout(cfg, model_cfg, graphdef, self._place(weights), tokenizer,
                                         mesh=mesh, rules=placement.rollout_rules)
        self.engine = self.weight_sync.engine
        return {"engine": str(getattr(self.engine, "engine_name", None) or type(self.engine).__name__),
                "mesh": describe_mesh(mesh),
                "eos_token_ids": tuple(getattr(self.engine, "eos_token_ids", ())), "pad_token_id": int(pad)}

    def generate(self, prompt_ids, sampling_params, first_row: int = 0):
        """``engine.generate``: a :class:`~jaxrl.rollout.base.RolloutOutput` (numpy arrays). ``first_row``: this
        member's share of the call starts at that row of the whole batch (vLLM per host; its rows' seeds)."""
        if first_row:
            return self.engine.generate(prompt_ids, sampling_params, first_row=first_row)
        return self.engine.generate(prompt_ids, sampling_params)

    def update_weights(self, weights) -> dict[str, float]:
        """Load a weight copy (an ``nnx.State`` of numpy arrays, resolved by Ray from the train group's object
        store) through the run's :class:`WeightSync`; ``{"load_s"}``: its seconds here.

        Raises:
          WeightSyncError: a tree that differs from the engine's, a failed translation or load (the engine keeps
            its previous weights).
        """
        t0 = time.perf_counter()
        self.weight_sync.sync(self._place(weights))  # onto the layout the engine started on (see start)
        return {"load_s": time.perf_counter() - t0}
