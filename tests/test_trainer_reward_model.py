"""Reward model in the RL step: how RM and rule scores combine (verl's ``replace``, and ``sum``), and quickstart
runs with a tiny random ``LlamaForSequenceClassification`` (stories260K-sized, with its tokenizer) that log both."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.batch import RLBatch
from jaxrl.config.loader import load_config
from jaxrl.rewards.manager import RewardManager
from jaxrl.experience import score_with_reward_model
from jaxrl.trainer import run_training
from jaxrl.workers.reward_model import RewardModelOutput


class FixedRM:
    """Stands in for the RM role (the unit under test is the combination): fixed scores, records its inputs."""

    retokenizes = True

    def __init__(self, scores):
        self.scores = np.asarray(scores, np.float32)
        self.raw_prompts = None

    def score(self, batch, raw_prompts=None):
        self.raw_prompts = raw_prompts
        return RewardModelOutput(self.scores[: batch.size], num_truncated=1)


def _batch(n):
    z = np.zeros((n, 2), np.int32)
    return RLBatch(z, z + 1, z + 3, z + 1, np.arange(n, dtype=np.int32))


ROWS = [
    {"data_source": "d", "prompt": "p0", "reward_model": {"style": "rule", "ground_truth": "1"}},
    {"data_source": "d", "prompt": "p1", "reward_model": {"style": "model", "ground_truth": None}},
    {"data_source": "d", "prompt": "p2"},  # no style: a rule row
]


def _rule_manager(calls):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        return {"score": float(len(solution_str)), "acc": 1.0}

    return RewardManager(compute_score, timeout_s=5.0, num_workers=0)  # in-process: the closure records calls


def test_replace_is_verls_rm_score_and_rule_rows_are_scored_for_the_log():
    calls, metrics = [], {}
    rm = FixedRM([0.5, -1.0, 2.0])
    out = score_with_reward_model(rm, _rule_manager(calls), ROWS, np.array([0, 1, 2]), _batch(3), ["a", "bb", "ccc"],
                                  metrics, combine="replace", prompt_key="prompt")
    np.testing.assert_array_equal(out.scores, [0.5, -1.0, 2.0])  # the reward is the RM's
    assert sorted(calls) == ["a", "ccc"]  # the style=model row never reaches the rule function
    assert out.extra["acc"] == [1.0, None, 1.0] and out.num_errors == 0
    assert metrics["reward/rm_score/mean"] == pytest.approx(0.5) and metrics["reward/rm_score/min"] == -1.0
    assert metrics["reward/rule_score/mean"] == pytest.approx(2.0)  # len("a"), len("ccc")
    assert metrics["reward/rm_num_truncated"] == 1 and rm.raw_prompts == ["p0", "p1", "p2"]


def test_sum_adds_rule_to_rm_for_every_row():
    calls, metrics = [], {}
    out = score_with_reward_model(FixedRM([0.5, -1.0, 2.0, 0.0]), _rule_manager(calls), ROWS, np.array([0, 1, 2, 0]),
                                  _batch(4), ["a", "bb", "ccc", "dddd"], metrics, combine="sum", prompt_key="prompt")
    np.testing.assert_allclose(out.scores, [1.5, 1.0, 5.0, 4.0])
    assert len(calls) == 4 and metrics["reward/rule_score/max"] == 4.0


def test_only_model_rows_call_no_rule_function():
    calls, metrics = [], {}
    out = score_with_reward_model(FixedRM([3.0, 4.0]), _rule_manager(calls), ROWS, np.array([1, 1]), _batch(2),
                                  ["x", "y"], metrics, combine="replace", prompt_key="prompt")
    np.testing.assert_array_equal(out.scores, [3.0, 4.0])
    assert calls == [] and "reward/rule_score/mean" not in metrics and out.extra == {}


# ---------------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def tiny_rm_dir(shared, tmp_path_factory):
    """A random LlamaForSequenceClassification shaped like stories260K, saved with the stories260K tokenizer."""
    import torch
    import transformers

    src = shared / "models" / "stories260K"
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"], num_labels=1, pad_token_id=0,
               num_hidden_layers=2)
    cfg.pop("torch_dtype", None)
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForSequenceClassification.from_config(hf_cfg)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # O(1) scores that differ between responses
    d = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(d)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(d)
    return d


def _run(tmp_path, extra):
    overrides = [
        "data.train_batch_size=4", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path}", "reward_model.enable=True", *extra,
    ]
    run_training(load_config("configs/quickstart.yaml", overrides))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~45 s of CPU on 2 cores (policy + RM compiles): over the default suite's 20 s budget
def test_quickstart_with_a_reward_model_logs_rm_and_rule_scores(shared, tiny_rm_dir, tmp_path):
    """verl's defaults: input_tokenizer = the policy path (re-tokenized text), combine=replace: the score the
    advantages see is the RM's, the sentiment rule is logged beside it."""
    records = _run(tmp_path, [f"reward_model.model.path={tiny_rm_dir}", "reward_model.micro_batch_size_per_gpu=4"])
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("reward/rm_score/mean", "reward/rm_score/max", "reward/rule_score/mean",
                    "reward/rm_num_truncated", "critic/score/mean"):
            assert key in r, key
        assert r["reward/rm_score/max"] > r["reward/rm_score/min"]  # a real model: scores differ
        assert r["critic/score/mean"] == pytest.approx(r["reward/rm_score/mean"], abs=1e-5)
        assert r["reward/num_errors"] == 0 and r["reward/rm_num_truncated"] == 0


