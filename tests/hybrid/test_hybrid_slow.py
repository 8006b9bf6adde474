"""Slow end-to-end (``pytest -m slow``): the hybrid controller on 2 simulated Ray nodes (loopback, 1 CPU each, so each
group's bundle lands on its own node): the quickstart's train group on node A (2 CPU devices, ``trainer.mesh.fsdp=2``),
its rollout group on node B (2 CPU devices, tensor-parallel 2), the Ray driver running the loop.

* 3 steps equal the single-process split-placement run on 2 + 2 devices (every non-timing metric, 1e-5; ``sync/*``
  measure two different transports and are checked on their own), every socket of the run on loopback;
* after a sync the rollout group's greedy tokens equal those of the train group's weights run in this process;
  the bytes and seconds of each sync are logged;
* SIGKILL of the rollout group's member during a step: the driver exits non-zero within 20 s naming the group, no
  process of the run is left, and the same command resumes from the checkpoint and ends equal to the uninterrupted
  run;
* one-step-off-policy (``async_training.staleness=1``) on this placement: the rollout group generates batch N+1
  while the train group updates on batch N, and the quickstart learns;
* groups of several hosts (4 nodes: the train group on 2 x 1 device, the rollout group on 2 x 1), each its own
  world of 2 processes with its own coordinator: 2 PPO steps (the critic in the train group too), equal to the
  single-process split run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from jaxrl.checkpoint import latest_complete_step
from tests.distributed.worldkit import REPO, child_env
from tests.quickstart_reference import COMMON, assert_equal_metrics, metric_rows
from tests.ray_backend.raykit import (LocalCluster, alive, driver_process, loopback, ray_process_env, require_ray,
                                      sockets, wait_gone)

pytestmark = pytest.mark.slow

STEPS = 3
KILL_S = 20  # the driver must stop every group this fast after a member dies
HYBRID = [*COMMON, "trainer.mesh.fsdp=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.launcher=ray",
          "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
          "trainer.ray.placement_timeout_s=120"]
SPLIT = [*COMMON, "trainer.mesh.fsdp=2", "trainer.placement=split", "trainer.rollout_devices=2",
         "trainer.n_gpus_per_node=4"]
MEMBER = r"hybrid: (train|rollout) group member 0 on node 127\.0\.0\.1 \(([0-9a-f]+)\), host \S+, actor pid (\d+)"


@pytest.fixture(scope="module")
def cluster(shared, tmp_path_factory):
    require_ray()
    home = tmp_path_factory.mktemp("home")
    c = LocalCluster(home, [{"num_cpus": 1}, {"num_cpus": 1}])
    c.env = {**ray_process_env(home), "RAY_ADDRESS": c.address}
    c.env.pop("JAXRL_LOCAL_DEVICE_COUNT", None)  # each group simulates its own pool's devices
    c.infra = c.pids()
    yield c
    everything = c.pids()
    c.shutdown()
    assert wait_gone(everything, 30) == [], "processes outlived the cluster"


def _run_processes(c) -> list[int]:
    """The run's processes now alive (the groups' members): new since the cluster started, less Ray's idle pool."""
    out = []
    for pid in alive(c.pids() - c.infra):
        try:
            if not " ".join(psutil.Process(pid).cmdline()).startswith("ray::IDLE"):
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _members(text: str) -> dict[str, tuple[str, int]]:
    """``{group: (Ray node id prefix, actor pid)}`` from the driver's log (the newest lines win)."""
    return {g: (node, int(pid)) for g, node, pid in re.findall(MEMBER, text)}


@pytest.fixture(scope="module")
def hybrid_run(cluster, tmp_path_factory):
    """The quickstart through the hybrid controller, 3 steps: ``(folder, stderr + stdout, sockets seen mid-run)``."""
    out = tmp_path_factory.mktemp("hybrid")
    seen = []
    with driver_process([*HYBRID, f"trainer.total_training_steps={STEPS}", f"trainer.default_local_dir={out}"],
                        cluster.env) as (proc, read):
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 900:
            if not seen and "weight sync #1 across worlds" in read()[1]:  # both groups working: every socket now
                seen = sockets(cluster.pids())
            time.sleep(0.2)
        rc = proc.wait(timeout=5)
        stdout, stderr = read()
    assert rc == 0, stderr[-5000:]
    return out, stderr + stdout, seen


