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
from dataclasses import dataclass, field
from importlib import resources
from collections.abc import Callable
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
    """A data file exists but its rows cannot be used: corrupt, not in the format its name says, empty, every row
    malformed, or (raised by :mod:`jaxrl.data.pipeline`) prompts that do not fit ``data.max_prompt_length``.

    The message is one line that names the file (and the split: ``data.train_files`` / ``data.val_files``) and
    what to change. ``python -m jaxrl.train`` prints it as ``jaxrl: error: ...`` and exits 1.
    """


@dataclass
class LoadedRows:
    """Result of :func:`load_rows_report`.

    Attributes:
        rows: the valid rows, in file order (files in the given order).
        num_skipped: how many malformed rows were skipped (0 unless ``skip_malformed``).
        skipped: one ``"file:line: reason"`` string per skipped row.
        origins: one ``"file:line"`` (``"file:row"`` for parquet) per kept row, aligned with ``rows``.
    """

    rows: list[dict]
    num_skipped: int
    skipped: list[str]
    origins: list[str] = field(default_factory=list)

    def head(self, n: int | None) -> "LoadedRows":
        """The first ``n`` rows (all when ``n`` is None or <= 0), origins kept aligned."""
        if not n or n <= 0:
            return self
        return LoadedRows(self.rows[:n], self.num_skipped, self.skipped, self.origins[:n])


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


def _iter_parquet_rows(path: Path, prompt_key: str | None):
    """Yield ``(row_no, row)`` for a parquet file; ``row_no`` is 1-based (``prompt_key``: a column it must have)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(f"{path}: unreadable parquet file ({e})") from e
    if prompt_key is not None and prompt_key not in table.column_names:
        raise DataFileError(
            f"{path}: parquet file has no {prompt_key!r} column (columns: {table.column_names})"
        )
    yield from enumerate(table.to_pylist(), start=1)


def load_rows_report(
    files: str | os.PathLike | list, *, skip_malformed: bool = False, prompt_key: str = "prompt",
    row_check: Callable[[Any], str | None] | None = None,
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
        row_check: instead of the prompt check, ``row -> why it is malformed, or None`` (the offline trainers'
            rows: :mod:`jaxrl.data.sft`, :mod:`jaxrl.data.preference`); parquet files then need no prompt column.

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
    origins: list[str] = []
    skipped: list[str] = []
    for f in files:
        path = resolve_data_path(f)
        suffix = path.suffix.lower()
        if suffix in PARQUET_SUFFIXES:
            it = _iter_parquet_rows(path, prompt_key if row_check is None else None)
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
            if isinstance(row, Exception):
                reason = str(row)
            elif not isinstance(row, dict):
                reason = f"row is a {type(row).__name__}, expected a JSON object"
            else:
                reason = _check_prompt(row, prompt_key) if row_check is None else row_check(row)
            if reason is None:
                rows.append(row)
                origins.append(f"{path}:{no}")
                continue
            where = f"{path}:{no}: malformed {unit} {no}: {reason}"
            if not skip_malformed:
                raise DataFileError(
                    where + " (skip_malformed=True, data.skip_malformed=true in a run, skips such rows)"
                )
            skipped.append(where)
    if skipped:
        logger.warning(
            "skipped %d malformed row(s) while loading %s; first: %s", len(skipped), files, skipped[0]
        )
    return LoadedRows(rows=rows, num_skipped=len(skipped), skipped=skipped, origins=origins)


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


SPLIT_KEYS = {"train": "data.train_files", "val": "data.val_files"}


def load_split(
    files: str | os.PathLike | list,
    *,
    split: str,
    skip_malformed: bool = False,
    prompt_key: str = "prompt",
    max_samples: int | None = None,
    row_check: Callable[[Any], str | None] | None = None,
    row_needs: str | None = None,
) -> LoadedRows:
    """The rows of one split of a run (``data.train_files`` or ``data.val_files``), refusing a split with none.

    Args:
      files: the split's file(s), as :func:`load_rows_report` takes them.
      split: ``"train"`` or ``"val"`` (names the config key in messages).
      skip_malformed: ``data.skip_malformed``.
      prompt_key: ``data.prompt_key``.
      max_samples: keep the first ``max_samples`` rows (``data.train_max_samples`` / ``val_max_samples``;
        None or <= 0 keeps all).
      row_check: a row check replacing the prompt check (see :func:`load_rows_report`).
      row_needs: what a row needs, for the messages (default: a ``prompt_key`` string or list of chat messages).

    Returns:
      :class:`LoadedRows` with at least one row, ``origins`` aligned with ``rows``.

    Raises:
      FileNotFoundError: a file does not exist (one line; says how verl-format files are made).
      DataFileError: a malformed row (without ``skip_malformed``), an unreadable file, or no usable row at all:
        the files are empty, or every row was malformed and skipped (the message names the split's key, the
        files, and the first skipped row's reason).
    """
    key = SPLIT_KEYS[split]
    try:
        loaded = load_rows_report(files, skip_malformed=skip_malformed, prompt_key=prompt_key, row_check=row_check)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{key}: {e} (verl-format parquet files are made by `python -m jaxrl.data.prepare gsm8k|math "
            "--output DIR`)"
        ) from e
    except DataFileError as e:
        raise DataFileError(f"{key}: {e}") from e
    names = ", ".join(str(resolve_data_path(f)) for f in ([files] if isinstance(files, (str, os.PathLike)) else files))
    needs = row_needs or f"a {prompt_key!r} string or list of chat messages"
    if not loaded.rows:
        if loaded.num_skipped:
            raise DataFileError(
                f"{key} ({names}): all {loaded.num_skipped} rows are malformed and were skipped "
                f"(data.skip_malformed=true), so the {split} split is empty; first: {loaded.skipped[0]}; fix the "
                f"rows (each needs {needs})"
            )
        raise DataFileError(
            f"{key} ({names}): no rows, the {split} split is empty; give a file with verl-format rows "
            f"(one JSON object with {needs} per line, or parquet)"
        )
    return loaded.head(max_samples)
