"""The checkpoint store's errors, and how an OS / tensorstore failure is reduced to an errno and one line."""

from __future__ import annotations

import re
from pathlib import Path


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
