"""The checkout as one gzip tarball for `sync`: source, configs, tests; no outputs, venvs, caches or git history."""

from __future__ import annotations

import fnmatch
import os
import tarfile
from pathlib import Path

# Folder names skipped wherever they appear, and top-level folders of run outputs (see .gitignore).
EXCLUDED_DIRS = (".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache", ".venv*",
                 "venv", "*.egg-info", "node_modules", ".ipynb_checkpoints")
EXCLUDED_TOP = ("outputs", "checkpoints", "build", "dist", "wandb")
EXCLUDED_FILES = ("*.pyc", "*.pyo", "*.tar.gz", ".DS_Store")


def excluded(relpath: str) -> bool:
    """True when the checkout-relative path `relpath` ("a/b/c.py", "/" separators) stays out of the tarball."""
    parts = relpath.split("/")
    if parts[0] in EXCLUDED_TOP:
        return True
    if any(fnmatch.fnmatch(p, pat) for p in parts[:-1] for pat in EXCLUDED_DIRS):
        return True
    name = parts[-1]
    return any(fnmatch.fnmatch(name, pat) for pat in EXCLUDED_DIRS + EXCLUDED_FILES)


def checkout_files(source: Path) -> list[str]:
    """Every file under `source` that `excluded` keeps, as sorted "/"-separated paths relative to `source`.

    Raises FileNotFoundError when `source` is not a folder.
    """
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"checkout folder {source} does not exist")
    kept: list[str] = []
    for root, dirs, files in os.walk(source):
        rel_root = os.path.relpath(root, source)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/") + "/"
        dirs[:] = sorted(d for d in dirs if not excluded(rel_root + d + "/x"))
        kept.extend(rel_root + f for f in sorted(files) if not excluded(rel_root + f))
    return sorted(kept)


def build_tarball(source: Path, dest: Path, files: list[str]) -> None:
    """Write `dest` (.tar.gz) holding `files` (from checkout_files) under their relative names; symlinks stay links."""
    with tarfile.open(dest, "w:gz") as tar:
        for rel in files:
            tar.add(Path(source) / rel, arcname=rel, recursive=False)
