"""Custom reward functions (``custom_reward_function.*``): one-line errors for unusable files, signature
checks at load, verl scorer-file adaptation, reward_kwargs pass-through, and the CLI's exit 2 before the
model loads."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.rewards import RewardManager, load_custom_reward_fn
from jaxrl.rewards.custom import CustomRewardError

REPO = Path(__file__).resolve().parents[2]


def _file(tmp_path, body: str, name: str = "my_reward.py") -> Path:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body).lstrip("\n"))
    return f


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_syntax_error_names_file_and_line(tmp_path):
    f = _file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return (1.0
    """)
    with pytest.raises(CustomRewardError) as e:
        load_custom_reward_fn(str(f))
    msg = _one_line(e)
    assert f"{f}, line 2" in msg and "SyntaxError" in msg and "never closed" in msg and "fix the file" in msg


def test_error_while_importing_names_file_line_and_exception(tmp_path):
    f = _file(tmp_path, """
        import os
        import no_such_module_jaxrl
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    with pytest.raises(CustomRewardError) as e:
        load_custom_reward_fn(str(f))
    msg = _one_line(e)
    assert f"{f}, line 2" in msg and "ModuleNotFoundError" in msg and "no_such_module_jaxrl" in msg


def test_missing_function_lists_what_the_file_defines(tmp_path):
    f = _file(tmp_path, """
        def helper(x):
            return x
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
        score_table = {}
    """)
    with pytest.raises(CustomRewardError) as e:
        load_custom_reward_fn(str(f), "score_fn")
    msg = _one_line(e)
    assert str(f) in msg and "no function 'score_fn'" in msg and "custom_reward_function.name" in msg
    assert "compute_score (line 3), helper (line 1)" in msg
    with pytest.raises(CustomRewardError, match="'score_table' but it is a dict, not"):
        load_custom_reward_fn(str(f), "score_table")
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_custom_reward_fn(str(tmp_path / "nope.py"))


@pytest.mark.parametrize("signature, problem", [
    ("(text)", "expected verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"),
    ("(data_source, solution)", "expected verl's compute_score"),
    ("(data_source, solution_str, ground_truth, tokenizer)", "its parameter 'tokenizer' has no default"),
    ("(solution_str, ground_truth, model)", "its parameter 'model' has no default"),
])
def test_signature_that_cannot_take_verls_arguments_is_refused_at_load(tmp_path, signature, problem):
    f = _file(tmp_path, f"""
        def compute_score{signature}:
            return 1.0
    """)
    with pytest.raises(CustomRewardError) as e:
        load_custom_reward_fn(str(f))
    msg = _one_line(e)
    assert f"compute_score{signature} at {f}:1 cannot be used" in msg and problem in msg


def test_verl_signature_is_called_with_verls_keywords(tmp_path):
    f = _file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str == ground_truth), "src": data_source, "info": extra_info}
        def no_extra(data_source, solution_str, ground_truth):
            return 1.0
        def kwargs_only(**kw):
            return {"score": 1.0, "keys": sorted(kw)}
    """)
    fn = load_custom_reward_fn(str(f))
    assert fn.style == "verl" and fn.pass_extra_info
    assert fn(data_source="d", solution_str="72", ground_truth="72", extra_info={"i": 1}) == {
        "score": 1.0, "src": "d", "info": {"i": 1}}
    assert not load_custom_reward_fn(str(f), "no_extra").pass_extra_info  # extra_info only where it is taken
    assert load_custom_reward_fn(str(f), "no_extra")(data_source="d", solution_str="x", ground_truth="y",
                                                     extra_info=None) == 1.0
    kw = load_custom_reward_fn(str(f), "kwargs_only")
    assert kw(data_source="d", solution_str="x", ground_truth="y", extra_info=None)["keys"] == [
        "data_source", "extra_info", "ground_truth", "solution_str"]


