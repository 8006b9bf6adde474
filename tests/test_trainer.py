"""Controller: the helpers of the RL step, and a short real run of the whole loop (stories260K)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from jaxrl.config.loader import load_config
from jaxrl.experience import place_scores_on_last_token
from jaxrl.trainer import run_training

REQUIRED_KEYS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr",
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
    "timing_s/update_actor", "timing_s/sync", "timing_s/step", "training/rollout_probs_diff_max",
    "reward/num_errors", "reward/num_timeouts", "perf/compile_time_s", "perf/num_compiles",
]


def test_scores_sit_on_the_last_valid_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = place_scores_on_last_token(np.array([0.5, -1.0, 2.0, 3.0], np.float32), mask)
    expected = np.zeros((4, 4), np.float32)
    expected[0, 2], expected[1, 0], expected[2, 3] = 0.5, -1.0, 2.0  # an empty response scores nothing
    np.testing.assert_array_equal(out, expected)


def test_estimator_gets_its_declared_options_and_inputs_by_name(monkeypatch):
    """The advantage phase passes exactly the options the registry entry declares (from algorithm.*) and the batch
    arrays it reads, by name; nothing is filtered by signature (an estimator taking **kwargs gets no extras)."""
    from jaxrl.algorithms import registry
    from jaxrl.batch import RLBatch
    from jaxrl.trainer import Trainer

    monkeypatch.setattr(registry.ADV_ESTIMATORS, "_entries", dict(registry.ADV_ESTIMATORS._entries))
    seen = {}

    @registry.register_adv_estimator("_test_recording", options=("gamma",), inputs=("values",))
    def recording(token_level_rewards, response_mask, group_ids, **kwargs):
        seen.update(kwargs)
        return token_level_rewards * 2, token_level_rewards + kwargs["values"]

    cfg = load_config(None, ["algorithm.adv_estimator=_test_recording", "algorithm.gamma=0.25"])
    cfg.algorithm.lam = 0.5  # not declared: never passed
    z = np.zeros((2, 3), np.int32)
    batch = RLBatch(z, z + 1, z + 3, z + 1, np.arange(2, dtype=np.int32))
    batch.token_level_rewards = np.ones((2, 3), np.float32)
    batch.values = np.full((2, 3), 0.5, np.float32)
    batch.reward_baselines = np.zeros(2, np.float32)
    fake = type("T", (), {"c": type("C", (), {"cfg": cfg})})()
    adv, ret = Trainer._advantages(fake, batch)
    assert set(seen) == {"gamma", "values"} and seen["gamma"] == 0.25
    assert seen["values"] is batch.values
    np.testing.assert_array_equal(adv, 2.0)
    np.testing.assert_array_equal(ret, 1.5)


def tiny_run_overrides(tmp_path, extra=()):
    return [
        "data.train_batch_size=4", "data.max_response_length=12", "data.val_max_samples=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path}", *extra,
    ]


def test_short_quickstart_run_writes_verl_metrics_plot_and_model(shared, tmp_path):
    cfg = load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path, ["trainer.save_freq=1"]))
    run_training(cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in REQUIRED_KEYS:
        assert key in records[-1], key
    # each phase's peak RSS (jaxrl.metrics.phase_peaks), within the step's and the process's; the save after step 1
    # is in row 2
    peak = "perf/cpu_memory_peak_gb"
    for r in records:
        phases = {k[len(peak) + 1:]: v for k, v in r.items() if k.startswith(peak + "/")}
        assert {"gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync", "step", "testing"} \
            <= set(phases), sorted(phases)
        assert all(0.05 < v <= r[peak] + 1e-6 for v in phases.values()), (phases, r[peak])
        assert all(phases[k] <= phases["step"] + 1e-6 for k in ("gen", "update_actor", "sync")), phases
    assert f"{peak}/save_checkpoint" in records[1] and f"{peak}/save_checkpoint" not in records[0]
    # step 2 finished the save of step 1 before its update (the save's host copy never overlaps the update)
    assert "timing_s/save_wait" in records[1] and "timing_s/save_wait" not in records[0]
    assert records[1]["timing_s/save_wait"] <= records[1]["timing_s/step"]
    assert "val-core/tinystories/sentiment/reward/mean@1" in records[-1]
    assert records[-1]["response_length/mean"] <= 12
    # The sampler's log-probs and the trainer's recompute agree (same weights, fp32).
    assert records[0]["training/rollout_probs_diff_max"] < 1e-3
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert (tmp_path / "hf_model" / "model.safetensors").exists()
    assert (tmp_path / "hf_model" / "config.json").exists()


def test_fresh_run_in_a_reused_folder_starts_a_fresh_metrics_file(shared, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "old": 1}\n{"step": 7, "old": 1}\n')
    run_training(load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path, ["trainer.test_freq=-1"])))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and not any("old" in r for r in records)


def test_reward_function_that_raises_or_hangs_never_stops_the_run(shared, tmp_path):
    rf = tmp_path / "bad_reward.py"
    rf.write_text(textwrap.dedent("""
        import time
        CALLS = {"n": 0}
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            CALLS["n"] += 1
            if CALLS["n"] % 3 == 0:
                raise RuntimeError("reward backend down")
            if CALLS["n"] % 5 == 0:
                time.sleep(30)
            return float(len(solution_str) % 2)
    """))
    out = tmp_path / "run"
    cfg = load_config("configs/quickstart.yaml", tiny_run_overrides(out, [
        f"custom_reward_function.path={rf}", "reward_model.timeout_s=0.5", "trainer.test_freq=-1",
    ]))
    run_training(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["reward/num_errors"] for r in records) >= 2
    assert sum(r["reward/num_timeouts"] for r in records) >= 1
    assert len(records) == 2


def test_missing_data_file_fails_before_loading_the_model(tmp_path, capsys):
    from jaxrl.train import main

    code = main(["--config", "configs/quickstart.yaml", f"data.train_files={tmp_path}/nope.parquet"])
    assert code == 1
    err = capsys.readouterr().err
    assert "nope.parquet" in err and "jaxrl.data.prepare" in err


def test_unknown_rollout_engine_is_a_clear_error():
    from types import SimpleNamespace

    from jaxrl.rollout.factory import make_rollout_engine

    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(name="sglang")))
    with pytest.raises(ValueError, match="rollout.name='sglang' is unknown; valid: jax, vllm, jetstream"):
        make_rollout_engine(cfg, None, None, None, None)


def test_vllm_without_vllm_installed_says_how_to_install():
    import importlib.util
    from types import SimpleNamespace

    from jaxrl.rollout.factory import make_rollout_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; tests/vllm_rollout covers the engine")
    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(name="vllm")))
    with pytest.raises(ValueError, match=r"needs vLLM.*setup_vllm_cpu\.sh"):
        make_rollout_engine(cfg, None, None, None, None)


@pytest.mark.parametrize("content, expected", [
    (b"not a parquet file", "unreadable parquet file"),
])
def test_unreadable_data_file_is_a_clean_error(tmp_path, capsys, content, expected):
    from jaxrl.train import main

    bad = tmp_path / "train.parquet"
    bad.write_bytes(content)
    assert main(["--config", "configs/quickstart.yaml", f"data.train_files={bad}"]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err


def test_malformed_row_names_file_and_line(tmp_path, capsys):
    from jaxrl.train import main

    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"prompt": "Once upon a time", "data_source": "tinystories/sentiment"}\n{"text": 1}\n')
    assert main(["--config", "configs/quickstart.yaml", f"data.train_files={bad}"]) == 1
    err = capsys.readouterr().err
    assert "rows.jsonl:2" in err and "skip_malformed" in err


def test_failed_weight_sync_stops_the_run_and_keeps_the_last_checkpoint(shared, tmp_path, monkeypatch, capsys):
    """A sync that fails after step 3's update: exit 1 naming the failure and the newest complete checkpoint
    (global_step_2, untouched), no checkpoint of the unsynced step, and rerunning the command resumes from it."""
    from jaxrl.checkpoint import latest_complete_step
    from jaxrl.rollout import JaxSampler
    from jaxrl.rollout.base import WeightSyncError
    from jaxrl.train import main

    real = JaxSampler.update_weights
    calls = {"n": 0}

    def failing_update(self, params):
        calls["n"] += 1
        if calls["n"] == 3:
            raise WeightSyncError("weight sync #3 into the test engine timed out (injected)")
        return real(self, params)

    monkeypatch.setattr(JaxSampler, "update_weights", failing_update)
    args = ["--config", "configs/quickstart.yaml",
            *tiny_run_overrides(tmp_path, ["trainer.test_freq=-1", "trainer.save_freq=1",
                                           "trainer.total_training_steps=4", "trainer.logger=['jsonl']"])]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "weight sync #3" in err and "timed out (injected)" in err
    assert f"{tmp_path}/global_step_2 (untouched by the failed sync)" in err
    assert latest_complete_step(tmp_path) == 2 and not (tmp_path / "global_step_3").exists()
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "global_step_2").rglob("*") if p.is_file()}

    monkeypatch.setattr(JaxSampler, "update_weights", real)
    assert main(args) == 0  # the same command resumes from step 2 and finishes
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "global_step_2").rglob("*") if p.is_file()}
    assert after == before  # kept as it was (max_to_keep keeps all here)


def test_run_without_the_old_log_prob_pass(shared, tmp_path):
    """recompute_old_log_prob=false: no old_log_prob phase, the run trains (ratio-1 on-policy updates)."""
    cfg = load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path, [
        "trainer.test_freq=-1", "actor_rollout_ref.actor.recompute_old_log_prob=false",
    ]))
    run_training(cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "timing_s/old_log_prob" not in r and "training/rollout_probs_diff_max" not in r
        assert r["actor/pg_clipfrac"] == 0.0 and r["actor/grad_norm"] > 0 and "timing_s/update_actor" in r


def _fit_built(cfg, prepare) -> list[dict]:
    """A run as run_training makes it, with ``prepare(components)`` called between the build and the trainer (to
    inspect or adjust what was built); returns the run's metrics records."""
    from jaxrl.build import build
    from jaxrl.trainer import Trainer

    c = build(cfg)
    try:
        prepare(c)
        trainer = Trainer(c)
        c.reward.start()
        try:
            trainer.fit()
        finally:
            c.reward.close()
            c.logger.close()
    finally:
        c.store.close()
        c.lock.release()
    return [json.loads(line) for line in c.logger.jsonl_path.read_text().splitlines()]


