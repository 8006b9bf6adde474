"""Processes: the one module that knows a run may be several processes of one JAX world.

A multi-process run is the same program on every process (SPMD): one process per host (a TPU VM of a pod, a GPU
node), or several on one machine (``python -m jaxrl.launch``), all driving one global device mesh. Every process
loads the same config, reads the same prompts and runs the same :class:`jaxrl.trainer.Trainer`; they differ only in
which devices they own. Everything that depends on that is here:

* **Joining the world** (:func:`initialize`, before jax's backend starts), from one of three sources
  (``trainer.distributed.mode``; :func:`resolve_world` reads it without importing jax):

  - ``env``: the explicit contract a launcher sets on every process: ``JAXRL_COORDINATOR_ADDRESS`` (``host:port``
    of process 0's coordinator), ``JAXRL_NUM_PROCESSES``, ``JAXRL_PROCESS_ID`` and, optional, ``JAXRL_LOCAL_DEVICE_COUNT``
    (CPU devices per process). Each may instead be given as ``trainer.distributed.coordinator_address`` /
    ``num_processes`` / ``process_id`` / ``local_device_count`` (a value set both ways must agree);
  - ``auto``: ``jax.distributed.initialize()`` detects the cluster itself (Cloud TPU VMs, SLURM, Open MPI, GKE);
  - ``local``: one process, nothing to join.

  Unset (the default), the mode is ``env`` when ``JAXRL_COORDINATOR_ADDRESS`` or
  ``trainer.distributed.coordinator_address`` is set, else ``local``. A coordinator on loopback binds to loopback
  only (never all interfaces). Heartbeat and shutdown timeouts are short (``trainer.distributed.heartbeat_timeout_s``,
  ``shutdown_timeout_s``), so a dead peer surfaces in seconds instead of jax's 100 / 300 s.
* **The two choke points of every device <-> host crossing**: :func:`to_host` (arrays to numpy; an array spread
  over several processes' devices is all-gathered) and :func:`to_global` (each process's identical host value to a
  global ``jax.Array`` with a given sharding).
* **One writer**: :func:`is_primary` (process 0) is the only process that writes files other than checkpoint
  arrays; :func:`run_on_primary` runs a function there and gives every process its result (or its exception).
* **Agreed decisions**: anything decided from a wall clock, a thread or a signal is decided once:
  :func:`run_on_primary` (reward scores, the run-folder lock, checkpoint listings), :func:`any_process` (SIGTERM,
  the non-finite-step counter), and :func:`check_replicas`, a per-step hash of the batch compared across processes.

With one process every helper is a plain local operation (no collective, nothing compiled). Every helper that
communicates is a collective: all processes must call it, in the same order (they do: they run the same program).
Nothing here imports jax at import time, so the config loader can use :func:`resolve_world`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxrl.config.errors import ConfigError

log = logging.getLogger("jaxrl")

__all__ = [
    "ENV_COORDINATOR_ADDRESS", "ENV_LOCAL_DEVICE_COUNT", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "MODES",
    "DistributedError", "ReplicaDivergenceError", "WorldSpec", "any_process", "barrier", "check_replicas",
    "check_shared_dir", "check_world", "exit_now", "initialize", "is_primary", "joined_processes",
    "local_device_count",
    "process_count", "process_index", "resolve_world", "run_guarded", "run_on_primary", "to_global", "to_host",
]

ENV_COORDINATOR_ADDRESS = "JAXRL_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXRL_LOCAL_DEVICE_COUNT"
MODES: tuple[str, ...] = ("local", "env", "auto")  # = jaxrl.config.schema.DISTRIBUTED_MODE_CHOICES
LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")

_KEY = "trainer.distributed"
_MIN_BROADCAST_BYTES = 1024  # payload buckets: powers of two from 1 KiB, so a handful of programs compile


class DistributedError(RuntimeError):
    """The processes could not form their world, or a collective decision failed."""


class ReplicaDivergenceError(DistributedError):
    """The processes no longer run the same program (their batches differ); the run must stop."""


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """How this process joins its world (:func:`resolve_world`); no jax needed.

    Attributes:
      mode: ``"local"`` (one process), ``"env"`` (the explicit address / count / id) or ``"auto"`` (jax detects
        the cluster).
      coordinator_address: ``host:port`` of process 0's coordinator (``env`` only).
      num_processes: processes in the world (``local``: 1; ``env``: given; ``auto``: None until joined).
      process_id: this process's index in ``[0, num_processes)`` (``auto``: None until joined).
      local_device_count: CPU devices this process simulates (``jax_num_cpu_devices``), or None (the platform's).
      coordinator_bind_address: where process 0's coordinator listens (``env``: the coordinator's own address
        when it is on loopback; otherwise None = jax's default, every interface).
      heartbeat_timeout_s, shutdown_timeout_s, initialization_timeout_s: seconds (see the schema).
    """

    mode: str = "local"
    coordinator_address: str | None = None
    num_processes: int | None = 1
    process_id: int | None = 0
    local_device_count: int | None = None
    coordinator_bind_address: str | None = None
    heartbeat_timeout_s: int = 10
    shutdown_timeout_s: int = 30
    initialization_timeout_s: int = 300

    @property
    def multi_process(self) -> bool:
        """True when the run will have (``auto``: may have) more than one process."""
        return self.mode == "auto" or (self.num_processes or 1) > 1


# ---------------------------------------------------------------------------------------------- the world spec


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _pick(env_name: str, env_value, key: str, key_value):
    """The value given by the environment or the config key; both set and different is an error."""
    if env_value is not None and key_value is not None and env_value != key_value:
        raise ConfigError(f"{env_name}={env_value!r} and {_KEY}.{key}={key_value!r} disagree; set one of them")
    return env_value if env_value is not None else key_value


def _split_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}={address!r} is invalid; expected host:port, e.g. 127.0.0.1:1234 or "
                          "[::1]:1234")
    return host, int(port)


def _loopback_bind(address: str) -> str | None:
    """Where a coordinator at ``address`` binds: loopback only when it is on loopback, else None (jax's default)."""
    host, port = _split_address(address, "coordinator address")
    if host in ("127.0.0.1", "localhost"):
        return f"127.0.0.1:{port}"
    if host == "::1":
        return f"[::1]:{port}"
    return None


def resolve_world(dist_cfg, environ: Mapping[str, str] | None = None) -> WorldSpec:
    """The :class:`WorldSpec` a config's ``trainer.distributed`` section and the environment describe (no jax).

    Args:
      dist_cfg: the ``trainer.distributed`` section (:class:`jaxrl.config.schema.DistributedConfig`).
      environ: the environment (default ``os.environ``); reads the ``JAXRL_*`` contract (module docstring).

    Raises:
      ConfigError: an unknown mode; a ``JAXRL_*`` value or key that is malformed, out of range or set both ways to
        different values; ``env`` without an address, count or id; ``local`` while the environment or the keys
        describe several processes; ``auto`` with an explicit address, count or id (one line each).
    """
    env = os.environ if environ is None else environ
    d = dist_cfg
    env_addr = (env.get(ENV_COORDINATOR_ADDRESS) or "").strip() or None
    addr = _pick(ENV_COORDINATOR_ADDRESS, env_addr, "coordinator_address", d.coordinator_address)
    num = _pick(ENV_NUM_PROCESSES, _env_int(env, ENV_NUM_PROCESSES), "num_processes", d.num_processes)
    pid = _pick(ENV_PROCESS_ID, _env_int(env, ENV_PROCESS_ID), "process_id", d.process_id)
    local = _pick(ENV_LOCAL_DEVICE_COUNT, _env_int(env, ENV_LOCAL_DEVICE_COUNT), "local_device_count",
                  d.local_device_count)
    if local is not None and local < 1:
        raise ConfigError(f"{ENV_LOCAL_DEVICE_COUNT} / {_KEY}.local_device_count={local} must be >= 1")
    timeouts = dict(heartbeat_timeout_s=d.heartbeat_timeout_s, shutdown_timeout_s=d.shutdown_timeout_s,
                    initialization_timeout_s=d.initialization_timeout_s)
    for name, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{_KEY}.{name}={value!r} is invalid; expected an int >= 1 (seconds)")
    mode = d.mode if d.mode is not None else ("env" if addr is not None else "local")
    if mode not in MODES:
        raise ConfigError(f"{_KEY}.mode={mode!r} is invalid; expected one of {', '.join(map(repr, MODES))} "
                          "(or null: env when JAXRL_COORDINATOR_ADDRESS is set, else local)")
    if mode == "local":
        if (num or 1) > 1 or addr is not None:
            raise ConfigError(f"{_KEY}.mode='local' runs one process, but {ENV_COORDINATOR_ADDRESS} / "
                              f"{ENV_NUM_PROCESSES} (or {_KEY}.*) describe a world of {num or '?'} processes; "
                              "unset them or drop the mode")
        if pid not in (None, 0):
            raise ConfigError(f"{ENV_PROCESS_ID} / {_KEY}.process_id={pid} needs a world of several processes")
        return WorldSpec(mode="local", local_device_count=local, **timeouts)
    if mode == "auto":
        given = [n for n, v in ((ENV_COORDINATOR_ADDRESS, addr), (ENV_NUM_PROCESSES, num), (ENV_PROCESS_ID, pid))
                 if v is not None]
        if given:
            raise ConfigError(f"{_KEY}.mode='auto' lets jax detect the cluster, but {', '.join(given)} (or the "
                              f"{_KEY}.* keys) are set too; drop them or use mode env")
        return WorldSpec(mode="auto", num_processes=None, process_id=None, local_device_count=local,
                         coordinator_bind_address=d.coordinator_bind_address, **timeouts)
    missing = [f"{e} ({_KEY}.{k})" for e, k, v in ((ENV_COORDINATOR_ADDRESS, "coordinator_address", addr),
                                                   (ENV_NUM_PROCESSES, "num_processes", num),
                                                   (ENV_PROCESS_ID, "process_id", pid)) if v is None]
    if missing:
        raise ConfigError(f"{_KEY}.mode='env' needs {', '.join(missing)}; python -m jaxrl.launch sets them for "
                          "processes on one machine")
    _split_address(addr, ENV_COORDINATOR_ADDRESS)
    if num < 1:
        raise ConfigError(f"{ENV_NUM_PROCESSES} / {_KEY}.num_processes={num} must be >= 1")
    if not 0 <= pid < num:
        raise ConfigError(f"{ENV_PROCESS_ID} / {_KEY}.process_id={pid} must be in [0, {num}) "
                          f"({ENV_NUM_PROCESSES}={num})")
    bind = d.coordinator_bind_address or _loopback_bind(addr)
    if bind is not None:
        _split_address(bind, f"{_KEY}.coordinator_bind_address")
    return WorldSpec(mode="env", coordinator_address=addr.strip(), num_processes=num, process_id=pid,
                     local_device_count=local, coordinator_bind_address=bind, **timeouts)


def check_world(cfg, spec: WorldSpec, *, num_processes: int | None = None,
                local_devices: int | None = None) -> None:
    """What a multi-process run requires of the config, checked with what is known (no jax).

    At config load ``num_processes`` / ``local_devices`` come from ``spec`` (None when unknown: ``auto``); after
    :func:`initialize` from jax itself.

    * ``trainer.nnodes`` must equal the process count (verl's nodes are jaxrl's processes, one per host);
    * with several processes: ``trainer.n_gpus_per_node`` must equal each process's device count (one process:
      the mesh checks use the real device count, as before); a train mesh (``trainer.mesh``) must be set (without
      one every role would run on one local device per process); ``trainer.placement=split`` is refused (multi-
      controller JAX refuses a cross-host reshard between different device sets, which the split weight sync
      needs); the vLLM engine is refused (its weight sync puts whole tensors on one device of process 0).

    Raises:
      ConfigError: one line naming the keys, the values and the fix.
    """
    from jaxrl.config.cross import mesh_enabled

    t = cfg.trainer
    n = num_processes if num_processes is not None else spec.num_processes
    if n is None:  # auto, not joined yet: checked again once jax knows the world
        return
    local = local_devices if local_devices is not None else spec.local_device_count
    if t.nnodes != n:
        raise ConfigError(
            f"trainer.nnodes={t.nnodes} but this run has {n} process(es) (one per node); set trainer.nnodes={n}"
            + ("" if n > 1 else ", or start one process per node (python -m jaxrl.launch --nproc K on one machine, "
               f"{ENV_COORDINATOR_ADDRESS} / {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID} or "
               f"{_KEY}.mode=auto on each host)"))
    if n == 1:
        return
    who = f"{n} processes"
    if local is not None and t.n_gpus_per_node != local:
        raise ConfigError(f"trainer.n_gpus_per_node={t.n_gpus_per_node} but each of the {who} has {local} local "
                          f"device(s); set trainer.n_gpus_per_node={local}")
    if t.placement == "split":
        raise ConfigError(
            f"trainer.placement='split' is not supported with {who}: the split weight sync reshards between two "
            "different device sets, which multi-controller JAX refuses across hosts; use trainer.placement="
            "colocated (the rollout engine runs on the train mesh's devices)")
    if not mesh_enabled(cfg):
        raise ConfigError(f"a run of {who} needs a train mesh over all their devices (trainer.mesh unset runs "
                          "every role on one device per process); set e.g. trainer.mesh.fsdp=-1")
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        raise ConfigError(
            f"actor_rollout_ref.rollout.name='vllm' is not supported with {who} yet: its weight sync gathers the "
            "policy onto one device of process 0; use rollout.name=jax (the embedded sampler on the train mesh)")
    if cfg.actor_rollout_ref.rollout.name == "jetstream":
        raise ConfigError(
            f"actor_rollout_ref.rollout.name='jetstream' is not supported with {who} yet (its continuous-batching "
            "host loop has not been run across processes); use rollout.name=jax (the embedded sampler)")


# ---------------------------------------------------------------------------------------------- joining


_SPEC: WorldSpec | None = None  # set by initialize(): the world this process joined


def initialize(cfg) -> WorldSpec:
    """Join the world ``cfg.trainer.distributed`` and the environment describe; call before anything uses jax.

    ``local`` joins nothing (only ``local_device_count``, when set, is applied). ``env`` / ``auto`` call
    ``jax.distributed.initialize`` with this config's timeouts (and, for ``env``, the address, count, id and a
    loopback bind address for a loopback coordinator), then check the config against the world jax reports
    (:func:`check_world`). Idempotent for the same spec.

    Returns:
      the joined :class:`WorldSpec` (``num_processes`` / ``process_id`` filled in).

    Raises:
      ConfigError: a bad ``trainer.distributed`` / ``JAXRL_*`` setting, or a config the world cannot run
        (:func:`check_world`); ``local_device_count`` after jax's backend started with another count.
      DistributedError: the coordinator could not be reached or the other processes did not join within
        ``initialization_timeout_s`` (names the address, the process and the timeout).
    """
    global _SPEC
    spec = resolve_world(cfg.trainer.distributed)
    if _SPEC is not None:
        if dataclasses.replace(_SPEC, num_processes=spec.num_processes, process_id=spec.process_id) != spec \
                and spec.mode != "auto":
            raise DistributedError(f"initialize() was called again with another world ({spec} after {_SPEC})")
        return _SPEC
    import jax

    if spec.local_device_count is not None:
        _set_cpu_devices(spec.local_device_count)
    if spec.mode == "local":
        _SPEC = spec
        check_world(cfg, spec, num_processes=jax.process_count())
        return spec
    kwargs = dict(initialization_timeout=spec.initialization_timeout_s,
                  heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
                  shutdown_timeout_seconds=spec.shutdown_timeout_s,
                  coordinator_bind_address=spec.coordinator_bind_address)
    if spec.mode == "env":
        kwargs.update(coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                      process_id=spec.process_id)
    who = (f"process {spec.process_id} of {spec.num_processes} (coordinator {spec.coordinator_address})"
           if spec.mode == "env" else "this process (cluster auto-detection)")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - jax raises several types; one line says what failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"{who} could not join the JAX world within {spec.initialization_timeout_s} s "
            f"({_KEY}.initialization_timeout_s): {first[:300]}; are all processes started, and is the "
            "coordinator (process 0) reachable?") from e
    finally:
        # jax's preemption notifier took SIGTERM over (it would swallow it until a sync point jaxrl never asks
        # about); the trainer agrees on SIGTERM itself (any_process, each step), so the handler goes back
        if threading.current_thread() is threading.main_thread() and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    _SPEC = dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())
    log.info("process %d of %d joined the JAX world (%d local / %d global devices, mode %s)", _SPEC.process_id,
             _SPEC.num_processes, jax.local_device_count(), jax.device_count(), spec.mode)
    check_world(cfg, spec, num_processes=jax.process_count(), local_devices=jax.local_device_count())
    return _SPEC


