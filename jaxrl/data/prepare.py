"""Dataset preparation: raw GSM8K / MATH -> verl-format parquet (``train.parquet``, ``test.parquet``).

Usage::

    python -m jaxrl.data.prepare gsm8k [--input DIR_OR_HUB_ID] --output DIR [--max-rows N]
    python -m jaxrl.data.prepare math  [--input DIR_OR_HUB_ID] --output DIR [--max-rows N]

``--input`` is a local folder (default ``<shared>/data/gsm8k`` resp. ``<shared>/data/math``) holding
``train.jsonl``/``test.jsonl`` (or ``train.parquet``/``test.parquet``, or the hub layout
``main/train-*.parquet``), or else a Hugging Face hub dataset id (``openai/gsm8k``) whose parquet
files are fetched with ``huggingface_hub`` (no ``datasets`` dependency).

The output rows match verl's ``examples/data_preprocess/gsm8k.py`` / ``math_dataset.py`` field for
field (see :func:`gsm8k_row`, :func:`math_row`). No jax import.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

from jaxrl.paths import shared_dir

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")

# verl examples/data_preprocess/gsm8k.py: the number after "#### ", commas removed.
_GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_ground_truth(answer: str) -> str:
    """The GSM8K reference number: the text after ``#### `` with thousands commas removed.

    Raises:
        ValueError: ``answer`` has no ``#### <number>``.
    """
    m = _GSM8K_ANSWER_RE.search(answer)
    if m is None:
        raise ValueError(f"GSM8K answer has no '#### <number>': {answer[-80:]!r}")
    return m.group(1).replace(",", "")


def gsm8k_row(example: dict, split: str, index: int) -> dict:
    """One raw GSM8K example ``{question, answer}`` -> one verl row (verl's gsm8k preprocess)."""
    question, answer = example["question"], example["answer"]
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces matched), or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def math_row(example: dict, split: str, index: int) -> dict | None:
    """One raw MATH example -> one verl row (verl's math_dataset preprocess), or None without an answer.

    The ground truth is the example's ``answer`` field (= the last ``\\boxed{}`` of the solution,
    which is what verl extracts); where the example has no ``answer`` key at all (the hub copy),
    it is :func:`last_boxed` of ``solution``. Rows with an empty/missing answer return None.
    """
    answer = example.get("answer")
    if answer is None and "answer" not in example:  # hub copies carry only `solution`
        answer = last_boxed(example.get("solution") or "")
    if not isinstance(answer, str) or not answer.strip():
        return None
    return {
        "data_source": MATH_DATA_SOURCE,
        "prompt": [{"role": "user", "content": example["problem"] + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def _read_split_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: invalid JSON ({e.msg})") from None
    return rows


def _find_split(folder: Path, split: str) -> Path:
    """Locate ``split`` in ``folder``: ``{split}.jsonl``, ``{split}.parquet`` or ``*/{split}-*.parquet``."""
    for cand in (folder / f"{split}.jsonl", folder / f"{split}.parquet"):
        if cand.is_file():
            return cand
    hub = sorted(folder.glob(f"**/{split}-*.parquet"))
    main = [p for p in hub if p.parent.name == "main"]
    if main or hub:
        return (main or hub)[0]
    raise FileNotFoundError(
        f"no {split} split in {folder}: expected {split}.jsonl, {split}.parquet or "
        f"<config>/{split}-*.parquet; found {sorted(p.name for p in folder.iterdir())}"
    )


def _download_hub(repo_id: str, local_default: Path) -> Path:
    """Fetch the parquet files of hub dataset ``repo_id``; SystemExit naming both options if unreachable."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=["*.parquet"])
        )
    except Exception as e:  # noqa: BLE001 - any hub failure ends in the same advice
        raise SystemExit(
            f"--input {repo_id!r} is not a local folder, and downloading it from the Hugging Face hub "
            f"failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}). "
            "Either pass a local folder holding "
            f"train.jsonl/test.jsonl (e.g. --input {local_default}) or run where the hub is reachable."
        ) from None


def prepare(
    input_spec: str,
    output: Path,
    row_fn: Callable[[dict, str, int], dict | None],
    *,
    max_rows: int | None = None,
    local_default: Path,
) -> dict[str, dict[str, int]]:
    """Convert both splits of a raw dataset into ``output/{train,test}.parquet``.

    Args:
        input_spec: a local folder or a hub dataset id (see module docstring).
        output: folder to write into (created).
        row_fn: ``(raw_example, split, index) -> row`` or None to skip (counted).
        max_rows: keep only the first N raw examples of each split.
        local_default: the default local folder, named in error messages.

    Returns:
        ``{split: {"written": n, "skipped": k}}``.

    Raises:
        FileNotFoundError: a split is missing in the input folder.
        ValueError: ``max_rows`` < 1.
        SystemExit: the input is neither a local folder nor a reachable hub dataset.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if max_rows is not None and max_rows < 1:
        raise ValueError(f"--max-rows must be >= 1, got {max_rows}")
    folder = Path(input_spec).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise SystemExit(f"--input {input_spec!r} is a file; expected a folder or a hub dataset id")
        folder = _download_hub(input_spec, local_default)
    output.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        raw = _read_split_file(_find_split(folder, split))
        if max_rows is not None:
            raw = raw[:max_rows]
        rows, skipped = [], 0
        for idx, ex in enumerate(raw):
            row = row_fn(ex, split, idx)
            if row is None:
                skipped += 1
            else:
                rows.append(row)
        if skipped:
            logger.warning("%s: skipped %d of %d rows (no answer)", split, skipped, len(raw))
        pq.write_table(pa.Table.from_pylist(rows), output / f"{split}.parquet")
        counts[split] = {"written": len(rows), "skipped": skipped}
    return counts


DATASETS = {
    "gsm8k": (gsm8k_row, "gsm8k"),
    "math": (math_row, "math"),
}


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    """CLI entry point; returns the per-split counts (also printed)."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl.data.prepare", description="Write verl-format train/test parquet files."
    )
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument(
        "--input",
        default=None,
        help="local folder with train.jsonl/test.jsonl, or a hub dataset id "
        "(default: <shared>/data/<dataset>)",
    )
    parser.add_argument("--output", required=True, help="output folder for train.parquet/test.parquet")
    parser.add_argument("--max-rows", type=int, default=None, help="keep the first N rows of each split")
    args = parser.parse_args(argv)
    row_fn, sub = DATASETS[args.dataset]
    local_default = shared_dir() / "data" / sub
    counts = prepare(
        args.input or str(local_default),
        Path(args.output).expanduser(),
        row_fn,
        max_rows=args.max_rows,
        local_default=local_default,
    )
    for split, c in counts.items():
        print(
            f"{args.dataset} {split}: wrote {c['written']} rows, skipped {c['skipped']} -> "
            f"{Path(args.output) / (split + '.parquet')}"
        )
    return counts


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1:])
