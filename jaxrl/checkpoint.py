"""Checkpoint store: asynchronous, atomic training checkpoints on top of ``orbax.checkpoint``.

On-disk layout (verl's ``global_step_{N}`` folders under ``trainer.default_local_dir``)::

    <directory>/                         the run's checkpoint root
      tokenizer/                         written once per run (save_pretrained), read by jaxrl.export
      global_step_10/                    one complete checkpoint (orbax CheckpointManager step folder)
        actor.params/  actor.opt_state/  one orbax item (StandardSave pytree, OCDBT) per role/part
        critic.params/ critic.opt_state/ (present only when the run has a critic)
        meta/metadata                    JSON: step, data_state, rng, kl_ctrl, num_updates, model, fingerprint
        _CHECKPOINT_METADATA, commit_success.txt   orbax bookkeeping
      global_step_20.orbax-checkpoint-tmp-<ts>/    a save in progress or interrupted: never listed;
                                                   a writable store removes it before its first save
      global_step_8.corrupt-<ts>/                  a checkpoint found unreadable on resume, moved aside (kept)
      global_step_12.superseded-<ts>/              a checkpoint of an abandoned trajectory (a fresh start or a
                                                   resume from an older step), moved aside (kept)

Atomicity is orbax's: each step is written into a ``<name>.orbax-checkpoint-tmp-<ts>`` folder and renamed to
``global_step_<N>`` only after every item (arrays and the JSON meta) has been written, so a killed process
never leaves a folder that :meth:`CheckpointStore.steps` reports as complete; a failed save removes its
temporary folder at once. Pruning (``max_to_keep``) deletes old steps only after the new one is complete.
Folders moved aside keep their step in the name but never match ``global_step_<N>``: they are not listed,
not resumed from, not pruned and never deleted by the store.

Failures: every save is attempted on its own. Before writing, :meth:`CheckpointStore.save` checks the free space
on the checkpoint filesystem against the bytes the save needs (:func:`required_bytes`) and refuses a save that
cannot fit, naming both numbers; an asynchronous save's failure is logged and recorded
(:attr:`CheckpointStore.save_errors`) when the next save starts, never raised into it. On resume a checkpoint
whose meta or arrays cannot be read is moved aside and the previous one is used; a checkpoint that is readable
but was written by an incompatible configuration (:class:`CheckpointIncompatibleError`) is never moved.

Scope: a single process (one host). Corruption detection covers unreadable/truncated/missing files and bad
metadata, not silent bit flips inside array data (there are no per-array checksums).
"""

from __future__ import annotations

import errno as _errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxrl.checkpoint")

STEP_PREFIX = "global_step"
TOKENIZER_DIRNAME = "tokenizer"
META_ITEM = "meta"
RESUME_MODES: tuple[str, ...] = ("auto", "disable", "resume_path")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_STEP_DIR_RE = re.compile(rf"^{STEP_PREFIX}_(0|[1-9]\d*)$")
_TMP_MARK = ".orbax-checkpoint-tmp"

__all__ = [
    "RESUME_MODES",
    "STEP_PREFIX",
    "TOKENIZER_DIRNAME",
    "CheckpointError",
    "CheckpointIncompatibleError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointStore",
    "find_resume_checkpoint",
    "max_to_keep_from_config",
    "model_meta",
    "parse_step_dir",
    "required_bytes",
    "step_dir",
]


