"""Slow end-to-end (``pytest -m slow``): the quickstart (real stories260K, built-in prompts, sentiment reward) through
the Ray launcher on simulated Ray nodes (all on 127.0.0.1), against the single-process 4-device run.

* 2 CPU nodes x 2 devices, 3 steps: every non-timing metric equals the 1 x 4 run's (1e-5), one writer;
* SIGKILL of one host's actor in the middle of a step: the driver exits non-zero within 20 s, no actor or host
  process is left; the same command with ``trainer.max_restarts=1`` resumes from that run's checkpoint, loses an
  actor again mid-step, restarts the group itself and finishes equal to the uninterrupted run;
* ``ray start --head --block`` (a child of the test) + a second node, ``ray job submit --working-dir . -- python -m
  jaxrl.train ... trainer.nnodes=2`` ends SUCCEEDED (``ray job submit`` exits 0); a job whose training fails (a
  malformed data file) makes ``ray job submit`` exit non-zero;
* a simulated TPU slice (2 Ray nodes carrying ``TPU: 4``, the ``ray.io/tpu-*`` labels and ``TPU_NAME``, as on a
  v4-16 slice; Ray's ``ray.util.tpu.SlicePlacementGroup`` places the hosts): ranks follow the TPU worker ids, one
  world of 8 devices runs 2 quickstart steps.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jaxrl.checkpoint import latest_complete_step
from tests.distributed.worldkit import REPO
from tests.quickstart_reference import COMMON
from tests.quickstart_reference import assert_equal_metrics as _assert_equal_metrics
from tests.quickstart_reference import metric_rows as _rows
from tests.ray_backend.raykit import (CliHead, LocalCluster, alive, driver_process, ray_process_env, require_ray,
                                      wait_gone)

pytestmark = pytest.mark.slow

TWO_HOSTS = [*COMMON, "trainer.mesh.fsdp=4", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
             "trainer.ray.placement_timeout_s=120"]
STEPS = 3
KILL_S = 20  # the driver must end the group this fast after an actor dies


@pytest.fixture
def reference(fsdp4_reference) -> list[dict]:
    """The single-process 4-device run's metric rows of steps 0..STEPS (step 0 = the validation before training;
    the 4-step reference is shared with tests/distributed)."""
    return fsdp4_reference[0][: STEPS + 1]


@pytest.fixture(scope="module")
def cluster(shared, tmp_path_factory):
    """Two CPU-only Ray nodes (one CPU each): the launcher's bundles are ``{CPU: 1}``, one per node."""
    require_ray()
    home = tmp_path_factory.mktemp("home")
    c = LocalCluster(home, [{"num_cpus": 1}, {"num_cpus": 1}])
    c.env = {**ray_process_env(home), "RAY_ADDRESS": c.address, "JAXRL_LOCAL_DEVICE_COUNT": "2"}
    c.infra = c.pids()
    yield c
    everything = c.pids()
    c.shutdown()
    left = wait_gone(everything, 30)
    assert left == [], f"processes outlived the cluster: {left}"


def _actor_pid(stderr: str, rank: int) -> int | None:
    pids = re.findall(rf"jaxrl: ray: rank {rank} on node \S+ \(\S+, actor pid (\d+)\)", stderr)
    return int(pids[-1]) if pids else None  # the newest group's


def _run_processes(c) -> list[int]:
    """The run's processes now alive (actors, hosts' processes, their helpers): everything new since the cluster
    started, less Ray's idle worker pool."""
    out = []
    for pid in alive(c.pids() - c.infra):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if not cmd.startswith("ray::IDLE"):
            out.append(pid)
    return out


def test_quickstart_through_ray_equals_one_process_with_one_writer(reference, cluster, tmp_path):
    with driver_process([*TWO_HOSTS, f"trainer.total_training_steps={STEPS}", f"trainer.default_local_dir={tmp_path}"],
                        cluster.env) as (proc, read):
        rc = proc.wait(timeout=1500)
        stdout, stderr = read()
    assert rc == 0, stderr[-5000:]
    assert "jaxrl: ray: placed 2 host(s) x {CPU: 1}" in stderr
    assert re.search(r"^\[rank 0\] .*jaxrl INFO done in", stderr, re.M)  # the hosts' logs, prefixed by rank
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # one writer: each step once
    for got, want in zip(rows, reference):
        _assert_equal_metrics(got, want)
    assert (tmp_path / "hf_model" / "model.safetensors").is_file()
    assert wait_gone(_run_processes(cluster), 30) == []


def _kill_rank1_actor_after(step: int, folder: Path, proc, read) -> float:
    """Wait until checkpoint ``step`` is complete (the next step is running), SIGKILL rank 1's actor; returns when."""
    t0 = time.monotonic()
    while (latest_complete_step(folder) or 0) < step:
        assert proc.poll() is None, read()[1][-5000:]
        assert time.monotonic() - t0 < 1200, f"no checkpoint {step} within 1200 s"
        time.sleep(0.2)
    pid = _actor_pid(read()[1], 1)
    assert pid is not None, read()[1][-3000:]
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def test_a_killed_actor_ends_the_run_and_max_restarts_resumes_it(reference, cluster, tmp_path):
    args = [*TWO_HOSTS, f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
            f"trainer.default_local_dir={tmp_path}"]
    with driver_process(args, cluster.env) as (proc, read):
        killed_at = _kill_rank1_actor_after(1, tmp_path, proc, read)
        rc = proc.wait(timeout=KILL_S + 60)
        took = time.monotonic() - killed_at
        stderr = read()[1]
    assert rc != 0 and took < KILL_S, (rc, took, stderr[-3000:])
    assert re.search(r"jaxrl: error: rank 1's Ray actor on node 127\.0\.0\.1 .* died", stderr), stderr[-3000:]
    assert wait_gone(_run_processes(cluster), 10) == []  # no actor, host process or helper is left

    # the same command, allowed one restart: it resumes from step 1, loses rank 1's actor again during step 3,
    # restarts the group from checkpoint 2 and finishes
    with driver_process([*args, "trainer.max_restarts=1"], cluster.env) as (proc, read):
        _kill_rank1_actor_after(2, tmp_path, proc, read)
        rc = proc.wait(timeout=1500)
        stderr = read()[1]
    assert rc == 0, stderr[-5000:]
    assert "jaxrl: ray: restarting the group (1 of 1) from the newest checkpoint" in stderr
    assert stderr.count("resumed from") >= 2, stderr[-5000:]  # the rerun, and the restart
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for got, want in zip(rows, reference):
        _assert_equal_metrics(got, want)
    assert wait_gone(_run_processes(cluster), 30) == []