def _set_cpu_devices(n: int) -> None:
    """``jax_num_cpu_devices = n`` (CPU devices of this process), before the backend starts."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = len(jax.local_devices(backend="cpu"))
        if have != n:
            raise ConfigError(f"{ENV_LOCAL_DEVICE_COUNT} / {_KEY}.local_device_count={n} cannot apply: jax already "
                              f"started with {have} CPU devices in this process")
        return
    jax.config.update("jax_num_cpu_devices", n)


def joined_processes() -> int:
    """Processes of the world :func:`initialize` joined: 1 before it (or in ``local`` mode). Never touches jax."""
    return 1 if _SPEC is None or _SPEC.num_processes is None else _SPEC.num_processes


def process_count() -> int:
    """Processes in the world (1 without :func:`initialize` or in ``local`` mode)."""
    import jax

    return jax.process_count()


def process_index() -> int:
    """This process's index in ``[0, process_count())``."""
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """True on process 0: the one writer of metrics, logs, plots, the tokenizer and the exported model."""
    return process_index() == 0


def local_device_count() -> int:
    """Devices this process drives."""
    import jax

    return jax.local_device_count()


def run_guarded(main: Callable[..., int], *args) -> int:
    """``main(*args)`` (a command's body returning its exit status), ending this process at once when it fails in a
    world of several processes: status != 0 -> :func:`exit_now` with it; an exception -> its traceback, then
    :func:`exit_now` (1). Otherwise (one process, or success) the status is returned and exceptions propagate."""
    try:
        code = main(*args)
    except BaseException:
        if joined_processes() > 1:
            import traceback

            traceback.print_exc()
            exit_now(1)
        raise
    if code != 0 and joined_processes() > 1:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End a process of a multi-process world at once with ``code`` (stdout/stderr flushed first).

    A Python exit runs jax's shutdown barrier, which waits for every other process up to
    ``trainer.distributed.shutdown_timeout_s``; a process that failed must instead leave at once, so its launcher
    (or its peers' heartbeat) ends the others. Only call it when the world has several processes.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    logging.shutdown()
    os._exit(code)


# ---------------------------------------------------------------------------------------------- device <-> host


def to_host(tree: Any) -> Any:
    """Every array leaf of ``tree`` as a numpy array (the one device -> host crossing).

    An array laid over devices of several processes is all-gathered first (a collective: every process must call
    this with the same tree); one this process can read (its devices hold all of it, or it is replicated) is
    copied directly. Other leaves go through ``numpy.asarray``.

    Returns:
      the tree with numpy leaves (the same structure; e.g. an ``nnx.State`` stays one).
    """
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(tree)
    if any(_spans_processes(x) for x in leaves):
        from jax.experimental import multihost_utils

        leaves = [multihost_utils.process_allgather(x, tiled=True) if _spans_processes(x) else x for x in leaves]
    fetched = jax.device_get(leaves)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in fetched])


