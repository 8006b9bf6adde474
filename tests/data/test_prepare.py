"""`python -m jaxrl.data.prepare` on the real shared GSM8K / MATH files."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from jaxrl.data import prepare

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _raw(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gsm8k_schema_and_fields(shared, tmp_path):
    src = shared / "data" / "gsm8k"
    # 150 rows: test row 146 is the first whose answer uses a thousands comma.
    counts = prepare.main(["gsm8k", "--input", str(src), "--output", str(tmp_path), "--max-rows", "150"])
    assert counts == {"train": {"written": 150, "skipped": 0}, "test": {"written": 150, "skipped": 0}}
    for split in ("train", "test"):
        table = pq.read_table(tmp_path / f"{split}.parquet")
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        rows = table.to_pylist()
        raw = _raw(src / f"{split}.jsonl")[:150]
        assert len(rows) == 150
        for i, (row, ex) in enumerate(zip(rows, raw)):
            gt = ex["answer"].split("####")[-1].strip().replace(",", "")
            assert row == {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "answer": ex["answer"],
                    "question": ex["question"],
                },
            }
    test_rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    comma_row = test_rows[146]
    assert re.search(r"#### \d{1,3},\d{3}", comma_row["extra_info"]["answer"])
    gt = comma_row["reward_model"]["ground_truth"]
    assert "," not in gt and gt == comma_row["extra_info"]["answer"].split("#### ")[-1].replace(",", "")


def test_gsm8k_full_ground_truths_are_plain_numbers(shared, tmp_path):
    counts = prepare.main(["gsm8k", "--input", str(shared / "data/gsm8k"), "--output", str(tmp_path)])
    assert counts["train"]["written"] == 7473 and counts["test"]["written"] == 1319
    gts = [
        r["ground_truth"]
        for r in pq.read_table(tmp_path / "train.parquet").column("reward_model").to_pylist()
    ]
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", g) for g in gts), [
        g for g in gts if not re.fullmatch(r"-?\d+", g)
    ][:5]
    assert sum(g.startswith("-") for g in gts) > 0  # the negative answers survive


def test_math_skips_rows_without_answer(shared, tmp_path):
    src = shared / "data" / "math"
    counts = prepare.main(["math", "--input", str(src), "--output", str(tmp_path), "--max-rows", "1710"])
    raw = _raw(src / "train.jsonl")[:1710]
    missing = sum(not (isinstance(r.get("answer"), str) and r["answer"].strip()) for r in raw)
    assert missing == 2  # rows 1655 and 1707 of the shared copy have no answer
    assert counts["train"] == {"written": 1710 - missing, "skipped": missing}
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": raw[0]["answer"]}
    assert rows[0]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert rows[-1]["extra_info"] == {"split": "train", "index": 1709}


def test_last_boxed_matches_shared_answers(shared):
    raw = _raw(shared / "data/math/test.jsonl")[:300]
    assert all(prepare.last_boxed(r["solution"]) == r["answer"] for r in raw)
    assert prepare.last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert prepare.last_boxed("no box") is None


def test_unreachable_input_names_both_options(tmp_path):
    with pytest.raises(SystemExit, match=r"not a local folder.*hub.*--input"):
        prepare.main(
            ["gsm8k", "--input", "no-such-owner-jaxrl/no-such-dataset", "--output", str(tmp_path)]
        )


def test_bad_max_rows(shared, tmp_path):
    with pytest.raises(ValueError, match="max-rows"):
        prepare.main(
            [
                "gsm8k",
                "--input",
                str(shared / "data/gsm8k"),
                "--output",
                str(tmp_path),
                "--max-rows",
                "0",
            ]
        )


MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def test_math500_rows(shared, tmp_path):
    counts = prepare.main(["math500", "--output", str(tmp_path)])
    assert counts == {"test": {"written": 500, "skipped": 0}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet"]
    table = pq.read_table(tmp_path / "test.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    raw = _raw(shared / "data/math/math500_test.jsonl")
    assert len(rows) == len(raw) == 500
    for i, (row, ex) in enumerate(zip(rows, raw)):
        assert row == {
            "data_source": "HuggingFaceH4/MATH-500",
            "prompt": [{"role": "user", "content": ex["problem"] + " " + MATH_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex["answer"]},
            "extra_info": {"split": "test", "index": i},
        }


def test_math500_reference_solutions_score_one_with_the_built_in_scorer(shared, tmp_path):
    """Every MATH-500 row is scorable: its own reference solution (ending in \\boxed{answer}) scores 1."""
    from jaxrl.rewards import default_compute_score

    prepare.main(["math500", "--output", str(tmp_path)])
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    raw = _raw(shared / "data/math/math500_test.jsonl")
    scores = [
        default_compute_score(r["data_source"], ex["solution"], r["reward_model"]["ground_truth"])["score"]
        for r, ex in zip(rows, raw)
    ]
    assert sum(scores) == 500


def test_from_jsonl_maps_the_named_fields(tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text(
        json.dumps({"q": "What is 2+3?", "a": 5, "id": 1}) + "\n\n"
        + json.dumps({"q": "Half of 1?", "a": "\\frac{1}{2}", "id": 2}) + "\n"
    )
    out = tmp_path / "out"
    counts = prepare.main([
        "--from-jsonl", str(src), "--question-field", "q", "--answer-field", "a",
        "--data-source", "HuggingFaceH4/MATH-500", "--output", str(out),
    ])
    assert counts == {"train": {"written": 2, "skipped": 0}}
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert rows == [
        {
            "data_source": "HuggingFaceH4/MATH-500",
            "prompt": [{"role": "user", "content": "What is 2+3? " + MATH_INSTRUCTION}],  # the scorer's format
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "data_source": "HuggingFaceH4/MATH-500",
            "prompt": [{"role": "user", "content": "Half of 1? " + MATH_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    # an explicit instruction (or none), another split name, a data source with no built-in scorer
    counts = prepare.main([
        "--from-jsonl", str(src), "--question-field", "q", "--answer-field", "a", "--data-source", "my/set",
        "--instruction", "", "--split", "test", "--output", str(out), "--max-rows", "1",
    ])
    assert counts == {"test": {"written": 1, "skipped": 0}}
    row = pq.read_table(out / "test.parquet").to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": "What is 2+3?"}] and row["data_source"] == "my/set"
    assert row["extra_info"] == {"split": "test", "index": 0}
    counts = prepare.main([
        "--from-jsonl", str(src), "--question-field", "q", "--answer-field", "a", "--data-source", "aime2024",
        "--output", str(out),
    ])
    assert pq.read_table(out / "train.parquet").to_pylist()[0]["prompt"][0]["content"] == (
        "What is 2+3? " + prepare.MATH_DAPO_INSTRUCTION
    )


def test_from_jsonl_bad_field_names_the_row_and_the_fields(tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text(json.dumps({"q": "x", "a": "1"}) + "\n" + json.dumps({"q": "y", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"mine.jsonl: row 2: --answer-field 'a' is missing.*\['answer', 'q'\]"):
        prepare.main([
            "--from-jsonl", str(src), "--question-field", "q", "--answer-field", "a", "--data-source", "math",
            "--output", str(tmp_path / "out"),
        ])
    with pytest.raises(SystemExit):  # argparse usage error: the mapping needs all three names
        prepare.main(["--from-jsonl", str(src), "--question-field", "q", "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit):  # a dataset and --from-jsonl together
        prepare.main(["math", "--from-jsonl", str(src), "--output", str(tmp_path / "out")])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare.main([
            "--from-jsonl", str(tmp_path / "nope.jsonl"), "--question-field", "q", "--answer-field", "a",
            "--data-source", "math", "--output", str(tmp_path / "out"),
        ])


# two rows in MBPP's own jsonl format (task 2 and 3 of mbpp.jsonl)
MBPP_ROWS = [
    {"text": "Write a function to find the similar elements from the given two tuple lists.",
     "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n"
             "  return (res) ",
     "task_id": 2, "test_setup_code": "",
     "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                   "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                   "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"],
     "challenge_test_list": []},
    {"text": "Write a python function to identify non-prime numbers.",
     "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n"
             "    for i in range(2,int(math.sqrt(n)) + 1):\r\n        if n % i == 0:\r\n            result = True\r\n    return result",
     "task_id": 3, "test_setup_code": "",
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                   "assert is_not_prime(35) == True"],
     "challenge_test_list": []},
]


def test_from_jsonl_mbpp_rows_become_assert_case_code_rows(tmp_path, bwrap_sandbox):
    from jaxrl.rewards import default_compute_score
    from jaxrl.rewards.code import CodeRewardSettings

    src = tmp_path / "mbpp.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MBPP_ROWS))
    out = tmp_path / "out"
    counts = prepare.main(["--from-jsonl", str(src), "--question-field", "text", "--answer-field", "test_list",
                           "--data-source", "mbpp", "--output", str(out)])
    assert counts == {"train": {"written": 2, "skipped": 0}}
    rows = pq.read_table(out / "train.parquet").to_pylist()
    first = rows[0]
    assert first["data_source"] == "mbpp" and first["ability"] == "code"
    assert json.loads(first["reward_model"]["ground_truth"]) == {"assert_case": MBPP_ROWS[0]["test_list"]}
    content = first["prompt"][0]["content"]
    assert content == (MBPP_ROWS[0]["text"] + "\nYour code should pass these tests:\n\n"
                       + "\n".join(MBPP_ROWS[0]["test_list"]) + "\n\n" + prepare.CODE_INSTRUCTION)
    settings = CodeRewardSettings(sandbox=bwrap_sandbox)
    for row, raw in zip(rows, MBPP_ROWS):  # MBPP's reference code passes its own tests, in a fenced reply
        reply = f"Sure.\n```python\n{raw['code']}\n```"
        res = default_compute_score(row["data_source"], reply, row["reward_model"]["ground_truth"], code=settings)
        assert res["score"] == 1.0 and res["passed"] == 3, res
    wrong = "```python\ndef is_not_prime(n):\n    return n % 2 == 0\n```"  # 2 -> True (wrong), 10 ok, 35 wrong
    res = default_compute_score("mbpp", wrong, rows[1]["reward_model"]["ground_truth"], code=settings)
    assert res["score"] == pytest.approx(1 / 3)


def test_from_jsonl_code_answers_are_checked(tmp_path):
    src = tmp_path / "cc.jsonl"
    good = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    src.write_text(json.dumps({"q": "Add two ints.", "tests": good}) + "\n"
                   + json.dumps({"q": "Broken.", "tests": {"inputs": ["1"], "outputs": []}}) + "\n")
    with pytest.raises(ValueError, match=r"cc.jsonl: row 2: code ground_truth has 1 inputs, 0 outputs"):
        prepare.main(["--from-jsonl", str(src), "--question-field", "q", "--answer-field", "tests",
                      "--data-source", "codecontests", "--output", str(tmp_path / "out")])
    counts = prepare.main(["--from-jsonl", str(src), "--question-field", "q", "--answer-field", "tests",
                           "--data-source", "codecontests", "--output", str(tmp_path / "out"), "--max-rows", "1"])
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]
    assert counts["train"]["written"] == 1 and json.loads(row["reward_model"]["ground_truth"]) == good
    assert row["prompt"][0]["content"] == "Add two ints.\n\n" + prepare.CODE_INSTRUCTION
    with pytest.raises(ValueError, match="--answer-field 'tests' is missing, empty or not a scalar"):
        prepare.main(["--from-jsonl", str(src), "--question-field", "q", "--answer-field", "tests",
                      "--data-source", "openai/gsm8k", "--output", str(tmp_path / "out2")])