def test_selective_recompute_builds_that_policy_and_trains_like_full_recompute(shared, tmp_path):
    """actor_rollout_ref.model.recompute_granularity=selective reaches the actor's decoder (the projections kept
    through the backward) and the run's losses and gradient norms are those of the full recomputation."""
    from flax import nnx

    def fit(granularity):
        cfg = load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path / granularity, [
            "trainer.test_freq=-1", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            f"actor_rollout_ref.model.recompute_granularity={granularity}"]))

        def check_policy(c):
            model = nnx.merge(c.actor.graphdef, c.actor.params)
            assert (model.remat, model.remat_policy) == (True, granularity)

        return _fit_built(cfg, check_policy)

    full, selective = fit("full"), fit("selective")
    assert [r["step"] for r in selective] == [1, 2]
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "response_length/mean"):
        np.testing.assert_allclose([r[k] for r in selective], [r[k] for r in full], rtol=1e-4, atol=1e-7, err_msg=k)
    assert selective[0]["actor/grad_norm"] > 0


def test_each_step_releases_free_host_memory_before_reading_its_memory_metrics(shared, tmp_path, monkeypatch):
    """perf/cpu_memory_used_gb is read after glibc gave the step's freed buffers (and a finished asynchronous save's
    host copy) back to the OS (jaxrl.host_memory); without that every checkpoint save left its size resident. The
    step also trims before its update (the rollout's freed buffers under the update's temporaries)."""
    import jaxrl.trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "release_free_memory", lambda: calls.append("release"))
    real_metrics = trainer_mod.memory_metrics
    monkeypatch.setattr(trainer_mod, "memory_metrics", lambda: calls.append("metrics") or real_metrics())
    run_training(load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path, ["trainer.test_freq=-1"])))
    assert calls == ["release", "release", "metrics"] * 2  # before the update, at the step end, then the metrics
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["perf/cpu_memory_used_gb"] < 24 for r in records)
    # the first step makes the sampler's, the log-prob forward's and the update's programs: part of its step time
    # (tracing and lowering run even when a persistent compilation cache supplies the executables)
    assert isinstance(records[0]["perf/num_compiles"], int) and records[0]["perf/num_compiles"] >= 0
    assert 0 < records[0]["perf/compile_time_s"] < records[0]["timing_s/step"]