def test_verl_scorer_file_signature_is_adapted_and_logged(tmp_path, caplog):
    f = _file(tmp_path, """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str.endswith(ground_truth) else format_score
        def math_verify_style(model_output, ground_truth, timeout_score=0):
            return float(model_output == ground_truth)
    """)
    with caplog.at_level(logging.INFO, logger="jaxrl.rewards.custom"):
        fn = load_custom_reward_fn(str(f))
    assert fn.style == "scorer"
    assert any("scorer-file signature" in r.getMessage() and "data_source is not passed" in r.getMessage()
               for r in caplog.records)
    mgr = RewardManager(fn, num_workers=1)
    try:
        out = mgr.score(["openai/gsm8k"] * 2, ["#### 72", "#### 7"], ["72", "72"], [None, {"x": 1}])
        assert out.scores.tolist() == [1.0, 0.0] and out.num_errors == 0
    finally:
        mgr.close()
    mv = load_custom_reward_fn(str(f), "math_verify_style")  # other parameter names: positional
    assert mv.style == "scorer"
    assert mv(data_source="d", solution_str="1/2", ground_truth="1/2", extra_info=None) == 1.0


def test_reward_kwargs_pass_through_and_are_checked(tmp_path):
    f = _file(tmp_path, """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str == ground_truth else format_score
        def verl_style(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return {"score": 1.0, "kwargs": kwargs}
    """)
    fn = load_custom_reward_fn(str(f), reward_kwargs={"format_score": 0.1, "score": 2.0})
    args = dict(data_source="d", ground_truth="72", extra_info=None)
    assert (fn(solution_str="72", **args), fn(solution_str="7", **args)) == (2.0, 0.1)
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.reward_kwargs == {"format_score": 0.1, "score": 2.0} and clone(solution_str="7", **args) == 0.1
    v = load_custom_reward_fn(str(f), "verl_style", reward_kwargs={"lang": "en"})
    assert v(solution_str="x", **args)["kwargs"] == {"lang": "en"}
    with pytest.raises(CustomRewardError, match="reward_kwargs key 'temperature' is not one of its parameters"):
        load_custom_reward_fn(str(f), reward_kwargs={"temperature": 1})
    with pytest.raises(CustomRewardError, match="reward_kwargs key 'solution_str' would replace"):
        load_custom_reward_fn(str(f), "verl_style", reward_kwargs={"solution_str": "x"})


def test_batch_signature_is_checked(tmp_path):
    f = _file(tmp_path, """
        def per_item(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
        def batch(data_sources, solution_strs, ground_truths, extra_infos, **kw):
            return [1.0] * len(solution_strs)
    """)
    with pytest.raises(CustomRewardError, match=r"no parameter data_sources, solution_strs, ground_truths, "
                                                r"extra_infos; expected verl's batch signature"):
        load_custom_reward_fn(str(f), "per_item", batch=True)
    assert load_custom_reward_fn(str(f), "batch", batch=True).style == "batch"


def test_async_function_is_awaited(tmp_path):
    f = _file(tmp_path, """
        import asyncio
        async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            await asyncio.sleep(0)
            return 0.75
    """)
    mgr = RewardManager(load_custom_reward_fn(str(f)), num_workers=1)
    try:
        assert mgr.score(["d"], ["x"], ["y"], [None]).scores.tolist() == [0.75]
    finally:
        mgr.close()


def test_cli_refuses_a_bad_custom_reward_before_loading_the_model(tmp_path):
    bad = _file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return (1.0
    """, name="bad.py")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sig = _file(tmp_path, "def compute_score(text):\n    return 1.0\n", name="sig.py")
    cases = [
        (f"custom_reward_function.path={bad}", f"jaxrl: error: custom reward file {bad}, line 2: SyntaxError"),
        (f"custom_reward_function.path={sig}", f"jaxrl: error: custom reward function compute_score(text) at {sig}:1 "
                                               "cannot be used: expected verl's compute_score(data_source, "),
    ]
    for override, expected in cases:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", override,
             f"trainer.default_local_dir={out}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr  # one line, no traceback
        assert not out.exists()  # stopped before the run folder (and the model) was touched
        assert time.perf_counter() - t0 < 60
