"""Joining the world (:func:`initialize`), asking about it (:func:`process_count`, :func:`is_primary`, ...) and
leaving it at once when a process fails (:func:`run_guarded`, :func:`exit_now`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from jaxrl.config.errors import ConfigError
from jaxrl.distributed.world import _KEY, ENV_LOCAL_DEVICE_COUNT, DistributedError, WorldSpec, check_world, resolve_world

log = logging.getLogger("jaxrl")


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
