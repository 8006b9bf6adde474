"""The quickstart on one process x 4 CPU devices (``trainer.mesh.fsdp=4``): the reference that the multi-process
runs (``jaxrl.launch``, Ray) must equal. Computed once per test session (``fsdp4_reference`` in tests/conftest.py)
and shared by tests/distributed and tests/ray_backend, which compare their first steps with its 4 steps (a run's
metrics do not depend on ``total_training_steps``: tests/distributed/test_multihost_slow.py compares a 3-step run
with these 4 steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.distributed.worldkit import REPO, child_env

# 8-row micro-batches: 2 per device on a 4-device mesh (the *_per_gpu keys count rows per device, as in verl)
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
COMMON = ["--config", "configs/quickstart.yaml", "trainer.test_freq=-1", "trainer.log_val_generations=2",
          "trainer.logger=[console,jsonl]", *MICRO]
REFERENCE_STEPS = 4
# metrics that depend on the machine and the moment, not on the computation: wall times, throughput, and memory
# (perf/cpu_memory_used_gb is the process's resident set, which differs between any two runs)
RUN_DEPENDENT = ("timing_s/", "perf/throughput", "perf/cpu_memory", "perf/max_memory", "perf/compile_time_s",
                 "perf/num_compiles",  # (a process that loads a program from the persistent cache compiles none)
                 "perf/rollout_group/", "perf/driver/")  # (the hybrid controller's groups' and driver's memory)


def metric_rows(folder: Path) -> list[dict]:
    """``metrics.jsonl`` of a run folder, one dict per row."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def val_lines(folder: Path) -> list[dict]:
    """``val_generations.jsonl`` of a run folder, one dict per line."""
    return [json.loads(line) for line in (folder / "val_generations.jsonl").read_text().splitlines()]


# The sampler-vs-trainer mismatch metrics (jaxrl.metrics.rollout_mismatch_metrics) measure float32 noise: the
# difference between the sampler's and the trainer's log-probs of the same tokens under the same weights, 1e-6-1e-5
# per token. Two runs whose updates reduce in a different order (one process of 4 devices vs 2 x 2, gloo) hold
# weights that differ in the last bits after the first update, so the extremes of that noise move by about its own
# size (rollout_is_min 0.999977 vs 0.999987 at step 2). They are held to agree within 1e-4 absolute, which a real
# mismatch (stale or wrong weights in the sampler: ratios off by 1e-3 and more) still breaks; every loss, gradient
# norm, log-prob and reward metric keeps the 1e-5 bound. (With async staleness the rollout_corr/ ratios also carry
# the policy lag, which 1e-4 still pins.)
FLOAT_NOISE = ("rollout_corr/", "training/rollout_probs_diff_")
FLOAT_NOISE_ATOL = 1e-4


def assert_equal_metrics(got: dict, want: dict) -> None:
    """Every non-timing metric of ``want`` equal in ``got`` within 1e-5 (relative to max(1, |value|)); the
    mismatch metrics of :data:`FLOAT_NOISE` within :data:`FLOAT_NOISE_ATOL` (absolute)."""
    bad = []
    for key, value in want.items():
        if key.startswith(RUN_DEPENDENT) \
                or not isinstance(value, (int, float)):
            continue
        tol = FLOAT_NOISE_ATOL if key.startswith(FLOAT_NOISE) else 1e-5 * max(1.0, abs(value))
        if key not in got:
            bad.append(f"{key} missing")
        elif abs(got[key] - value) > tol:
            bad.append(f"{key}: {got[key]} != {value}")
    assert not bad, f"step {want.get('step')}: {bad}"


def run_reference(out: Path) -> tuple[list[dict], list[dict]]:
    """Run the 1 x 4 quickstart for :data:`REFERENCE_STEPS` steps into ``out``; its metric rows (step 0 = the
    validation before training) and its ``val_generations.jsonl`` lines (only that validation: test_freq=-1)."""
    env = {**child_env(), "JAXRL_LOCAL_DEVICE_COUNT": "4"}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-m", "jaxrl.train", *COMMON, "trainer.mesh.fsdp=4", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=4", f"trainer.total_training_steps={REFERENCE_STEPS}",
            f"trainer.default_local_dir={out}"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(REFERENCE_STEPS + 1))
    val = val_lines(out)
    assert val and {v["step"] for v in val} == {0}
    return rows, val