def _fit_with_bucket(cfg, bucket: int) -> list[dict]:
    """A run as run_training makes it, with the sampler's prompt widths bucketed to ``bucket`` tokens (so the short
    TinyStories prompts meet several widths)."""
    return _fit_built(cfg, lambda c: setattr(c.rollout, "prompt_length_bucket", bucket))


def test_dropping_compiled_programs_past_the_width_bound_leaves_every_metric_unchanged(shared, tmp_path):
    """trainer.max_compiled_prompt_widths=1 (jaxrl.program_budget): each new prompt width drops every compiled
    program before the update; the programs built again give the run the same numbers as keeping them."""
    extra = ["trainer.total_training_steps=3", "trainer.test_freq=-1"]
    keep = _fit_with_bucket(load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path / "keep", extra)), 4)
    drop = _fit_with_bucket(load_config("configs/quickstart.yaml", tiny_run_overrides(
        tmp_path / "drop", [*extra, "trainer.max_compiled_prompt_widths=1"])), 4)
    widths = [-(-r["prompt_length/max"] // 4) for r in keep]
    assert len(set(widths)) >= 2, widths  # the run met several widths
    assert "perf/compiled_programs_dropped" not in keep[-1]
    assert drop[-1]["perf/compiled_programs_dropped"] >= 1
    assert all("timing_s/drop_programs" in r for r in drop)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "response_length/mean", "critic/score/mean",
              "training/rollout_probs_diff_max"):
        assert [r[k] for r in drop] == [r[k] for r in keep], k