@pytest.fixture(scope="module")
def split_reference(shared, tmp_path_factory):
    """The same quickstart in one process on 2 + 2 devices (``trainer.placement=split``): the metrics to equal."""
    out = tmp_path_factory.mktemp("split")
    env = {**child_env(), "JAXRL_LOCAL_DEVICE_COUNT": "4"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "jaxrl.train", *SPLIT, f"trainer.total_training_steps={STEPS}",
                           f"trainer.default_local_dir={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return metric_rows(out)


def _without_sync(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("sync/")}


def test_groups_on_two_nodes_equal_the_single_process_split_run(hybrid_run, split_reference):
    out, log, seen = hybrid_run
    members = _members(log)
    assert set(members) == {"train", "rollout"} and members["train"][0] != members["rollout"][0], members
    assert "train group data=1 x fsdp=2 x tensor=1 on devices [0, 1]" in log
    assert "rollout group data=1 x fsdp=1 x tensor=2 on devices [0, 1]" in log
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for got, want in zip(rows, split_reference):
        assert_equal_metrics(_without_sync(got), _without_sync(want))
    # each sync: the actor's whole fp32 weights once through the object store, logged with its seconds
    param_bytes = (out / "hf_model" / "model.safetensors").stat().st_size
    for r in rows[1:]:
        assert 0.9 * param_bytes < r["sync/bytes"] <= param_bytes, (r["sync/bytes"], param_bytes)
        assert r["timing_s/sync"] > 0
    assert len(re.findall(r"weight sync #\d+ across worlds: [\d.]+ MB in [\d.]+ s", log)) == STEPS
    print("hybrid syncs:", [(r["sync/bytes"], round(r["timing_s/sync"], 3)) for r in rows[1:]])
    # verl's memory keys are the train group's member's (it holds the actor, reference and AdamW state: more than the
    # driver, which holds no weights), the rollout group's and the driver's beside them
    for r in rows[1:]:
        assert r["perf/cpu_memory_used_gb"] > r["perf/driver/cpu_memory_used_gb"] > 0, r
        assert r["perf/rollout_group/cpu_memory_used_gb"] > 0
    # the members make the programs (the driver runs none): step 1 traces the update, the rollout group its sampler
    # (compile time, not the count: under CI's persistent compilation cache XLA may compile nothing)
    assert rows[1]["perf/compile_time_s"] > 0 and rows[1]["perf/rollout_group/compile_time_s"] > 0, rows[1]
    print("hybrid memory GiB (train, rollout, driver):", [(round(r["perf/cpu_memory_used_gb"], 2),
          round(r["perf/rollout_group/cpu_memory_used_gb"], 2), round(r["perf/driver/cpu_memory_used_gb"], 2))
          for r in rows[1:]])
    # the run's processes talked on loopback only (driver, members, the cluster)
    assert seen and all(loopback(local) and (not remote or loopback(remote)) for *_, local, remote in seen), seen


def test_after_a_sync_the_rollout_groups_greedy_tokens_are_the_train_groups_model(cluster, tmp_path):
    """Through the Python API in this process, with LoRA (the merged policy crosses) and the JetStream engine in the
    rollout group: one training step (update + sync), then greedy generation in the rollout group against the same
    prompts on the train group's weights, run here by the embedded sampler on one device."""
    import jax
    import numpy as np
    import ray
    from flax import nnx

    from jaxrl.config import load_config
    from jaxrl.hybrid.controller import hybrid_run as hybrid_components  # (this module's fixture is hybrid_run)
    from jaxrl.models import load_pretrained
    from jaxrl.rollout.base import SamplingParams
    from jaxrl.rollout.factory import make_rollout_engine
    from jaxrl.trainer import Trainer

    overrides = [o for o in HYBRID[2:] if not o.startswith("trainer.logger")]
    # LoRA: what crosses is the merged policy; JetStream: the rollout group's engine is the continuous-batching one
    cfg = load_config("configs/quickstart.yaml", [*overrides, "trainer.logger=[jsonl]",
                                                  "trainer.val_before_train=false",
                                                  f"trainer.default_local_dir={tmp_path}",
                                                  "trainer.total_training_steps=1",
                                                  "actor_rollout_ref.model.lora_rank=8",
                                                  "actor_rollout_ref.model.lora_alpha=16",
                                                  "actor_rollout_ref.rollout.name=jetstream"])
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        with hybrid_components(cfg) as (c, _):
            trainer = Trainer(c)
            c.reward.start()
            try:
                trainer.step = 1
                metrics = trainer.train_step()  # gen, reward, log-probs, update, sync
            finally:
                c.reward.close()
            assert metrics["sync/bytes"] > 0
            weights = ray.get(c.actor.merged_params().ref[0])  # the train group's weights now, as a host copy
            pre = load_pretrained("stories260K")
            graphdef, initial = nnx.split(pre.model)
            changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(initial))]
            assert any(changed)  # the step updated the adapters: the merged weights below are trained ones
            assert "JetStream" in c.rollout.engine_name or "jetstream" in c.rollout.engine_name.lower()
            prompts = [row["prompt_ids"] for row in c.val_rows[:6]]
            sp = SamplingParams(max_new_tokens=24, do_sample=False, n=1, seed=0)
            remote = c.rollout.generate(prompts, sp)
            local_engine = make_rollout_engine(cfg, c.model_cfg, graphdef, jax.device_put(weights, jax.devices()[0]),
                                               c.tokenizer)
            local = local_engine.generate(prompts, sp)
            np.testing.assert_array_equal(remote.response_ids, local.response_ids)
            np.testing.assert_array_equal(remote.response_mask, local.response_mask)
            np.testing.assert_allclose(remote.rollout_log_probs, local.rollout_log_probs, atol=1e-4)
            report = c.weight_sync.reports[-1]
            assert report.bytes_moved == sum(x.nbytes for x in jax.tree.leaves(weights))
            assert report.seconds > 0 and report.num_tensors == len(jax.tree.leaves(weights))
            assert report.load_s > 0
    finally:
        ray.shutdown()
    assert wait_gone(_run_processes(cluster), 30) == []