class CheckpointError(RuntimeError):
    """Base class of checkpoint store errors."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (e.g. a full disk: ``OSError`` ENOSPC is the ``__cause__``).

    Attributes:
      step: the step whose save failed (None for the run's tokenizer).
      directory: the checkpoint root.
      errno: the ``errno`` of the underlying ``OSError``, if there was one.
      reason: the cause in a few words (e.g. "it needs about 4.2 MiB ... but only 2.6 MiB is free").
    """

    def __init__(self, message: str, *, step: int | None, directory: Path, cause: BaseException | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.step = step
        self.directory = directory
        self.errno = _find_errno(cause)
        self.reason = reason or message


class CheckpointRestoreError(CheckpointError):
    """No checkpoint could be restored; the message names the directory and every step tried."""


class _CheckFailed(Exception):
    """Internal: the caller's ``check`` raised something else than CheckpointIncompatibleError (its cause)."""


class CheckpointIncompatibleError(CheckpointError):
    """A readable checkpoint that this run cannot restore: it was written by another configuration.

    Never a sign of corruption: the checkpoint is left where it is.

    Attributes:
      step: the checkpoint's step.
      path: its folder (filled in by :meth:`CheckpointStore.restore` for an error raised by a ``check`` callback).
      differences: what changed, one ``key: old -> new`` per entry (see :func:`jaxrl.fingerprint.differences`).
    """

    def __init__(self, message: str, *, step: int, path: Path | None, differences: list[str]):
        super().__init__(message)
        self.step = step
        self.path = path
        self.differences = list(differences)


_OS_ERROR_CODE_RE = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports errno (e.g. 28 = ENOSPC)


def _find_errno(exc: BaseException | None) -> int | None:
    """The errno behind ``exc``: an ``OSError`` in its cause chain, or tensorstore's ``os_error_code``."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        m = _OS_ERROR_CODE_RE.search(str(exc))
        if m:
            return int(m.group(1))
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _short(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line; a long message keeps its head and tail (where the OS error usually is)."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit // 2] + " ... " + text[-limit // 2 :]
    return f"{type(exc).__name__}: {text}"


# --------------------------------------------------------------------------------------------- layout


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """The folder of checkpoint ``step`` under the run root ``directory``: ``<directory>/global_step_<step>``."""
    return Path(directory).expanduser() / f"{STEP_PREFIX}_{int(step)}"


def parse_step_dir(path: str | os.PathLike) -> int | None:
    """The step number of a ``.../global_step_<N>`` folder name, or None for any other name."""
    m = _STEP_DIR_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _complete_steps(directory: Path) -> list[int]:
    """Steps under ``directory`` whose folders orbax considers finalized (tmp folders excluded), ascending."""
    if not directory.is_dir():
        return []
    import orbax.checkpoint as ocp

    fmt = ocp.path.step.standard_name_format(step_prefix=STEP_PREFIX)
    return sorted(m.step for m in fmt.find_all(directory))


def latest_complete_step(directory: str | os.PathLike) -> int | None:
    """The newest step under the run root ``directory`` whose save finished (orbax-finalized), or None."""
    steps = _complete_steps(Path(directory).expanduser())
    return steps[-1] if steps else None


# --------------------------------------------------------------------------------------------- helpers


def model_meta(model_cfg, *, path: str, param_dtype: str) -> dict:
    """The ``meta["model"]`` entry :mod:`jaxrl.export` needs to rebuild the policy without the original files.

    Args:
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig`.
      path: the model spec the run was started from (``actor_rollout_ref.model.path``); the export falls back
        to its tokenizer when the checkpoint root has no ``tokenizer/``.
      param_dtype: the stored parameter dtype name (``"float32"`` / ``"bfloat16"``).

    Returns:
      ``{"hf_config": model_cfg.to_hf_config(), "path": path, "param_dtype": param_dtype}`` (JSON-serialisable).
    """
    return {"hf_config": model_cfg.to_hf_config(), "path": str(path), "param_dtype": str(param_dtype)}


def max_to_keep_from_config(max_actor_ckpt_to_keep: int | None, max_critic_ckpt_to_keep: int | None, *,
                            has_critic: bool) -> int | None:
    """One store limit from verl's ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``.

    verl treats None and 0 as "keep all". Actor and critic live in the same step folder here, and a step is
    resumable only with both, so the store keeps the larger of the two limits (all, if either keeps all).
    Without a critic only the actor's limit counts.
    """
    def norm(v):
        return None if v in (None, 0) else int(v)

    actor = norm(max_actor_ckpt_to_keep)
    if not has_critic:
        return actor
    critic = norm(max_critic_ckpt_to_keep)
    if actor is None or critic is None:
        return None
    return max(actor, critic)


def _check_json(obj: Any, where: str) -> None:
    """Raise TypeError naming the first value of ``obj`` that does not round-trip through JSON exactly."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return
    if isinstance(obj, float):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint meta key {where}[{k!r}] must be a str (JSON object keys are strings)")
            _check_json(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"checkpoint meta value {where} = {obj!r} ({type(obj).__name__}) is not JSON-serialisable; convert it "
        "to str/int/float/bool/None/list/dict (numpy scalars: .item())"
    )


def _check_arrays(arrays: Any, what: str) -> None:
    if not isinstance(arrays, Mapping) or not arrays:
        raise TypeError(f"{what} must be a non-empty dict {{role: {{part: pytree}}}}, got {type(arrays).__name__}")
    for role, parts in arrays.items():
        if not (isinstance(role, str) and _NAME_RE.match(role)):
            raise ValueError(f"{what}: role name {role!r} must match {_NAME_RE.pattern} (e.g. 'actor')")
        if not isinstance(parts, Mapping) or not parts:
            raise TypeError(f"{what}[{role!r}] must be a non-empty dict {{part: pytree}}, got {type(parts).__name__}")
        for part in parts:
            if not (isinstance(part, str) and _NAME_RE.match(part)):
                raise ValueError(f"{what}[{role!r}]: part name {part!r} must match {_NAME_RE.pattern}")


_MIB = 1 << 20


def required_bytes(arrays: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> int:
    """Bytes a checkpoint of ``arrays`` (+ ``meta``) needs on disk, as used by the free-space check.

    The arrays' ``nbytes`` (global shapes: every array is written once, whatever its sharding) plus 5% and
    1 MiB for orbax's per-array metadata, indexes and filesystem blocks, plus the JSON meta.
    """
    import jax

    data = sum(int(getattr(x, "nbytes", 0)) for parts in arrays.values() for tree in parts.values()
               for x in jax.tree.leaves(tree))
    meta_bytes = len(json.dumps(meta)) if meta is not None else 0
    return data + data // 20 + _MIB + meta_bytes


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def _item(role: str, part: str) -> str:
    return f"{role}.{part}"


def _abstract_tree(tree: Any, default_sharding) -> Any:
    """Restore targets: ``jax.ShapeDtypeStruct`` leaves carrying a sharding (``default_sharding`` if none)."""
    import jax
    import numpy as np

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if x.sharding is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default_sharding)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=default_sharding)
        return x

    return jax.tree.map(leaf, tree)


# --------------------------------------------------------------------------------------------- the store


class CheckpointStore:
    """Training checkpoints of one run in ``directory`` (layout in the module docstring).

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
        self._settle()  # the previous async save: a failure is logged and recorded, never raised into this one
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

    def _settle(self) -> None:
        """:meth:`wait` whose failure is only logged and recorded (by :meth:`_save_failed`)."""
        try:
            self.wait()
        except CheckpointSaveError:
            pass

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

    # -- restoring -------------------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict:
        """The JSON meta of complete checkpoint ``step``.

        Raises:
          CheckpointRestoreError: ``step`` is not a complete checkpoint here, or its meta is unreadable.
        """
        self._require_step(step)
        try:
            return self._read_meta(step)
        except Exception as e:  # noqa: BLE001
            raise CheckpointRestoreError(f"cannot read the meta of {str(self.step_path(step))!r}: {_short(e)}") from e

    def _read_meta(self, step: int) -> dict:
        import orbax.checkpoint as ocp

        meta = self._mgr.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, not a JSON object")
        if "step" in meta and meta["step"] != step:
            raise ValueError(f"meta says step {meta['step']!r} but the folder is step {step}")
        return meta

    def _require_step(self, step: int) -> None:
        steps = self.steps()
        if step not in steps:
            tmp = list(self.directory.glob(f"{STEP_PREFIX}_{step}{_TMP_MARK}*"))
            why = " (only an interrupted, incomplete save of it exists)" if tmp else ""
            raise CheckpointRestoreError(
                f"no complete checkpoint for step {step} in {str(self.directory)!r}{why}; complete steps: {steps}"
            )

    def restore(self, step: int | None = None, *,
                like: Mapping[str, Mapping[str, Any]] | Callable[[dict], Mapping[str, Mapping[str, Any]]],
                check: Callable[[int, dict], None] | None = None,
                ) -> tuple[int, dict, dict]:
        """Restore arrays and meta.

        Each candidate goes through: read its meta -> ``check(step, meta)`` -> compare the array shapes/dtypes
        orbax stored with ``like``'s -> read the arrays. Only the meta and orbax's small metadata files are read
        before a checkpoint is known to fit.

        Args:
          step: the step to restore; None = the newest complete step, falling back to older ones while a
            checkpoint is corrupt or partial (unreadable or missing files, bad meta). In a writable store such a
            checkpoint is moved aside to ``global_step_<N>.corrupt-<timestamp>`` (kept, logged with the reason),
            so the run writes a fresh ``global_step_<N>`` when it gets there again; a read-only store only skips
            it (with a warning).
          like: the restore target ``{role: {part: pytree}}``, a subset of what was saved (e.g. only
            ``{"actor": {"params": ...}}``). Leaves are live ``jax.Array`` (their shape/dtype/sharding are used)
            or ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape`` / ``nnx.eval_shape``; without a sharding they
            land on ``jax.devices()[0]``). The restored trees have ``like``'s structure (``nnx.State``, optax
            NamedTuples) and dtypes. May be a callable ``meta -> like`` to build the target from the meta.
          check: called with each candidate's step and meta before any array is read; raises
            :class:`CheckpointIncompatibleError` when the checkpoint does not fit the caller (e.g. another
            model). Any other exception it raises propagates unchanged.

        Returns:
          ``(step, arrays, meta)``: arrays in ``like``'s layout, meta the saved JSON dict.

        Raises:
          CheckpointIncompatibleError: the checkpoint is readable but does not fit (``check``, or array
            shapes/dtypes/structure differing from ``like``'s). It is not moved, and older steps are not tried.
          CheckpointRestoreError: the given ``step`` is missing or unreadable; or, with ``step=None``, no
            checkpoint is restorable (the message names the directory, each step tried with its error, and
            where unreadable ones were moved).
        """
        self._settle()
        if step is not None:
            self._require_step(step)
            try:
                return step, *self._restore_one(step, like, check)
            except CheckpointIncompatibleError:
                raise
            except _CheckFailed as e:
                raise e.__cause__ from None
            except Exception as e:  # noqa: BLE001
                raise CheckpointRestoreError(
                    f"cannot restore checkpoint {str(self.step_path(step))!r}: {_short(e)}"
                ) from e
        candidates = sorted(self.steps(), reverse=True)
        if not candidates:
            raise CheckpointRestoreError(f"no complete checkpoint (global_step_* folder) in {str(self.directory)!r}")
        tried: list[str] = []
        for s in candidates:
            try:
                arrays, meta = self._restore_one(s, like, check)
            except CheckpointIncompatibleError:
                raise
            except _CheckFailed as e:
                raise e.__cause__ from None
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                moved = self._set_aside_corrupt(s, e)
                tried.append(f"step {s}: {_short(e, 200)}" + (f" (moved to {moved.name})" if moved else ""))
                continue
            if tried:
                log.warning("restored checkpoint step %d after skipping %d unreadable newer one(s)", s, len(tried))
            return s, arrays, meta
        raise CheckpointRestoreError(
            f"no restorable checkpoint in {str(self.directory)!r}; tried newest first: " + "; ".join(tried)
        )

    def _restore_one(self, step: int, like, check) -> tuple[dict, dict]:
        import jax
        import orbax.checkpoint as ocp

        meta = self._read_meta(step)
        if check is not None:
            try:
                check(step, meta)
            except CheckpointIncompatibleError as e:
                e.step, e.path = step, self.step_path(step)
                raise
            except Exception as e:  # noqa: BLE001 - a failing check is the caller's error, not a corrupt checkpoint
                raise _CheckFailed() from e
        target = like(meta) if callable(like) else like
        _check_arrays(target, "like")
        missing = [_item(r, p) for r, parts in target.items() for p in parts
                   if not (self.step_path(step) / _item(r, p)).is_dir()]
        if missing:
            raise FileNotFoundError(f"items {missing} are not in {str(self.step_path(step))!r}")
        self._check_structure(step, target)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        items = {
            _item(r, p): ocp.args.StandardRestore(_abstract_tree(tree, default))
            for r, parts in target.items() for p, tree in parts.items()
        }
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        arrays = {r: {p: out[_item(r, p)] for p in parts} for r, parts in target.items()}
        return arrays, meta

    def array_signatures(self, step: int, items: list[str] | None = None) -> dict[str, dict[str, str]]:
        """``{"<role>.<part>": {leaf path: "dtype[shape]"}}`` of checkpoint ``step``, from orbax's metadata files.

        Reads no array data. ``items`` defaults to every array item in the step folder.

        Raises:
          OSError / ValueError: a metadata file is missing or unreadable (the checkpoint is corrupt).
        """
        import orbax.checkpoint as ocp
        from etils import epath

        from jaxrl.fingerprint import tree_signature

        folder = self.step_path(step)
        if items is None:
            items = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != META_ITEM)
        handler = ocp.StandardCheckpointHandler()
        try:
            return {name: tree_signature(handler.metadata(epath.Path(folder / name)).tree) for name in items}
        finally:
            close = getattr(handler, "close", None)
            if close is not None:
                close()

    def _check_structure(self, step: int, target) -> None:
        """Raise :class:`CheckpointIncompatibleError` when ``target``'s arrays differ from what step holds."""
        from jaxrl.fingerprint import array_differences, summary, tree_signature

        want = {_item(r, p): tree_signature(tree) for r, parts in target.items() for p, tree in parts.items()}
        saved = self.array_signatures(step, list(want))  # unreadable metadata: corrupt (raised as is)
        diffs = array_differences(saved, want)
        if diffs:
            raise CheckpointIncompatibleError(
                f"checkpoint {str(self.step_path(step))!r} holds arrays of other shapes/dtypes than this run's: "
                f"{summary(diffs)}", step=step, path=self.step_path(step), differences=diffs)

    # -- moving checkpoints aside ------------------------------------------------------------------------

    def move_aside(self, step: int, tag: str) -> Path:
        """Rename complete checkpoint ``step`` to ``global_step_<N>.<tag>-<timestamp>`` (kept, no longer listed).

        Raises:
          CheckpointError: the store is read-only.
          OSError: the rename failed.
        """
        if self.read_only:
            raise CheckpointError(f"checkpoint store {str(self.directory)!r} is read-only")
        src = self.step_path(step)
        dst = src.with_name(f"{src.name}.{tag}-{_stamp()}")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{src.name}.{tag}-{_stamp()}-{n}")
        os.rename(src, dst)
        try:
            self._mgr.reload()  # orbax's cached step list still names the moved step
        except Exception as e:  # noqa: BLE001
            log.warning("could not re-read checkpoint list of %s: %s", self.directory, _short(e))
        return dst

    def _set_aside_corrupt(self, step: int, exc: BaseException) -> Path | None:
        """Move an unreadable checkpoint aside (writable store) or only skip it (read-only); log either way."""
        why = _short(exc, 300)
        if self.read_only:
            log.warning("checkpoint %s is corrupt or partial and is skipped (%s); trying the previous one",
                        self.step_path(step), why)
            return None
        try:
            dst = self.move_aside(step, "corrupt")
        except OSError as e:
            log.warning("checkpoint %s is corrupt or partial (%s) and is skipped; moving it aside failed (%s); "
                        "trying the previous one", self.step_path(step), why, _short(e))
            return None
        log.warning("checkpoint %s is corrupt or partial (%s); moved it aside to %s (kept for inspection, delete "
                    "it when no longer needed); trying the previous one", self.step_path(step), why, dst)
        return dst

    def supersede_after(self, step: int | None) -> list[Path]:
        """Move every complete checkpoint newer than ``step`` (all of them for None) aside as ``.superseded-<ts>``.

        For a run that continues from ``step`` (None: a fresh start) in a folder that holds checkpoints of another
        trajectory: without this, its own saves of those steps would be refused as "already complete" and a
        later resume would pick the old trajectory's checkpoint. Returns the new paths (logged).
        """
        moved = []
        for s in self.steps():
            if step is None or s > step:
                dst = self.move_aside(s, "superseded")
                moved.append(dst)
        if moved:
            log.warning("moved %d checkpoint(s) of an earlier run aside (%s) so this run can write its own; they are "
                        "kept: delete them when no longer needed", len(moved), ", ".join(p.name for p in moved))
        return moved

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
            self._settle()
        finally:
            try:
                self._mgr.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the checkpoint manager of %s failed: %s", self.directory, _short(e))

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- resume


def find_resume_checkpoint(resume_mode: str, default_dir: str | os.PathLike,
                           resume_from_path: str | os.PathLike | None) -> tuple[Path, int | None] | None:
    """Where to resume from, with verl's ``trainer.resume_mode`` semantics.

    Args:
      resume_mode: ``"disable"``: start fresh. ``"auto"``: resume from ``default_dir`` if it holds a complete
        checkpoint, else start fresh. ``"resume_path"``: resume from ``resume_from_path``, which must exist:
        a run root (its newest restorable step is used) or one step folder ``<root>/global_step_<N>``.
      default_dir: the run's checkpoint root (``trainer.default_local_dir``).
      resume_from_path: the path for ``resume_path`` (ignored otherwise, as in verl).

    Returns:
      None to start fresh, else ``(root, step)``: open ``CheckpointStore(root, ...)`` and call
      ``restore(step, like=...)``. ``step`` is None for "the newest restorable checkpoint" (restore then falls
      back past corrupt ones) and an int when a step folder was named.

    Raises:
      ValueError: an unknown ``resume_mode``, or ``resume_path`` without ``resume_from_path``.
      FileNotFoundError: ``resume_from_path`` does not exist, is an interrupted (incomplete) save, or holds no
        complete checkpoint (the message names the path and the layout expected).
    """
    if resume_mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={resume_mode!r} is invalid; expected one of {list(RESUME_MODES)}")
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        root = Path(default_dir).expanduser().absolute()
        if _complete_steps(root):
            return root, None
        if root.is_dir() and any(_TMP_MARK in p.name for p in root.iterdir()):
            log.warning("%s holds only incomplete (interrupted) checkpoints; starting fresh", root)
        return None
    if resume_from_path is None or not str(resume_from_path).strip():
        raise ValueError("trainer.resume_mode='resume_path' requires trainer.resume_from_path (a run's checkpoint "
                         f"directory or one of its {STEP_PREFIX}_<N> folders)")
    path = Path(resume_from_path).expanduser().absolute()
    layout = f"a run's checkpoint directory holding {STEP_PREFIX}_<N> folders, or one such folder"
    if _TMP_MARK in path.name:
        raise FileNotFoundError(f"trainer.resume_from_path={str(path)!r} is an interrupted, incomplete save; "
                                f"expected {layout}")
    if not path.is_dir():
        raise FileNotFoundError(f"trainer.resume_from_path={str(path)!r} does not exist; expected {layout}")
    step = parse_step_dir(path)
    if step is not None:
        if step not in _complete_steps(path.parent):
            raise FileNotFoundError(f"trainer.resume_from_path={str(path)!r} is not a complete checkpoint "
                                    "(no orbax commit marker)")
        return path.parent, step
    if not _complete_steps(path):
        raise FileNotFoundError(f"trainer.resume_from_path={str(path)!r} holds no complete checkpoint; "
                                f"expected {layout}")
    return path, None

