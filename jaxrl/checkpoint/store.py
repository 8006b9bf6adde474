"""The checkpoint store: listing, saving (asynchronous, atomic, free-space checked, keep-last-N) and closing;
reading is :mod:`jaxrl.checkpoint.restore`, moving aside :mod:`jaxrl.checkpoint.corrupt`."""

from __future__ import annotations

import errno as _errno
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxrl import distributed
from jaxrl.checkpoint.corrupt import SetAsideMixin
from jaxrl.checkpoint.errors import CheckpointSaveError, _find_errno, _short
from jaxrl.checkpoint.layout import (
    _TMP_MARK,
    META_ITEM,
    STEP_PREFIX,
    TOKENIZER_DIRNAME,
    _check_arrays,
    _check_json,
    _complete_steps,
    _fmt_bytes,
    _item,
    required_bytes,
    step_dir,
)
from jaxrl.checkpoint.restore import RestoreMixin
from jaxrl.host_memory import release_free_memory

log = logging.getLogger("jaxrl.checkpoint")  # one logger for the package (tests and users filter on it)


class CheckpointStore(RestoreMixin, SetAsideMixin):
    """Training checkpoints of one run in ``directory`` (layout in :mod:`jaxrl.checkpoint`'s docstring).

    Args:
      directory: the run's checkpoint root (created unless ``read_only``).
      max_to_keep: keep only the newest N complete steps (older ones are deleted after a newer one is
        complete); None keeps all. Must be None or >= 1 (see :func:`max_to_keep_from_config` for verl's 0).
      async_save: write in a background thread; :meth:`save` returns once the arrays are copied to host memory,
        so the caller may update (even donate) its device buffers right away.
      read_only: open an existing root for restoring only (no tmp cleanup, no writes, nothing moved aside).
      check_free_space: refuse a save when the filesystem has less free space than :func:`required_bytes`.

    Raises:
      ValueError: a bad ``max_to_keep``.
      FileNotFoundError: ``read_only`` and ``directory`` does not exist.

    Several processes (:mod:`jaxrl.distributed`) share one store in one directory: every process writes its
    shards of each save (orbax), while what a save or a resume decides from the folder's listing (which steps
    exist, the free space, which folders to move aside) is decided by the primary for all.

    Saving never mutates the arrays it is given, so a failed save leaves the in-memory training state as it
    was; the caller may log the error and continue or stop. Each save is attempted on its own: the failure of
    an earlier asynchronous save is logged and kept in :attr:`save_errors` (``{step: CheckpointSaveError}``),
    not raised into the next save.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None, async_save: bool = True,
                 read_only: bool = False, check_free_space: bool = True):
        import orbax.checkpoint as ocp

        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} is invalid; expected None (keep all) or an int >= 1")
        self.directory = Path(directory).expanduser().absolute()
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self.read_only = bool(read_only)
        self.check_free_space = bool(check_free_space)
        self.save_errors: dict[int, CheckpointSaveError] = {}
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        options = ocp.CheckpointManagerOptions(
            step_prefix=STEP_PREFIX,
            enable_async_checkpointing=self.async_save,
            preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
            # once a save is finalized its writer threads' host copy of the arrays is freed: hand it back to the OS
            # at once (jaxrl.host_memory; glibc would otherwise keep it resident, about the state's size per save).
            # wait() hands it back again once the save is complete (and is what does it for a synchronous save).
            async_options=(ocp.AsyncOptions(post_finalization_callback=release_free_memory) if self.async_save
                           else None),
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options)
        self._pending: int | None = None  # step of the async save in flight
        self._closed = False

    # -- listing ---------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Complete (finalized) checkpoint steps on disk, ascending; saves in progress are not included."""
        return _complete_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        s = self.steps()
        return s[-1] if s else None

    def step_path(self, step: int) -> Path:
        """``<directory>/global_step_<step>``."""
        return step_dir(self.directory, step)

    # -- saving ----------------------------------------------------------------------------------------

    def save(self, step: int, *, arrays: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any],
             wait: bool = False) -> bool:
        """Write checkpoint ``step`` (asynchronously unless the store was built with ``async_save=False``).

        Args:
          step: the RL step (int >= 0); the folder is ``global_step_<step>``.
          arrays: ``{role: {part: pytree}}``, e.g. ``{"actor": {"params": nnx.State, "opt_state": optax
            state}, "critic": {...}}``; leaves are ``jax.Array`` (any sharding) or numpy arrays. Role and part
            names match ``[A-Za-z][A-Za-z0-9_]*``.
          meta: a JSON-serialisable dict (str keys; tuples come back as lists). ``meta["model"]`` from
            :func:`model_meta` is what :mod:`jaxrl.export` needs.
          wait: block until this save is complete (and raise its error here).

        The previous asynchronous save is awaited first; if it failed, its error is logged and recorded in
        :attr:`save_errors` and this save is attempted anyway.

        Returns:
          True when a save was started; False when ``step`` is already a complete checkpoint here (nothing is
          written; a warning is logged).

        Raises:
          TypeError / ValueError: malformed ``arrays`` or ``meta`` (nothing is written).
          CheckpointSaveError: this save cannot be made: the filesystem has less free space than it needs
            (nothing is written; the message gives both sizes), writing failed (a full disk, permissions, ...;
            with ``async_save`` a write error surfaces at :meth:`wait` or is recorded at the next save), or
            ``step`` is older than the newest complete step (saving it would interleave two runs' checkpoints
            and ``max_to_keep`` would prune the new one). Earlier complete checkpoints are left intact, the failed
            step's temporary folder is removed, and the arrays passed in are untouched.
        """
        import orbax.checkpoint as ocp

        if self.read_only:
            raise CheckpointSaveError(f"checkpoint store {str(self.directory)!r} is read-only", step=step,
                                      directory=self.directory)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        _check_arrays(arrays, "arrays")
        if not isinstance(meta, Mapping):
            raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
        _check_json(meta, "meta")
        self.settle()  # the previous async save: a failure is logged and recorded, never raised into this one
        # decided once (several processes: by the primary, for all; the save itself is collective)
        if not distributed.run_on_primary(self._may_save, step, arrays, meta):
            return False
        items = {_item(r, p): ocp.args.StandardSave(tree) for r, parts in arrays.items() for p, tree in parts.items()}
        items[META_ITEM] = ocp.args.JsonSave(dict(meta))
        try:
            self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - any failure of the write is reported as a save error
            raise self._save_failed(step, e) from e
        self._pending = step
        if wait or not self.async_save:
            self.wait()
        return True

    def wait(self) -> None:
        """Block until the pending asynchronous save (if any) is complete.

        Raises:
          CheckpointSaveError: that save failed (see :meth:`save`; also recorded in :attr:`save_errors`).
        """
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(step, e) from e
        finally:
            # the save's host copy is freed by now: hand it back (an asynchronous save's finalization callback did
            # so too, but orbax's writer thread may drop its last references just after that callback runs)
            release_free_memory()

    @property
    def pending(self) -> int | None:
        """The step of the asynchronous save still in flight (not yet awaited), or None."""
        return self._pending

    def settle(self) -> None:
        """:meth:`wait` whose failure is only logged and recorded in :attr:`save_errors` (by :meth:`_save_failed`),
        never raised: what the trainer calls before its update, so a save still writing in the background never
        holds its host copy of the state while the update's temporaries are allocated."""
        try:
            self.wait()
        except CheckpointSaveError:
            pass

    def _may_save(self, step: int, arrays, meta) -> bool:
        """Whether ``step`` is to be written: False when it is complete already (logged); raises
        CheckpointSaveError when a newer step exists or the free space is short (see :meth:`save`)."""
        existing = self.steps()
        if step in existing:
            log.warning("checkpoint %s already exists and is complete; not saving it again", self.step_path(step))
            return False
        if existing and step < existing[-1]:
            raise CheckpointSaveError(
                f"cannot save step {step} into {str(self.directory)!r}: it already holds a newer checkpoint "
                f"(step {existing[-1]}). Move the newer global_step_* folders away or save to a new directory.",
                step=step, directory=self.directory,
            )
        self._check_space(step, arrays, meta)
        return True

    def _check_space(self, step: int, arrays, meta) -> None:
        """Refuse the save of ``step`` when the filesystem has less free space than it needs."""
        if not self.check_free_space:
            return
        need = required_bytes(arrays, meta)
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError as e:
            log.warning("cannot read the free space of %s (%s); saving step %d anyway", self.directory, e, step)
            return
        if free >= need:
            return
        reason = (f"it needs about {_fmt_bytes(need)} in {str(self.directory)!r} but only {_fmt_bytes(free)} "
                  "is free")
        msg = (f"checkpoint step {step} not saved: {reason}; free space there (or keep fewer checkpoints: "
               f"trainer.max_actor_ckpt_to_keep); earlier checkpoints are intact: steps {self.steps()}")
        err = CheckpointSaveError(msg, step=step, directory=self.directory, reason=reason,
                                  cause=OSError(_errno.ENOSPC, "not enough free space for the checkpoint"))
        self.save_errors[step] = err
        raise err

    def _save_failed(self, step: int, exc: BaseException) -> CheckpointSaveError:
        """Clean up after a failed save of ``step`` and build the error to raise."""
        for tmp in self.directory.glob(f"{STEP_PREFIX}_{step}{_TMP_MARK}*"):
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a partial write took
        try:
            self._mgr.reload()  # orbax's step list forgot pruned-but-not-deleted steps; re-read the disk
        except Exception as e:  # noqa: BLE001
            log.warning("could not re-read checkpoint list of %s: %s", self.directory, _short(e))
        complete = step in self.steps()
        hint = ""
        if _find_errno(exc) == _errno.ENOSPC:
            hint = " (the disk is full: free space or lower trainer.max_actor_ckpt_to_keep)"
        state = ("the step folder is complete but its post-save cleanup failed" if complete
                 else "no partial checkpoint was kept")
        msg = (f"saving checkpoint step {step} to {str(self.directory)!r} failed: {_short(exc)}{hint}; {state}; "
               f"earlier checkpoints are intact: steps {self.steps()}")
        log.error(msg)
        err = CheckpointSaveError(msg, step=step, directory=self.directory, cause=exc,
                                  reason=f"{_short(exc)}{hint}")
        self.save_errors[step] = err
        return err

    def save_tokenizer(self, tokenizer) -> Path:
        """Write ``tokenizer.save_pretrained`` to ``<directory>/tokenizer`` once per run (atomically).

        Returns the folder. Does nothing when it already holds files.

        Raises:
          CheckpointSaveError: the write failed (the partial folder is removed).
        """
        target = self.directory / TOKENIZER_DIRNAME
        if target.is_dir() and any(target.iterdir()):
            return target
        tmp = self.directory / f".{TOKENIZER_DIRNAME}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            tokenizer.save_pretrained(str(tmp))
            if target.is_dir():
                target.rmdir()  # empty (checked above)
            os.replace(tmp, target)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(
                f"saving the tokenizer to {str(target)!r} failed: {_short(e)}", step=None, directory=self.directory,
                cause=e,
            ) from e
        return target

    def tokenizer_path(self) -> Path | None:
        """``<directory>/tokenizer`` when it was saved, else None."""
        target = self.directory / TOKENIZER_DIRNAME
        return target if target.is_dir() and any(target.iterdir()) else None

    # -- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the pending save and release orbax's threads (idempotent).

        Never raises: a failed pending save is logged and recorded in :attr:`save_errors` (call :meth:`wait`
        first to get it raised). Closing also ends orbax's background cleanup of interrupted saves, which would
        otherwise print a traceback when the interpreter exits under it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.settle()
        finally:
            try:
                self._mgr.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the checkpoint manager of %s failed: %s", self.directory, _short(e))

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
