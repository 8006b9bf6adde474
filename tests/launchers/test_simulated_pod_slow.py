"""Simulated pod (`pytest -m slow`): a fake v4-32 (4 hosts x 2 CPU devices) driven by the real launcher.

- `test_fake_v4_32_forms_one_jax_world`: up, sync of this checkout, run of tests/launchers/world_check.py on
  every host: the 4 processes form one JAX world (process_count 4, device_count 8) whose psum is right, and
  the pod is deleted at the end. Needs nothing of issue 15 (the program joins the world itself).
- `test_quickstart_on_fake_pod_matches_local_launcher`: the quickstart for 2 steps through the launcher on the
  fake v4-32 and through `python -m jaxrl.launch --nproc 4 --local-devices 2` give the same non-timing metrics.
  On a real pod the hosts would pass `trainer.distributed.mode=auto` (jax reads the TPU metadata); the fake has
  no metadata server, so it gives each host the JAXRL_* env contract instead and the hosts pass
  `trainer.distributed.mode=env` (the launcher refuses a multi-host program that sets no mode).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launchers.conftest import REPO, pod_args
from tests.quickstart_reference import RUN_DEPENDENT

pytestmark = pytest.mark.slow


def _up_and_sync(fake_pod, accel: str) -> None:
    assert fake_pod.launch("up", *pod_args(accel)).returncode == 0
    sync = fake_pod.launch("sync", *pod_args(accel), "--source", str(REPO), "--install", "true", timeout=120)
    assert sync.returncode == 0, sync.stderr


def test_fake_v4_32_forms_one_jax_world(fake_pod):
    _up_and_sync(fake_pod, "v4-32")
    t0 = time.monotonic()
    r = fake_pod.launch("run", *pod_args("v4-32"), "--", "python", "tests/launchers/world_check.py", timeout=180)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = {}
    for line in r.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            seen[prefix] = json.loads(rest)
    print(f"4 hosts x 2 devices formed one world; run took {wall:.1f} s")
    assert sorted(seen) == ["[w0]", "[w1]", "[w2]", "[w3]"]
    assert sorted(v["process_index"] for v in seen.values()) == [0, 1, 2, 3]
    for host, v in seen.items():
        assert int(host[2]) == v["process_index"]       # worker i is JAX process i
        assert (v["process_count"], v["device_count"], v["local_device_count"]) == (4, 8, 2)
        assert v["psum"] == sum(range(1, 9))             # 36: every device's value crossed every host
    assert fake_pod.calls()[-1][3:5] == ["tpu-vm", "delete"]
    assert fake_pod.wait_no_leftovers() == []


QUICKSTART = ["--config", "configs/quickstart.yaml", "trainer.total_training_steps=2", "trainer.val_before_train=false",
              "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.mesh.fsdp=8",
              "trainer.nnodes=4", "trainer.n_gpus_per_node=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]


def _metrics(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(RUN_DEPENDENT)} for r in rows]


def test_quickstart_on_fake_pod_matches_local_launcher(fake_pod, shared, tmp_path):
    storage = tmp_path / "shared-storage"
    storage.mkdir()
    _up_and_sync(fake_pod, "v4-32")
    pod_out = storage / "pod"
    r = fake_pod.launch("run", *pod_args("v4-32"), "--shared-storage", str(storage), "--env", f"JAXRL_SHARED={shared}",
                        "--", "python", "-m", "jaxrl.train", *QUICKSTART, f"trainer.default_local_dir={pod_out}",
                        "trainer.distributed.mode=env", timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert fake_pod.calls()[-1][3:5] == ["tpu-vm", "delete"]
    assert fake_pod.wait_no_leftovers() == []

    local_out = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    local = subprocess.Popen([sys.executable, "-m", "jaxrl.launch", "--nproc", "4", "--local-devices", "2", "--",
                              *QUICKSTART, f"trainer.default_local_dir={local_out}"], cwd=REPO,
                             env={**env, "PYTHONPATH": str(REPO), "JAXRL_SHARED": str(shared)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = local.communicate(timeout=1500)
    finally:
        if local.poll() is None:
            os.killpg(local.pid, signal.SIGKILL)   # the local launcher and its 4 processes
            local.wait()
    assert local.returncode == 0, err[-4000:]

    pod_rows, local_rows = _metrics(pod_out / "metrics.jsonl"), _metrics(local_out / "metrics.jsonl")
    assert [r["step"] for r in pod_rows] == [r["step"] for r in local_rows] == [1, 2]
    for a, b in zip(pod_rows, local_rows):
        assert sorted(a) == sorted(b)
        for k in a:
            if isinstance(a[k], (int, float)):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), k
            else:
                assert a[k] == b[k], k
    assert (pod_out / "hf_model").is_dir()