def test_a_killed_rollout_member_stops_the_run_fast_and_the_rerun_resumes_exactly(cluster, hybrid_run, tmp_path):
    args = [*HYBRID, f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
            f"trainer.default_local_dir={tmp_path}"]
    with driver_process(args, cluster.env) as (proc, read):
        t0 = time.monotonic()
        while (latest_complete_step(tmp_path) or 0) < 1:  # step 1's checkpoint is on disk: step 2 is generating
            assert proc.poll() is None, read()[1][-5000:]
            assert time.monotonic() - t0 < 900, "no checkpoint within 900 s"
            time.sleep(0.05)
        text = "".join(read())
        members = _members(text)
        os.kill(members["rollout"][1], signal.SIGKILL)
        killed_at = time.monotonic()
        rc = proc.wait(timeout=KILL_S + 60)
        took = time.monotonic() - killed_at
        stderr = read()[1]
    assert rc == 1 and took < KILL_S, (rc, took, stderr[-3000:])
    print(f"killed rollout member: driver exited {rc} after {took:.1f} s")
    assert re.search(r"jaxrl: error: the rollout group's member 0 \(node 127\.0\.0\.1 .* actor pid "
                     rf"{members['rollout'][1]}\) died", stderr), stderr[-3000:]
    assert "the newest complete checkpoint is" in stderr
    assert wait_gone([members["train"][1], members["rollout"][1], *_run_processes(cluster)], 10) == []

    with driver_process(args, cluster.env) as (proc, read):
        rc = proc.wait(timeout=900)
        stdout, stderr = read()
    assert rc == 0, stderr[-5000:]
    assert "resumed from" in stderr + stdout
    rows = metric_rows(tmp_path)
    want = metric_rows(hybrid_run[0])
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for got, expected in zip(rows, want):
        assert_equal_metrics(_without_sync(got), _without_sync(expected))
    assert wait_gone(_run_processes(cluster), 30) == []


