"""Turn a model spec (local path, ``${JAXRL_SHARED}`` path, alias, or hub id) into a local path.

Specs, tried in this order:

1. ``~`` and ``${JAXRL_SHARED}`` / ``$JAXRL_SHARED`` are expanded (:func:`jaxrl.paths.expand_shared`);
   an existing local file or folder is returned (expanded, otherwise unchanged).
2. The alias ``stories260K`` (any case): ``<shared>/models/stories260K`` when that folder exists, else the
   llama2.c files ``stories260K/stories260K.bin`` + ``stories260K/tok512.bin`` from the hub repo
   ``karpathy/tinyllamas`` (the ``.bin`` path is returned; the tokenizer sits beside it).
3. ``org/name`` (a Hugging Face hub id): ``huggingface_hub.snapshot_download`` of its config, safetensors
   and tokenizer files; the snapshot folder is returned.

``HF_HUB_OFFLINE=1`` (read at call time) makes steps 2-3 use only the local hub cache, with no network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxrl.paths import expand_shared, shared_dir

__all__ = ["resolve_model_path", "STORIES260K_REPO", "HUB_ALLOW_PATTERNS"]

STORIES260K_REPO = "karpathy/tinyllamas"
_STORIES260K_FILES = ("stories260K/stories260K.bin", "stories260K/tok512.bin")
HUB_ALLOW_PATTERNS = [
    "*.json",  # config.json, generation_config.json, tokenizer*.json, model.safetensors.index.json
    "*.safetensors",
    "tokenizer.model",
    "vocab.*",
    "merges.txt",
    "*.jinja",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _stories260k() -> str:
    local = shared_dir() / "models" / "stories260K"
    if local.is_dir():
        return str(local)
    try:
        from huggingface_hub import hf_hub_download

        paths = [
            hf_hub_download(STORIES260K_REPO, f, local_files_only=_offline()) for f in _STORIES260K_FILES
        ]
    except Exception as e:
        raise FileNotFoundError(
            f"model alias 'stories260K' is not available: either set JAXRL_SHARED to a folder containing "
            f"models/stories260K (looked in {local}), or allow network access to the Hugging Face hub repo "
            f"{STORIES260K_REPO} (files {', '.join(_STORIES260K_FILES)}). Hub error: {type(e).__name__}: {e}"
        ) from e
    return paths[0]


def resolve_model_path(spec: str) -> str:
    """Resolve a model spec to an existing local path (folder, ``.gguf`` or llama2.c ``.bin`` file).

    Args:
      spec: local path (``~`` and ``${JAXRL_SHARED}`` expanded), the alias ``"stories260K"``
        (case-insensitive), or a Hugging Face hub id ``"org/name"``.

    Returns:
      the local path as a string: the expanded spec when it exists; for the alias the shared folder or
      the downloaded ``stories260K.bin``; for a hub id the snapshot folder.

    Raises:
      TypeError: ``spec`` is not a string / path.
      FileNotFoundError: nothing matches. For the alias the message names both options (JAXRL_SHARED
        with ``models/stories260K``, or network access to ``karpathy/tinyllamas``) and the hub error; for
        a hub id it names the id, says the hub was unreachable / offline and to pass a local path.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"model spec must be a string path, alias or hub id; got {type(spec).__name__}")
    raw = str(spec)
    expanded = os.path.expanduser(expand_shared(raw))
    if os.path.exists(expanded):
        return expanded
    if raw.strip().lower() == "stories260k":
        return _stories260k()
    if _HUB_ID.match(raw.strip()):
        repo_id = raw.strip()
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=_offline())
        except Exception as e:
            raise FileNotFoundError(
                f"model {repo_id!r} is not a local path ({Path(expanded).resolve()} does not exist) and could not "
                f"be fetched from the Hugging Face hub (hub unreachable or offline, or no such repo); pass a local "
                f"model folder, .gguf or llama2.c .bin path instead. Hub error: {type(e).__name__}: {e}"
            ) from e
    raise FileNotFoundError(
        f"model path {expanded!r} (from spec {raw!r}) does not exist; expected an existing local folder / .gguf / "
        f".bin file, the alias 'stories260K', or a Hugging Face hub id 'org/name'"
    )