def _spans_processes(x) -> bool:
    """A ``jax.Array`` whose value this process cannot read on its own."""
    import jax

    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def to_global(tree: Any, shardings: Any) -> Any:
    """Host values (identical on every process) as global ``jax.Array`` s laid out by ``shardings`` (the one
    host -> device crossing of sharded inputs).

    Args:
      tree: a pytree whose numpy / Python leaves are the same on every process (``[N, ...]`` batch arrays,
        scalars); ``jax.Array`` leaves are returned as they are.
      shardings: a tree prefix of ``tree``: a ``jax.sharding.Sharding`` for each subtree (None leaves a subtree
        unplaced).

    Returns:
      the tree with every host leaf under a sharding replaced by a ``jax.Array`` with that sharding: each process
      builds the pieces its own devices hold, from its own copy (no communication). With one process this equals
      ``jax.device_put(leaf, sharding)``.
    """
    import jax

    def place(sharding, subtree):
        if sharding is None:
            return subtree
        return jax.tree.map(lambda x: _put(x, sharding), subtree)

    return jax.tree.map(place, shardings, tree,
                        is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding))


def _put(x, sharding):
    import jax
    import numpy as np

    if isinstance(x, jax.Array):
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# ---------------------------------------------------------------------------------------------- agreement


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (a collective; local with one process). For decisions
    made from signals or clocks: SIGTERM, a non-finite step, early stop."""
    if process_count() == 1:
        return bool(flag)
    return bool(_allgather_ints([int(bool(flag))]).any())


def all_processes(flag: bool) -> bool:
    """True on every process when ``flag`` is true on all of them (a collective; local with one process)."""
    if process_count() == 1:
        return bool(flag)
    return bool(_allgather_ints([int(bool(flag))]).all())


def _allgather_ints(values) -> Any:
    """``[process_count(), len(values)]`` int32: every process's ``values``."""
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))


