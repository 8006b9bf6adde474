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
