"""Model files that exist but cannot be used, and reading a model's config without its weights.

:class:`ModelFileError` is the one error the model loaders raise for a file that is there but unusable (truncated
or garbage ``model.safetensors`` / GGUF / llama2.c ``.bin``, a ``config.json`` that is not JSON or not a supported
config, tensors that do not match the config, unreadable tokenizer files). Its message is one line that names the
file and what to do. ``python -m jaxrl.train`` and ``python -m jaxrl.generate`` print it as ``jaxrl: error: ...``
and exit 1; a missing file stays ``FileNotFoundError``.

:func:`read_model_config` gives the Hugging Face config dict of any model spec :func:`load_pretrained` accepts by
reading only ``config.json``, the GGUF metadata or the llama2.c header, so limits such as the context length
(``max_position_embeddings``) can be checked before the weights load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["ModelFileError", "read_json_file", "read_model_config"]


class ModelFileError(ValueError):
    """A model file exists but cannot be used (corrupt, truncated, not the format its name says, or describing a
    model jaxrl does not support). The message names the file and the fix, on one line."""


def read_json_file(path: str | os.PathLike, what: str) -> dict:
    """Parse a JSON object from ``path`` (a model's ``config.json``, a safetensors index, ...).

    Args:
      path: the file.
      what: what the file is, for the message (e.g. ``"model config"``).

    Returns:
      the parsed ``dict``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError: the file is not UTF-8 JSON, or holds something other than a JSON object.
    """
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(
            f"{p}: the {what} is not valid JSON ({_one_line(e)}); restore the file from the model's source"
        ) from e
    if not isinstance(data, dict):
        raise ModelFileError(
            f"{p}: the {what} holds a JSON {type(data).__name__}, expected an object; restore the file from the "
            "model's source"
        )
    return data


def read_model_config(spec: str, *, cheap_only: bool = False) -> tuple[dict, str] | None:
    """The Hugging Face config dict of a model spec, without reading its weights.

    Args:
      spec: anything :func:`jaxrl.models.resolve.resolve_model_path` accepts (folder with ``config.json``,
        ``.gguf``, llama2.c ``.bin``, alias, hub id).
      cheap_only: return None for a GGUF file, whose metadata parse (``gguf.GGUFReader``) costs about as much as
        loading the model (3.4 s of 4.5 s for SmolLM2-135M), instead of parsing it twice.

    Returns:
      ``(hf_config, source)``: the config dict (as :func:`jaxrl.models.load_pretrained` would build the model
      from) and the file it was read from (``.../config.json``, the ``.gguf`` or the ``.bin``); None for a GGUF
      file with ``cheap_only``.

    Raises:
      FileNotFoundError: nothing at ``spec``, or a folder without ``config.json``.
      ModelFileError: the config / GGUF metadata / llama2.c header cannot be read.
    """
    from jaxrl.models.resolve import resolve_model_path

    resolved = resolve_model_path(spec)
    if os.path.isdir(resolved):
        cfg_path = os.path.join(resolved, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model directory {resolved!r} has no config.json")
        return read_json_file(cfg_path, "model config"), cfg_path
    if os.path.isfile(resolved) and resolved.endswith(".gguf"):
        if cheap_only:
            return None
        from jaxrl.models.gguf import read_gguf_config

        return read_gguf_config(resolved), resolved
    if os.path.isfile(resolved) and resolved.endswith(".bin"):
        from jaxrl.models.llama2c import read_llama2c_config

        return read_llama2c_config(resolved), resolved
    raise FileNotFoundError(
        f"model path {resolved!r} (from {spec!r}) is not a directory with config.json, a .gguf file "
        "or a llama2.c .bin file"
    )


def _one_line(e: BaseException) -> str:
    """``Type: message`` of an exception, newlines folded, for a one-line error."""
    return f"{type(e).__name__}: " + " ".join(str(e).split())