@pytest.mark.slow
def test_remax_quickstart_with_a_reward_model_summed_with_the_rule_on_policy_tokens(shared, tiny_rm_dir, tmp_path):
    """combine=sum on the policy's own ids; ReMax also scores its greedy baseline with the RM."""
    records = _run(tmp_path, [f"reward_model.model.path={tiny_rm_dir}", "reward_model.model.input_tokenizer=null",
                              "reward_model.combine=sum", "algorithm.adv_estimator=remax"])
    for r in records:
        assert "reward/rm_num_truncated" not in r  # the policy's own ids, nothing re-tokenized
        total = r["reward/rm_score/mean"] + r["reward/rule_score/mean"]
        assert r["critic/score/mean"] == pytest.approx(total, abs=1e-5)


def test_a_checkpoint_that_is_no_reward_model_exits_2_naming_the_key(shared, tmp_path):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", "reward_model.enable=True",
           "reward_model.model.path=stories260K", f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxrl: config error: reward_model.model.path='stories260K'") and "LlamaForCausalLM" in last
    assert "LlamaForSequenceClassification" in last and "Traceback" not in proc.stderr


def test_builder_picks_the_input_path_and_refuses_another_vocabulary(shared, tiny_rm_dir, tmp_path):
    import shutil

    from jaxrl.config.loader import ConfigError
    from jaxrl.models import load_pretrained
    from jaxrl.workers.reward_model import build_reward_model_worker
    from sharding import make_mesh

    policy = load_pretrained("stories260K")
    base = ["reward_model.enable=True", f"reward_model.model.path={tiny_rm_dir}"]
    rm = build_reward_model_worker(load_config("configs/quickstart.yaml", base), policy.config, policy.tokenizer)
    assert rm.retokenizes and rm.input_tokenizer is policy.tokenizer  # input_tokenizer = the policy path
    same = load_config("configs/quickstart.yaml", base + ["reward_model.model.input_tokenizer=null",
                                                          "reward_model.micro_batch_size_per_gpu=2"])
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rm = build_reward_model_worker(same, policy.config, policy.tokenizer, mesh=mesh)
    assert not rm.retokenizes and rm.mesh is mesh
    # micro_batch_size_per_gpu is per device, as in verl: 2 rows on each of data 2 x fsdp 2 = 8 rows per call
    assert rm.micro_batch_size == 8
    assert build_reward_model_worker(same, policy.config, policy.tokenizer).micro_batch_size == 2
    other = tmp_path / "rm_other_tokenizer"
    shutil.copytree(tiny_rm_dir, other)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (other / f).unlink(missing_ok=True)
    shutil.copy(shared / "models" / "smollm2-135m-instruct" / "tokenizer.json", other / "tokenizer.json")
    shutil.copy(shared / "models" / "smollm2-135m-instruct" / "tokenizer_config.json", other / "tokenizer_config.json")
    cfg = load_config("configs/quickstart.yaml", ["reward_model.enable=True", f"reward_model.model.path={other}",
                                                  "reward_model.model.input_tokenizer=null"])
    with pytest.raises(ConfigError, match="different tokenizer than the policy"):
        build_reward_model_worker(cfg, policy.config, policy.tokenizer)
