"""Row sources: resolve data paths and read verl-format prompt rows from parquet / jsonl / json.

A *row* is one training example as a plain ``dict`` in verl's layout::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}]   # or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Only the prompt column is required here; the reward side decides what else it needs.
No jax import (this module is used by ``python -m jaxrl.data.prepare``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jaxrl.paths import expand_shared

logger = logging.getLogger(__name__)

BUILTIN_SCHEME = "jaxrl://"
PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")


def _missing_path_error(path: Path, original: str) -> FileNotFoundError:
    """FileNotFoundError naming ``path``; lists the parent folder's entries when the parent exists."""
    msg = f"data file {str(path)!r} does not exist"
    if original != str(path):
        msg += f" (from {original!r})"
    parent = path.parent
    if parent.is_dir():
        entries = sorted(p.name for p in parent.iterdir())
        shown = ", ".join(entries[:30]) + (" ..." if len(entries) > 30 else "")
        msg += f"; {str(parent)!r} contains: [{shown}]"
    elif not parent.exists():
        msg += f"; its folder {str(parent)!r} does not exist either"
    return FileNotFoundError(msg)


def resolve_data_path(p: str | os.PathLike) -> Path:
    """Resolve a data path from a config to an existing file.

    Accepted forms:
      * ``jaxrl://NAME``: a file packaged with jaxrl under ``jaxrl/data/builtin/NAME``
        (e.g. ``jaxrl://story_prompts.jsonl``);
      * a path containing ``~`` and/or ``${JAXRL_SHARED}`` / ``$JAXRL_SHARED``
        (expanded with :func:`jaxrl.paths.expand_shared`).

    Returns:
        The absolute :class:`Path` of the existing file.

    Raises:
        FileNotFoundError: the file does not exist; the message names the resolved path and
            lists what the containing folder holds (or the packaged files for ``jaxrl://``).
        ValueError: ``p`` is empty.
    """
    s = os.fspath(p)
    if not s:
        raise ValueError("data path is empty; give a parquet/jsonl file path or jaxrl://NAME")
    if s.startswith(BUILTIN_SCHEME):
        name = s[len(BUILTIN_SCHEME) :]
        builtin = resources.files("jaxrl.data") / "builtin"
        target = builtin / name
        if not name or not target.is_file():
            available = sorted(e.name for e in builtin.iterdir() if e.is_file())
            raise FileNotFoundError(
                f"packaged data file {s!r} does not exist; packaged files: {available} "
                f"(use jaxrl://<one of these>)"
            )
        return Path(str(target)).resolve()
    path = Path(expand_shared(s)).expanduser()
    if not path.is_file():
        if path.is_dir():
            entries = sorted(e.name for e in path.iterdir())
            raise FileNotFoundError(
                f"data path {str(path)!r} is a folder, expected a file; it contains {entries}"
            )
        raise _missing_path_error(path, s)
    return path.resolve()


class DataFileError(ValueError):
    """A data file exists but cannot be read (corrupt or not in the format its name says)."""


@dataclass
class LoadedRows:
    """Result of :func:`load_rows_report`.

    Attributes:
        rows: the valid rows, in file order (files in the given order).
        num_skipped: how many malformed rows were skipped (0 unless ``skip_malformed``).
        skipped: one ``"file:line: reason"`` string per skipped row.
    """

    rows: list[dict]
    num_skipped: int
    skipped: list[str]


def _check_prompt(row: Any, prompt_key: str) -> str | None:
    """Return why ``row`` is not a usable prompt row, or None if it is."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, expected a JSON object"
    if prompt_key not in row or row[prompt_key] is None:
        return f"missing {prompt_key!r} (keys: {sorted(row)})"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return None if prompt else f"{prompt_key!r} is an empty string"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return f"{prompt_key!r} is an empty message list"
        for j, m in enumerate(prompt):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                return f"{prompt_key!r}[{j}] is not a {{'role': str, 'content': str}} message: {m!r:.80}"
        return None
    return f"{prompt_key!r} is a {type(prompt).__name__}; expected a string or a list of chat messages"


def _iter_json_rows(path: Path):
    """Yield ``(line_no, row_or_exception)``; 1-based line (element number for a JSON array)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            arr = json.loads(text)
        except json.JSONDecodeError as e:
            yield e.lineno, ValueError(f"invalid JSON array: {e.msg}")
            return
        for i, row in enumerate(arr, start=1):
            yield i, row
        return
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            yield i, ValueError(f"invalid JSON ({e.msg} at column {e.colno})")


