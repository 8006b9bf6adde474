"""Decisions made once for the whole world: :func:`run_on_primary`, :func:`any_process` / :func:`all_processes`,
:func:`barrier`, the per-step replica check and the shared-run-folder check. Each is a collective (every process
calls it at the same point) and a plain local operation with one process."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxrl.config.errors import ConfigError
from jaxrl.distributed.process import is_primary, process_count
from jaxrl.distributed.world import DistributedError, ReplicaDivergenceError

_MIN_BROADCAST_BYTES = 1024  # payload buckets: powers of two from 1 KiB, so a handful of programs compile


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