def test_one_step_off_policy_on_the_hybrid_placement_overlaps_and_learns(cluster, tmp_path):
    steps = 12
    args = [*HYBRID, "async_training.staleness=1", f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path}"]
    with driver_process(args, cluster.env) as (proc, read):
        rc = proc.wait(timeout=1500)
        stderr = read()[1]
    assert rc == 0, stderr[-5000:]
    rows = [r for r in metric_rows(tmp_path) if r["step"] >= 1]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["async/staleness/max"] for r in rows] == [0] + [1] * (steps - 1)  # batch N+1 by the weights of N-1
    middle = rows[1:-1]
    assert all(r["perf/gen_overlap_ratio"] > 0 for r in middle), [r["perf/gen_overlap_ratio"] for r in middle]
    first = sum(r["critic/score/mean"] for r in rows[:3]) / 3
    last = sum(r["critic/score/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.15, (first, last)
    print(f"one-step-off on the hybrid placement: score first 3 {first:.3f} -> last 3 {last:.3f}, overlap ratio "
          f"{sum(r['perf/gen_overlap_ratio'] for r in middle) / len(middle):.2f}")
    assert wait_gone(_run_processes(cluster), 30) == []


PPO_STEPS = 2  # step 2 runs on the weights synced across worlds after step 1's update (CI time: 2 runs of 4 processes)
PPO = ["--config", "configs/ppo_quickstart.yaml", "critic.ppo_micro_batch_size_per_gpu=8",
       "trainer.val_before_train=false", *COMMON[2:], f"trainer.total_training_steps={PPO_STEPS}"]


def test_ppo_with_groups_of_two_hosts_each_its_own_world_equals_the_split_run(shared, tmp_path):
    """PPO (the critic in the train group too) with each group a world of 2 processes (4 nodes, 1 device each)."""
    require_ray()
    env1 = {**child_env(), "JAXRL_LOCAL_DEVICE_COUNT": "4"}
    env1.pop("RAY_ADDRESS", None)
    ref = subprocess.run([sys.executable, "-m", "jaxrl.train", *PPO, "trainer.mesh.fsdp=2", "trainer.placement=split",
                          "trainer.rollout_devices=2", "trainer.n_gpus_per_node=4",
                          f"trainer.default_local_dir={tmp_path / 'split'}"], cwd=REPO, env=env1, capture_output=True,
                         text=True, timeout=1200)
    assert ref.returncode == 0, ref.stderr[-5000:]
    split_reference = metric_rows(tmp_path / "split")
    home = tmp_path / "home"
    home.mkdir()
    c = LocalCluster(home, [{"num_cpus": 1}] * 4)
    everything: set[int] = set()
    try:
        env = {**ray_process_env(home), "RAY_ADDRESS": c.address}
        env.pop("JAXRL_LOCAL_DEVICE_COUNT", None)
        args = [*PPO, "trainer.mesh.fsdp=2", "trainer.launcher=ray", "trainer.ray.placement_timeout_s=120",
                "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.nnodes=2",
                "actor_rollout_ref.rollout.n_gpus_per_node=1", f"trainer.default_local_dir={tmp_path / 'run'}"]
        with driver_process(args, env) as (proc, read):
            rc = proc.wait(timeout=1500)
            stdout, stderr = read()
        everything = c.pids()
    finally:
        everything |= c.pids()
        c.shutdown()
    assert rc == 0, stderr[-5000:]
    for group in ("train", "rollout"):
        assert re.search(rf"hybrid: {group} group world of 2 processes, coordinator 127\.0\.0\.1:\d+", stderr), group
    nodes = re.findall(r"hybrid: \w+ group member \d on node 127\.0\.0\.1 \(([0-9a-f]+)\)", stderr)
    assert len(nodes) == 4 and len(set(nodes)) == 4, nodes  # four members, each on its own node
    assert "train group data=1 x fsdp=2 x tensor=1 on devices" in stderr
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, PPO_STEPS + 1))
    assert all("critic/vf_loss" in r for r in rows)
    for got, want in zip(rows, split_reference):
        assert_equal_metrics(_without_sync(got), _without_sync(want))
    assert wait_gone(everything, 30) == []
