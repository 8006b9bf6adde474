"""Processes: the one package that knows a run may be several processes of one JAX world.

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

from jaxrl.distributed.agree import (all_processes, any_process, barrier, check_replicas, check_shared_dir,
                                     run_on_primary)
from jaxrl.distributed.process import (exit_now, initialize, is_primary, joined_processes, local_device_count,
                                       process_count, process_index, run_guarded)
from jaxrl.distributed.transfer import to_global, to_host
from jaxrl.distributed.world import (ENV_COORDINATOR_ADDRESS, ENV_LOCAL_DEVICE_COUNT, ENV_NUM_PROCESSES,
                                     ENV_PROCESS_ID, LOOPBACK_HOSTS, MODES, DistributedError, ReplicaDivergenceError,
                                     WorldSpec, check_world, resolve_world)

__all__ = [
    "ENV_COORDINATOR_ADDRESS", "ENV_LOCAL_DEVICE_COUNT", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "LOOPBACK_HOSTS",
    "MODES", "DistributedError", "ReplicaDivergenceError", "WorldSpec", "all_processes", "any_process", "barrier",
    "check_replicas", "check_shared_dir", "check_world", "exit_now", "initialize", "is_primary",
    "joined_processes", "local_device_count", "process_count", "process_index", "resolve_world", "run_guarded",
    "run_on_primary", "to_global", "to_host",
]