def submit_job(cmd: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """``ray job submit``, submitted again while Ray refuses it with "No available agent to submit job, please try
    again later" (the head's job agent starts after the dashboard answers; nothing runs from a refused submission)."""
    deadline = time.monotonic() + 120
    while True:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        refused = "No available agent to submit job" in done.stdout + done.stderr
        if done.returncode == 0 or not refused or time.monotonic() > deadline:
            return done
        time.sleep(3)


def test_ray_job_submit_runs_the_verl_style_command_and_reports_a_failed_training(shared, tmp_path):
    require_ray()
    home = tmp_path / "home"
    home.mkdir()
    env = ray_process_env(home)
    head = CliHead(home, env, tmp_path / "head.log")
    try:
        head.add_node(num_cpus=1)
        submit = ["ray", "job", "submit", f"--address={head.dashboard_url}", "--working-dir", ".", "--"]
        train = [sys.executable, "-m", "jaxrl.train", *COMMON, "trainer.mesh.fsdp=4", "trainer.nnodes=2",
                 "trainer.n_gpus_per_node=2", "trainer.distributed.local_device_count=2",
                 "trainer.total_training_steps=1", "trainer.val_before_train=false"]
        ok = submit_job([*submit, *train, f"trainer.default_local_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                        timeout=1200)
        assert ok.returncode == 0, (ok.stdout[-5000:], ok.stderr[-3000:])
        assert re.search(r"Job 'raysubmit_\w+' succeeded", ok.stdout + ok.stderr)
        assert "jaxrl: ray: placed 2 host(s) x {CPU: 1}" in ok.stdout + ok.stderr  # the job log, streamed
        assert [r["step"] for r in _rows(tmp_path / "run")] == [1]

        bad = tmp_path / "broken.jsonl"
        bad.write_text('{"prompt": "unterminated\n')
        failed = submit_job([*submit, *train, f"data.train_files={bad}", f"data.val_files={bad}",
                             f"trainer.default_local_dir={tmp_path / 'failed'}"], cwd=REPO, env=env, timeout=600)
        text = failed.stdout + failed.stderr
        assert failed.returncode != 0, text[-5000:]
        assert re.search(r"Job 'raysubmit_\w+' failed", text), text[-3000:]
        assert re.search(r"jaxrl: error: rank \d on node 127\.0\.0\.1 .* exited with status 1", text), text[-3000:]
    finally:
        left = head.shutdown()
    assert left == [], f"processes outlived the cluster: {left}"


def test_a_simulated_tpu_slice_forms_one_world_and_trains(shared, tmp_path):
    require_ray()
    home = tmp_path / "home"
    home.mkdir()

    def tpu_host(worker: int) -> dict[str, str]:  # what a v4-16 slice's hosts carry (GKE's variables)
        return {"TPU_NAME": "jaxrl-sim-slice", "TPU_WORKER_ID": str(worker), "TPU_ACCELERATOR_TYPE": "v4-16",
                "TPU_TOPOLOGY": "2x2x2"}

    # the head is the slice's worker 1: ranks must follow the worker ids, not the order the nodes joined
    c = LocalCluster(home, [{"num_cpus": 1, "resources": {"TPU": 4}}] * 2, [tpu_host(1), tpu_host(0)])
    everything: set[int] = set()
    try:
        env = {**ray_process_env(home), "RAY_ADDRESS": c.address, "JAXRL_LOCAL_DEVICE_COUNT": "4"}
        args = [*COMMON, "trainer.mesh.fsdp=8", "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'run'}"]
        with driver_process(args, env) as (proc, read):
            rc = proc.wait(timeout=1500)
            stderr = read()[1]
        assert rc == 0, stderr[-5000:]
        assert "jaxrl: ray: placed 2 host(s) x {CPU: 1, TPU: 4} (TPU v4 2x2x2 slice)" in stderr
        import ray

        ray.init(address=c.address, log_to_driver=False)
        try:
            worker_of = {n["NodeID"]: n["Labels"]["ray.io/tpu-worker-id"] for n in ray.nodes()}
        finally:
            ray.shutdown()
        ranks = dict(re.findall(r"jaxrl: ray: rank (\d) on node .*, Ray node ([0-9a-f]+)", stderr))
        assert {r: worker_of[n] for r, n in ranks.items()} == {"0": "0", "1": "1"}
        # trainer.mesh.fsdp=8 over 2 processes x 4 devices: the hosts check nnodes / n_gpus_per_node against the
        # world jax reports, and the mesh needs all 8 devices, so training at all means one world of 8
        assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1, 2]
        everything = c.pids()
    finally:
        everything |= c.pids()
        c.shutdown()
    assert wait_gone(everything, 30) == []
