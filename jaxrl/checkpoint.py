"""Checkpoint store: asynchronous, atomic training checkpoints on top of ``orbax.checkpoint``.

On-disk layout (verl's ``global_step_{N}`` folders under ``trainer.default_local_dir``)::

    <directory>/                         the run's checkpoint root
      tokenizer/                         written once per run (save_pretrained), read by jaxrl.export
      global_step_10/                    one complete checkpoint (orbax CheckpointManager step folder)
        actor.params/  actor.opt_state/  one orbax item (StandardSave pytree, OCDBT) per role/part
        critic.params/ critic.opt_state/ (present only when the run has a critic)
        meta/metadata                    JSON: step, data_state, rng, kl_ctrl, num_updates, model, config
        _CHECKPOINT_METADATA, commit_success.txt   orbax bookkeeping
      global_step_20.orbax-checkpoint-tmp-<ts>/    a save in progress or interrupted: never listed;
                                                   a writable store removes it before its first save

Atomicity is orbax's: each step is written into a ``<name>.orbax-checkpoint-tmp-<ts>`` folder and renamed to
``global_step_<N>`` only after every item (arrays and the JSON meta) has been written, so a killed process
never leaves a folder that :meth:`CheckpointStore.steps` reports as complete. Pruning
(``max_to_keep``) deletes old steps only after the new one is complete.

Scope: a single process (one host). Corruption detection covers unreadable/truncated/missing files and bad
metadata, not silent bit flips inside array data (there are no per-array checksums).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import re
import shutil
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
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointStore",
    "find_resume_checkpoint",
    "max_to_keep_from_config",
    "model_meta",
    "parse_step_dir",
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
    """

    def __init__(self, message: str, *, step: int | None, directory: Path, cause: BaseException | None = None):
        super().__init__(message)
        self.step = step
        self.directory = directory
        self.errno = _find_errno(cause)


class CheckpointRestoreError(CheckpointError):
    """No checkpoint could be restored; the message names the directory and every step tried."""


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
      read_only: open an existing root for restoring only (no tmp cleanup, no writes).

    Raises:
      ValueError: a bad ``max_to_keep``.
      FileNotFoundError: ``read_only`` and ``directory`` does not exist.

    Saving never mutates the arrays it is given, so a failed save leaves the in-memory training state as it
    was; the caller may log the error and continue or stop.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None, async_save: bool = True,
                 read_only: bool = False):
        import orbax.checkpoint as ocp

        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} is invalid; expected None (keep all) or an int >= 1")
        self.directory = Path(directory).expanduser().absolute()
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self.read_only = bool(read_only)
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

        Returns:
          True when a save was started; False when ``step`` is already a complete checkpoint here (nothing is
          written; a warning is logged).

        Raises:
          TypeError / ValueError: malformed ``arrays`` or ``meta`` (nothing is written).
          CheckpointSaveError: writing failed (a full disk, permissions, ...), for this step or for the previous
            asynchronous save, whose error surfaces at the next :meth:`save` / :meth:`wait`; also when ``step``
            is older than the newest complete step (saving it would interleave two runs' checkpoints and
            ``max_to_keep`` would prune the new one). Earlier complete checkpoints are left intact, the failed
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
        self.wait()  # surfaces the previous async save's error under its own step
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
          CheckpointSaveError: that save failed (see :meth:`save`).
        """
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(step, e) from e

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
        return CheckpointSaveError(msg, step=step, directory=self.directory, cause=exc)

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
                ) -> tuple[int, dict, dict]:
        """Restore arrays and meta.

        Args:
          step: the step to restore; None = the newest complete step, falling back to older ones (with a
            warning naming each skipped folder) while a checkpoint is corrupt or partial (unreadable or missing
            files, bad meta).
          like: the restore target ``{role: {part: pytree}}``, a subset of what was saved (e.g. only
            ``{"actor": {"params": ...}}``). Leaves are live ``jax.Array`` (their shape/dtype/sharding are used)
            or ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape`` / ``nnx.eval_shape``; without a sharding they
            land on ``jax.devices()[0]``). The restored trees have ``like``'s structure (``nnx.State``, optax
            NamedTuples) and dtypes. May be a callable ``meta -> like`` to build the target from the meta.

        Returns:
          ``(step, arrays, meta)``: arrays in ``like``'s layout, meta the saved JSON dict.

        Raises:
          CheckpointRestoreError: the given ``step`` is missing or unreadable; or, with ``step=None``, no
            checkpoint is restorable (the message names the directory and each step tried with its error).
          CheckpointSaveError: a pending asynchronous save failed (it is awaited first).
        """
        self.wait()
        if step is not None:
            self._require_step(step)
            try:
                arrays, meta = self._restore_one(step, like)
            except Exception as e:  # noqa: BLE001
                raise CheckpointRestoreError(
                    f"cannot restore checkpoint {str(self.step_path(step))!r}: {_short(e)}"
                ) from e
            return step, arrays, meta
        candidates = sorted(self.steps(), reverse=True)
        if not candidates:
            raise CheckpointRestoreError(f"no complete checkpoint (global_step_* folder) in {str(self.directory)!r}")
        tried: list[str] = []
        for s in candidates:
            try:
                arrays, meta = self._restore_one(s, like)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                tried.append(f"step {s}: {_short(e, 200)}")
                log.warning("checkpoint %s is corrupt or partial and is skipped (%s); trying the previous one",
                            self.step_path(s), _short(e, 200))
                continue
            if tried:
                log.warning("restored checkpoint step %d after skipping %d unreadable newer one(s)", s, len(tried))
            return s, arrays, meta
        raise CheckpointRestoreError(
            f"no restorable checkpoint in {str(self.directory)!r}; tried newest first: " + "; ".join(tried)
        )

    def _restore_one(self, step: int, like) -> tuple[dict, dict]:
        import jax
        import orbax.checkpoint as ocp

        meta = self._read_meta(step)
        target = like(meta) if callable(like) else like
        _check_arrays(target, "like")
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        items = {
            _item(r, p): ocp.args.StandardRestore(_abstract_tree(tree, default))
            for r, parts in target.items() for p, tree in parts.items()
        }
        missing = [name for name in items if not (self.step_path(step) / name).is_dir()]
        if missing:
            raise FileNotFoundError(f"items {missing} are not in {str(self.step_path(step))!r}")
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        arrays = {r: {p: out[_item(r, p)] for p in parts} for r, parts in target.items()}
        return arrays, meta

    # -- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the pending save and release orbax's threads (raises like :meth:`wait`)."""
        try:
            self.wait()
        finally:
            self._mgr.close()

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

