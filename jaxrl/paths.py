"""Where the offline shared assets live (``JAXRL_SHARED``, default ``<repo>/../shared``)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """Return the shared-assets folder: ``$JAXRL_SHARED`` if set, else ``<repo>/../shared``.

    The folder may not exist; callers decide whether that is an error.
    """
    env = os.environ.get("JAXRL_SHARED")
    return Path(env).expanduser().resolve() if env else (REPO_ROOT.parent / "shared").resolve()


def expand_shared(path: str) -> str:
    """Expand ``${JAXRL_SHARED}`` / ``$JAXRL_SHARED`` in a config path to :func:`shared_dir`."""
    s = str(shared_dir())
    return path.replace("${JAXRL_SHARED}", s).replace("$JAXRL_SHARED", s)


class OutputDirError(OSError):
    """A run's output folder cannot be created or written; the message names the folder, its config key and the
    fix, on one line."""


def ensure_writable_dir(path: str | os.PathLike, key: str) -> Path:
    """Create ``path`` (with parents) if needed and check that a file can be written in it.

    Run at start-up, before anything slow, so a read-only or uncreatable output folder fails in a second instead of
    at the first save. The check writes and removes one empty hidden file (``.jaxrl-write-test-*``), so it is also
    right for root (who passes permission checks) on a read-only filesystem.

    Args:
      path: the folder (e.g. ``trainer.default_local_dir``; relative to the working directory).
      key: its config key, for the message.

    Returns:
      the folder as a :class:`Path`.

    Raises:
      OutputDirError: ``path`` is a URL (``gs://...``, ``s3://...``: the run folder holds a lock and appended
        logs, which need a filesystem; mount the bucket instead), or the folder cannot be created (a parent is a
        file, no permission, read-only filesystem) or is not writable; the message gives the OS reason.
    """
    import re
    import tempfile

    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", str(path)):
        raise OutputDirError(
            f"{key}={str(path)!r} is a URL; the run folder must be a filesystem path (it holds the run lock and "
            "appended logs): mount the bucket on every host (e.g. gcsfuse MY_BUCKET /mnt/gcs) and give a path "
            "under it")
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".jaxrl-write-test-"):
            pass
    except OSError as e:
        if p.exists() and not p.is_dir():
            what = "is a file, not a folder"
        elif not p.is_dir():
            what = f"cannot be created ({e.strerror or e}: {e.filename})"
        else:
            what = f"is not writable ({e.strerror or e})"
        raise OutputDirError(
            f"{key}={str(path)!r} {what}; set {key} to a folder you can write to, or fix the folder's permissions"
        ) from e
    return p