def _iter_parquet_rows(path: Path, prompt_key: str):
    """Yield ``(row_no, row)`` for a parquet file; ``row_no`` is 1-based."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(f"{path}: unreadable parquet file ({e})") from e
    if prompt_key not in table.column_names:
        raise DataFileError(
            f"{path}: parquet file has no {prompt_key!r} column (columns: {table.column_names})"
        )
    yield from enumerate(table.to_pylist(), start=1)


def load_rows_report(
    files: str | os.PathLike | list, *, skip_malformed: bool = False, prompt_key: str = "prompt"
) -> LoadedRows:
    """Read verl-format rows from parquet (``.parquet``) and JSON-lines (``.jsonl``/``.json``) files.

    A ``.json`` file whose content starts with ``[`` is read as one JSON array of rows; otherwise
    ``.json`` is read as JSON lines like ``.jsonl``. Blank lines are ignored. Parquet nested
    columns (``prompt`` list of ``{role, content}``, ``reward_model``, ``extra_info`` structs) come
    back as plain Python lists/dicts.

    A row is malformed when it is not valid JSON, not an object, or its ``prompt_key`` is missing,
    empty, or neither a string nor a list of ``{"role": str, "content": str}`` messages.

    Args:
        files: one path or a list of paths (each resolved with :func:`resolve_data_path`).
        skip_malformed: False -> the first malformed row raises; True -> malformed rows are skipped,
            counted in ``num_skipped`` and described in ``skipped``.
        prompt_key: the column holding the prompt.

    Returns:
        :class:`LoadedRows`.

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: an unsupported suffix; a malformed row (message ``"<file>:<1-based line/row>:
            <reason>"``) when ``skip_malformed`` is False; a parquet file without the prompt column
            (always raised: a whole file of bad rows is a configuration error).
    """
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise ValueError("no data files given; expected a path or a non-empty list of paths")
    rows: list[dict] = []
    skipped: list[str] = []
    for f in files:
        path = resolve_data_path(f)
        suffix = path.suffix.lower()
        if suffix in PARQUET_SUFFIXES:
            it = _iter_parquet_rows(path, prompt_key)
            unit = "row"
        elif suffix in JSON_SUFFIXES:
            it = _iter_json_rows(path)
            unit = "line"
        else:
            raise DataFileError(
                f"unsupported data file suffix {path.suffix!r} for {path}; "
                f"supported: {list(PARQUET_SUFFIXES + JSON_SUFFIXES)}"
            )
        for no, row in it:
            reason = str(row) if isinstance(row, Exception) else _check_prompt(row, prompt_key)
            if reason is None:
                rows.append(row)
                continue
            where = f"{path}:{no}: malformed {unit} {no}: {reason}"
            if not skip_malformed:
                raise DataFileError(where + " (pass skip_malformed=True to skip such rows)")
            skipped.append(where)
    if skipped:
        logger.warning(
            "skipped %d malformed row(s) while loading %s; first: %s", len(skipped), files, skipped[0]
        )
    return LoadedRows(rows=rows, num_skipped=len(skipped), skipped=skipped)


def load_rows(
    files: str | os.PathLike | list, *, skip_malformed: bool = False, prompt_key: str = "prompt"
) -> list[dict]:
    """Read verl-format rows; the same as :func:`load_rows_report` but returns only the rows.

    Skipped rows (``skip_malformed=True``) are logged as one warning with their count; call
    :func:`load_rows_report` to get the count and the reasons programmatically.

    Raises:
        Same as :func:`load_rows_report`.
    """
    return load_rows_report(files, skip_malformed=skip_malformed, prompt_key=prompt_key).rows