def barrier(name: str) -> None:
    """Wait until every process got here (a collective; nothing with one process). ``name`` must be the same on
    every process (a mismatch raises, naming it)."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's ``data`` on every process (others pass None): its length, then the bytes padded to a power of
    two (>= 1 KiB, so few programs compile)."""
    import numpy as np
    from jax.experimental import multihost_utils

    primary = is_primary()
    size = np.asarray([len(data) if primary else 0], np.int32)
    n = int(multihost_utils.broadcast_one_to_all(size)[0])
    bucket = max(_MIN_BROADCAST_BYTES, 1 << max(0, (n - 1).bit_length()))
    buf = np.zeros(bucket, np.uint8)
    if primary:
        buf[:n] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()


def run_on_primary(fn: Callable[..., Any], *args, share: bool = True, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on process 0 only; every process gets its result, or raises its exception.

    For decisions made once for the whole world (reward scores with their timeouts, the run-folder lock, which
    checkpoints exist) and for writes into the shared run folder. A collective: every process calls it at the
    same point; with one process it is a plain call.

    Args:
      fn: the function; runs on process 0 only.
      share: True: the result is pickled and broadcast (it must be picklable); False: the other processes get
        None (e.g. a lock object), only success or the exception is shared.

    Returns:
      ``fn``'s result (``share=False``: on process 0 only, None elsewhere).

    Raises:
      whatever ``fn`` raised on process 0, on every process: the same class with the same ``args`` and picklable
      attributes (built without calling its ``__init__``; its traceback stays on process 0).
      DistributedError: ``share=True`` and the result cannot be pickled (on every process).
    """
    if process_count() == 1:
        return fn(*args, **kwargs)
    if is_primary():
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised here once the others have it
            _broadcast_bytes(pickle.dumps(("error", _RaisedOnPrimary.of(e))))
            raise
        try:
            payload = pickle.dumps(("ok", result if share else None))
        except Exception as e:  # noqa: BLE001 - the others wait for it: every process raises instead
            err = DistributedError(f"cannot share a {type(result).__name__} from process 0 with the other "
                                   f"processes: {e}")
            _broadcast_bytes(pickle.dumps(("error", _RaisedOnPrimary.of(err))))
            raise err from e
        _broadcast_bytes(payload)
        return result
    kind, value = pickle.loads(_broadcast_bytes(None))
    if kind == "error":
        raise value.rebuild()
    return value


@dataclasses.dataclass(frozen=True)
class _RaisedOnPrimary:
    """An exception of process 0 in a form that pickles: its class, ``args`` and picklable attributes (many
    exception classes with keyword-only ``__init__`` arguments do not unpickle as themselves)."""

    cls: type
    args: tuple
    state: dict

    @classmethod
    def of(cls, e: BaseException) -> "_RaisedOnPrimary":
        state = {}
        for k, v in vars(e).items():
            try:
                pickle.dumps(v)
            except Exception:  # noqa: BLE001 - an attribute that cannot travel is left out
                continue
            state[k] = v
        try:
            pickle.dumps((type(e), e.args))
            return cls(type(e), e.args, state)
        except Exception:  # noqa: BLE001
            return cls(DistributedError, (f"{type(e).__name__}: {e}",), {})

    def rebuild(self) -> BaseException:
        e = self.cls.__new__(self.cls)
        e.args = self.args
        e.__dict__.update(self.state)
        return e


def check_replicas(step: int, *arrays) -> None:
    """Fail loudly when the processes' copies of the step's batch differ (a cheap per-step check).

    Each process hashes ``arrays`` (shapes, dtypes and bytes; e.g. the batch's token ids and masks) and the hashes
    are compared; a collective (nothing with one process).

    Raises:
      ReplicaDivergenceError: one line naming the step, each process's hash and the processes that differ from
        process 0.
    """
    if process_count() == 1:
        return
    import numpy as np

    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    mine = np.frombuffer(h.digest(), np.int32)
    everyone = _allgather_ints(mine)
    differ = [p for p in range(len(everyone)) if not np.array_equal(everyone[p], everyone[0])]
    if differ:
        hexes = ", ".join(f"process {p}: {everyone[p].astype('<i4').tobytes().hex()}" for p in range(len(everyone)))
        raise ReplicaDivergenceError(
            f"step {step}: the batch's token ids differ across processes (processes {differ} differ from process "
            f"0; {hexes}): the replicas stopped running the same program (a decision made from a local clock, "
            "thread or file); the run stops")


def check_shared_dir(path: str | os.PathLike, what: str = "trainer.default_local_dir") -> None:
    """Check that every process sees the same folder ``path`` (multi-host runs need shared storage).

    Process 0 writes a token file there, every process reads it back, then process 0 removes it. A collective;
    nothing with one process.

    Raises:
      ConfigError: the processes that cannot see the token (or read another content), naming ``what`` and the fix.
    """
    if process_count() == 1:
        return
    import secrets

    folder = Path(path).expanduser().absolute()

    def write() -> tuple[str, str]:
        name, content = f".jaxrl-shared-check-{secrets.token_hex(8)}", secrets.token_hex(16)
        (folder / name).write_text(content)
        return name, content

    name, content = run_on_primary(write)
    try:
        seen = (folder / name).read_text() == content
    except OSError:
        seen = False
    flags = _allgather_ints([int(seen)])[:, 0]
    if is_primary():
        (folder / name).unlink(missing_ok=True)
    barrier("jaxrl-shared-dir-checked")  # the token is gone when any process returns
    blind = [p for p, ok in enumerate(flags) if not ok]
    if blind:
        raise ConfigError(
            f"{what}={str(folder)!r} is not shared: process(es) {blind} cannot see the file process 0 wrote "
            "there; a multi-process run needs one folder "
            "every process sees at the same path (a shared filesystem such as NFS, Filestore or a GCS FUSE mount)")
