"""The Ray launcher's pure parts (no Ray needed): which launcher a config asks for, what it requires of the config,
the host rank order, the bundle resources and the TPU slice a cluster's labels describe."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.ray_backend import check_ray_launch, resolve_launcher
from jaxrl.ray_backend.pool import bundle_for, pick_resource, rank_order, tpu_slice_of
from tests.distributed.worldkit import REPO

MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
TWO_HOSTS = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.mesh.fsdp=4", *MICRO]


@pytest.fixture
def no_world(monkeypatch):
    for name in ("RAY_ADDRESS", "JAXRL_COORDINATOR_ADDRESS", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID",
                 "JAXRL_LOCAL_DEVICE_COUNT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_launcher_is_the_key_else_ray_exactly_when_ray_address_is_set():
    assert resolve_launcher(None, {}) == "local"
    assert resolve_launcher(None, {"RAY_ADDRESS": "  "}) == "local"
    assert resolve_launcher(None, {"RAY_ADDRESS": "127.0.0.1:6379"}) == "ray"  # what `ray job submit` sets
    assert resolve_launcher("local", {"RAY_ADDRESS": "127.0.0.1:6379"}) == "local"
    assert resolve_launcher("ray", {}) == "ray"
    # a process given a world to join (python -m jaxrl.launch, the Ray hosts) is never a driver
    assert resolve_launcher(None, {"RAY_ADDRESS": "127.0.0.1:6379"}, member=True) == "local"
    with pytest.raises(ConfigError, match=r"trainer.launcher='slurm' is invalid; expected one of 'local', 'ray'"):
        resolve_launcher("slurm", {})


def test_loading_resolves_the_launcher_from_ray_address(no_world):
    assert load_config("configs/quickstart.yaml").trainer.launcher == "local"
    no_world.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    # verl's multi-node command line, unchanged: the driver will form a world of 2 processes x 2 devices
    cfg = load_config("configs/quickstart.yaml", TWO_HOSTS)
    assert cfg.trainer.launcher == "ray" and cfg.trainer.nnodes == 2
    assert load_config("configs/quickstart.yaml", ["trainer.launcher=local"]).trainer.launcher == "local"


def test_the_ray_launcher_checks_the_world_it_will_form_before_placing_anything(no_world):
    ray = ["trainer.launcher=ray"]
    with pytest.raises(ConfigError, match="a run of 2 processes needs a train mesh"):
        load_config("configs/quickstart.yaml", [*ray, "trainer.nnodes=2", "trainer.n_gpus_per_node=2", *MICRO])
    with pytest.raises(ConfigError, match="trainer.placement='split' is not supported with 2 processes"):
        load_config("configs/quickstart.yaml", [*ray, *TWO_HOSTS, "trainer.placement=split",
                                                "trainer.rollout_devices=2", "trainer.mesh.fsdp=2"])
    no_world.setenv("JAXRL_LOCAL_DEVICE_COUNT", "4")  # CPU hosts of 4 devices, but 2 per node asked
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node=2 but each of the 2 processes has 4 local"):
        load_config("configs/quickstart.yaml", [*ray, *TWO_HOSTS])


def test_the_ray_launcher_refuses_a_world_described_another_way(no_world):
    with pytest.raises(ConfigError, match=r"trainer.launcher=ray forms the world itself .* "
                                          r"trainer.distributed.mode='auto'"):
        load_config("configs/quickstart.yaml", ["trainer.launcher=ray", *TWO_HOSTS, "trainer.distributed.mode=auto"])
    no_world.setenv("JAXRL_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    no_world.setenv("JAXRL_NUM_PROCESSES", "2")
    no_world.setenv("JAXRL_PROCESS_ID", "0")
    with pytest.raises(ConfigError, match=r"JAXRL_COORDINATOR_ADDRESS='127.0.0.1:1234'"):
        load_config("configs/quickstart.yaml", ["trainer.launcher=ray", *TWO_HOSTS])


def test_restarts_need_the_ray_launcher(no_world):
    with pytest.raises(ConfigError, match=r"trainer.max_restarts=1 needs trainer.launcher=ray"):
        load_config("configs/quickstart.yaml", ["trainer.max_restarts=1"])
    assert load_config("configs/quickstart.yaml", ["trainer.launcher=ray", "trainer.max_restarts=1"]) \
        .trainer.max_restarts == 1


@pytest.mark.parametrize("override, message", [
    ("trainer.max_restarts=-1", "trainer.max_restarts=-1 is invalid; expected an int >= 0"),
    ("trainer.ray.resource=NPU", "trainer.ray.resource='NPU' is invalid; expected one of 'auto', 'GPU', 'TPU', 'CPU'"),
    ("trainer.ray.placement_timeout_s=0", "trainer.ray.placement_timeout_s=0 is invalid; expected an int >= 1"),
    ("trainer.ray.tpu_topology=big", "trainer.ray.tpu_topology='big' is invalid; expected a TPU topology"),
])
def test_bad_launcher_keys_are_one_line_errors(no_world, override, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_process_given_a_world_is_a_plain_member_of_it(no_world):
    """What each Ray host runs (the driver's arguments + trainer.launcher=local, with the JAXRL_* contract), and a
    process of python -m jaxrl.launch in a shell that has RAY_ADDRESS set: members, not drivers."""
    no_world.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    no_world.setenv("JAXRL_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    no_world.setenv("JAXRL_NUM_PROCESSES", "2")
    no_world.setenv("JAXRL_PROCESS_ID", "1")
    cfg = load_config("configs/quickstart.yaml", [*TWO_HOSTS, "trainer.launcher=ray", "trainer.max_restarts=2",
                                                  "trainer.launcher=local", "trainer.max_restarts=0"])
    assert cfg.trainer.launcher == "local"
    assert load_config("configs/quickstart.yaml", TWO_HOSTS).trainer.launcher == "local"


def test_check_ray_launch_leaves_a_local_one_process_run_alone():
    from jaxrl.distributed import WorldSpec

    cfg = load_config("configs/quickstart.yaml", ["trainer.launcher=local"])
    check_ray_launch(cfg, WorldSpec(), environ={})


def test_ranks_follow_the_tpu_worker_id_else_the_node_ip_then_the_node_id():
    hosts = [{"node_ip": "10.0.0.10", "node_id": "b", "tpu_worker_id": None},
             {"node_ip": "10.0.0.9", "node_id": "z", "tpu_worker_id": None},
             {"node_ip": "10.0.0.10", "node_id": "a", "tpu_worker_id": None}]
    assert rank_order(hosts) == [1, 2, 0]  # 10.0.0.9 < 10.0.0.10 numerically (not as text), then node id
    assert rank_order(list(reversed(hosts))) == [1, 0, 2]  # the same nodes, the same ranks, whatever the order
    tpu = [{"node_ip": "10.0.0.1", "node_id": "a", "tpu_worker_id": 1},
           {"node_ip": "10.0.0.2", "node_id": "b", "tpu_worker_id": 0}]
    assert rank_order(tpu) == [1, 0]  # process ids follow the slice's worker ids


def test_bundles_hold_the_hosts_accelerators():
    assert pick_resource("auto", {"CPU": 8, "GPU": 16}) == "GPU"
    assert pick_resource("auto", {"CPU": 8, "GPU": 0, "TPU": 8}) == "TPU"
    assert pick_resource("auto", {"CPU": 8}) == "CPU"
    assert pick_resource("GPU", {"CPU": 8}) == "GPU"  # asked for: the placement then waits for GPUs
    assert bundle_for("GPU", 8) == {"CPU": 1.0, "GPU": 8.0}
    assert bundle_for("CPU", 8) == {"CPU": 1.0}


def test_the_tpu_slice_comes_from_the_keys_or_the_nodes_labels():
    node = {"Alive": True, "Labels": {"ray.io/tpu-topology": "2x2x2", "ray.io/tpu-pod-type": "v4-16"}}
    other = {"Alive": True, "Labels": {"ray.io/tpu-topology": "4x4", "ray.io/tpu-pod-type": "v6e-16"}}
    assert tpu_slice_of([node, node], None, None) == ("2x2x2", "v4")
    assert tpu_slice_of([node, other], "4x4", "V6E") == ("4x4", "v6e")
    with pytest.raises(ConfigError, match=r"trainer.ray.tpu_topology is null and the cluster's TPU nodes label "
                                          r"\['2x2x2', '4x4'\] topologies"):
        tpu_slice_of([node, other], None, "v4")
    with pytest.raises(ConfigError, match="label no generations"):
        tpu_slice_of([{"Alive": True, "Labels": {"ray.io/tpu-topology": "2x2x2"}}], None, None)


def test_a_ray_launch_without_ray_installed_is_a_usage_error(tmp_path):
    """``trainer.launcher=ray`` where ``import ray`` fails: exit 2 naming the extra (Ray hidden by a stub)."""
    (tmp_path / "ray.py").write_text("raise ImportError('no ray here')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
                          "trainer.launcher=ray"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "jaxrl: error: trainer.launcher=ray needs Ray: pip install 'jaxrl[ray]'" in out.stderr
