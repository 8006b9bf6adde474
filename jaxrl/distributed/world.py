"""The world a run's processes form, as config and environment describe it (no jax): the ``JAXRL_*`` env contract,
``trainer.distributed.*``, :class:`WorldSpec`, :func:`resolve_world` and :func:`check_world`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from jaxrl.config.errors import ConfigError

ENV_COORDINATOR_ADDRESS = "JAXRL_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXRL_LOCAL_DEVICE_COUNT"
MODES: tuple[str, ...] = ("local", "env", "auto")  # = jaxrl.config.schema.DISTRIBUTED_MODE_CHOICES
LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")

_KEY = "trainer.distributed"


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
      needs); the vLLM engine is refused (its weight sync puts whole tensors on one device of process 0); the
      asynchronous pipeline (``async_training.staleness`` > 0) is refused.

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
    staleness = getattr(getattr(cfg, "async_training", None), "staleness", 0)
    if staleness:
        raise ConfigError(
            f"async_training.staleness={staleness} is not supported with {who}: generation runs on a thread of its "
            "own, and every process would have to agree on each collective's order between the two threads; use "
            "async_training.staleness=0 (synchronous), or one process")
