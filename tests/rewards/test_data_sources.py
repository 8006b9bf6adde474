"""No silent zero at start: jaxrl.rewards.check_data_sources, and the scorer each data source gets."""

from __future__ import annotations

import functools
import pickle

import pytest

from jaxrl.rewards import (
    KNOWN_DATA_SOURCES,
    UnknownDataSourceError,
    check_data_sources,
    default_compute_score,
    scorer_name,
)


@pytest.mark.parametrize(
    "data_source, scorer",
    [
        ("openai/gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("math_dapo", "math_dapo"),
        ("math", "math_dapo"),  # verl dispatches the bare name "math" to math_dapo
        ("math_dapo_reasoning", "math_dapo"),
        ("aime2024", "math_dapo"),
        ("aime_2025", "math_dapo"),
        ("tinystories/sentiment", "sentiment"),
        ("openai/gsm8k_v2", None),
        ("MATH-500", None),
        ("numina_olympiads", None),  # verl's prime_math sources: not built in here
        ("", None),
        (None, None),
    ],
)
def test_scorer_name(data_source, scorer):
    assert scorer_name(data_source) == scorer


def test_known_sources_pass():
    check_data_sources(list(KNOWN_DATA_SOURCES) + ["aime24"], custom_reward=False)


def test_unknown_source_is_a_one_line_error_naming_it_the_origin_and_the_options():
    with pytest.raises(UnknownDataSourceError) as info:
        check_data_sources(
            ["openai/gsm8k", "my/dataset", "other"], custom_reward=False, origin="data.train_files=['x.parquet']"
        )
    msg = str(info.value)
    assert "\n" not in msg
    assert "'my/dataset'" in msg and "other" not in msg.split("built-in")[0]  # the first unknown one
    assert "data.train_files=['x.parquet']" in msg
    assert "openai/gsm8k" in msg and "HuggingFaceH4/MATH-500" in msg and "aime*" in msg
    assert "custom_reward_function.path" in msg
    assert isinstance(info.value, ValueError)


def test_missing_data_source_is_named():
    with pytest.raises(UnknownDataSourceError, match="data_source None"):
        check_data_sources([None], custom_reward=False)


def test_custom_reward_scores_every_source():
    check_data_sources(["my/dataset", None], custom_reward=True)


def test_checks_a_generator_lazily_up_to_the_first_unknown():
    seen = []

    def sources():
        for s in ("openai/gsm8k", "bad", "never-read"):
            seen.append(s)
            yield s

    with pytest.raises(UnknownDataSourceError, match="'bad'"):
        check_data_sources(sources(), custom_reward=False)
    assert seen == ["openai/gsm8k", "bad"]


def test_partial_with_math_verifier_pickles_and_dispatches():
    fn = pickle.loads(pickle.dumps(functools.partial(default_compute_score, math_verifier="rule")))
    assert fn(data_source="HuggingFaceH4/MATH-500", solution_str=r"\boxed{2}", ground_truth="2",
              extra_info=None)["score"] == 1.0
    # verl's extra keywords are accepted
    assert default_compute_score("openai/gsm8k", "#### 3", "3", None, sandbox_fusion_url=None)["score"] == 1.0


def test_train_exits_2_naming_an_unknown_data_source_before_loading_the_model(tmp_path):
    """`python -m jaxrl.train` on rows whose data source has no scorer (and no custom reward) stops with exit 2
    and a one-line error naming it. The model path does not exist: reaching the model load would exit 1."""
    import json
    import os
    import subprocess
    import sys

    from jaxrl.paths import REPO_ROOT

    rows = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
    rows.write_text("\n".join(json.dumps({**row, "data_source": ds}) for ds in ["openai/gsm8k", "my/set"]) + "\n")
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({**row, "data_source": "openai/gsm8k"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
            f"actor_rollout_ref.model.path={tmp_path / 'no_such_model'}",
            f"trainer.default_local_dir={tmp_path / 'out'}"]

    def run(*overrides):
        return subprocess.run([*base, *overrides], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)

    proc = run(f"data.train_files={rows}", f"data.val_files={val}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxrl: error:")]
    assert len(err) == 1 and "'my/set'" in err[0] and str(rows) in err[0], proc.stderr[-3000:]
    assert "custom_reward_function.path" in err[0] and "HuggingFaceH4/MATH-500" in err[0]
    assert "no_such_model" not in proc.stderr  # stopped before the model load
    # the validation files are checked too
    proc = run(f"data.train_files={val}", f"data.val_files={rows}")
    assert proc.returncode == 2 and "data.val_files" in proc.stderr and "'my/set'" in proc.stderr, proc.stderr[-3000:]
    # with a custom reward function the check is off: the run goes on to the (missing) model and exits 1
    custom = tmp_path / "reward.py"
    custom.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    proc = run(f"data.train_files={rows}", f"data.val_files={val}", f"custom_reward_function.path={custom}")
    assert proc.returncode == 1 and "no_such_model" in proc.stderr, proc.stderr[-3000:]
