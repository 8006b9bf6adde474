"""Reading checkpoints: the meta, the fit check (the caller's fingerprint, then orbax's array metadata), the
arrays; with ``step=None`` the newest restorable step, unreadable ones set aside (:mod:`jaxrl.checkpoint.corrupt`).

:class:`RestoreMixin` holds these methods of :class:`jaxrl.checkpoint.CheckpointStore`; it relies on the store's
``directory``, ``_mgr`` (the orbax ``CheckpointManager``), ``steps()``, ``step_path()``, ``settle()`` and
``_set_aside_corrupt()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl import distributed
from jaxrl.checkpoint.errors import (
    CheckpointIncompatibleError,
    CheckpointRestoreError,
    _CheckFailed,
    _short,
)
from jaxrl.checkpoint.layout import _TMP_MARK, META_ITEM, STEP_PREFIX, _check_arrays, _item

log = logging.getLogger("jaxrl.checkpoint")  # one logger for the package (tests and users filter on it)


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


class RestoreMixin:
    """The reading half of :class:`jaxrl.checkpoint.CheckpointStore` (see the module docstring)."""

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
        self.settle()
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
        candidates = sorted(distributed.run_on_primary(self.steps), reverse=True)  # one listing for all processes
        if not candidates:
            raise CheckpointRestoreError(f"no complete checkpoint (global_step_* folder) in {str(self.directory)!r}")
        tried: list[str] = []
        for s in candidates:
            error = None
            try:
                arrays, meta = self._restore_one(s, like, check)
            except CheckpointIncompatibleError:
                raise
            except _CheckFailed as e:
                raise e.__cause__ from None
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                error = e
            if not distributed.all_processes(error is None):  # unreadable on any process: skipped by all
                error = error or CheckpointRestoreError(f"step {s} could not be read on another process")
                moved = self._set_aside_corrupt(s, error)
                tried.append(f"step {s}: {_short(error, 200)}" + (f" (moved to {moved.name})" if moved else ""))
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
