"""Moving checkpoints aside: an unreadable one found on resume (``.corrupt-<ts>``) and those of an abandoned
trajectory (``.superseded-<ts>``). Moved folders are kept, never listed, resumed from, pruned or deleted.

:class:`SetAsideMixin` holds these methods of :class:`jaxrl.checkpoint.CheckpointStore`; it relies on the store's
``directory``, ``read_only``, ``_mgr``, ``steps()`` and ``step_path()``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from jaxrl import distributed
from jaxrl.checkpoint.errors import CheckpointError, _short
from jaxrl.checkpoint.layout import _stamp

log = logging.getLogger("jaxrl.checkpoint")  # one logger for the package (tests and users filter on it)


class SetAsideMixin:
    """Moving checkpoints of a :class:`jaxrl.checkpoint.CheckpointStore` aside (see the module docstring)."""

    def move_aside(self, step: int, tag: str) -> Path:
        """Rename complete checkpoint ``step`` to ``global_step_<N>.<tag>-<timestamp>`` (kept, no longer listed).

        Several processes: the primary renames, every process gets the new path (a collective).

        Raises:
          CheckpointError: the store is read-only.
          OSError: the rename failed.
        """
        if self.read_only:
            raise CheckpointError(f"checkpoint store {str(self.directory)!r} is read-only")
        dst = distributed.run_on_primary(self._rename_aside, step, tag)
        self._reload()
        return dst

    def _rename_aside(self, step: int, tag: str) -> Path:
        src = self.step_path(step)
        dst = src.with_name(f"{src.name}.{tag}-{_stamp()}")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{src.name}.{tag}-{_stamp()}-{n}")
        os.rename(src, dst)
        return dst

    def _reload(self) -> None:
        try:
            self._mgr.reload()  # orbax's cached step list still names the moved step
        except Exception as e:  # noqa: BLE001
            log.warning("could not re-read checkpoint list of %s: %s", self.directory, _short(e))

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
        moved = distributed.run_on_primary(self._supersede, step)  # the primary lists and renames, for all
        if moved:
            self._reload()
            log.warning("moved %d checkpoint(s) of an earlier run aside (%s) so this run can write its own; they are "
                        "kept: delete them when no longer needed", len(moved), ", ".join(p.name for p in moved))
        return moved

    def _supersede(self, step: int | None) -> list[Path]:
        doomed = [s for s in self.steps() if step is None or s > step]
        if doomed and self.read_only:
            raise CheckpointError(f"checkpoint store {str(self.directory)!r} is read-only")
        return [self._rename_aside(s, "superseded") for s in doomed]
