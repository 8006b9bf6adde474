"""Resume discovery: where a run resumes from under verl's ``trainer.resume_mode``, found before any model load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from jaxrl.checkpoint.layout import _TMP_MARK, RESUME_MODES, STEP_PREFIX, _complete_steps, parse_step_dir

log = logging.getLogger("jaxrl.checkpoint")  # one logger for the package (tests and users filter on it)


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
