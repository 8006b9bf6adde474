"""The world a config and the ``JAXRL_*`` environment describe (:func:`jaxrl.distributed.resolve_world`) and what a
multi-process run requires of the config (:func:`jaxrl.distributed.check_world`, also run by the loader): pure, no
jax, no process started."""

from __future__ import annotations

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.schema import DISTRIBUTED_MODE_CHOICES, DistributedConfig
from jaxrl.distributed import MODES, check_world, resolve_world

WORLD = {"JAXRL_COORDINATOR_ADDRESS": "127.0.0.1:4321", "JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "1"}
MESH = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.mesh.fsdp=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]


def _resolve(environ=None, **keys):
    return resolve_world(DistributedConfig(**keys), environ or {})


def test_the_schema_lists_the_modes_the_module_knows():
    assert DISTRIBUTED_MODE_CHOICES == MODES


def test_no_environment_and_no_keys_is_one_local_process():
    spec = _resolve()
    assert (spec.mode, spec.num_processes, spec.process_id, spec.multi_process) == ("local", 1, 0, False)
    assert (spec.heartbeat_timeout_s, spec.shutdown_timeout_s) == (10, 30)  # not jax's 100 / 300 s


def test_the_env_contract_picks_env_mode_and_binds_a_loopback_coordinator_to_loopback():
    spec = _resolve({**WORLD, "JAXRL_LOCAL_DEVICE_COUNT": "2"})
    assert (spec.mode, spec.coordinator_address, spec.num_processes, spec.process_id, spec.local_device_count) == (
        "env", "127.0.0.1:4321", 2, 1, 2)
    assert spec.coordinator_bind_address == "127.0.0.1:4321"  # never jax's default [::]:port on loopback
    assert _resolve({**WORLD, "JAXRL_COORDINATOR_ADDRESS": "localhost:99"}).coordinator_bind_address == "127.0.0.1:99"
    assert _resolve({**WORLD, "JAXRL_COORDINATOR_ADDRESS": "[::1]:99"}).coordinator_bind_address == "[::1]:99"
    remote = _resolve({**WORLD, "JAXRL_COORDINATOR_ADDRESS": "10.0.0.2:99"})
    assert remote.coordinator_bind_address is None  # a real multi-host world: jax's default (all interfaces)


def test_keys_stand_in_for_the_environment_and_must_agree_with_it():
    spec = _resolve(coordinator_address="127.0.0.1:5000", num_processes=4, process_id=3)
    assert (spec.mode, spec.num_processes, spec.process_id) == ("env", 4, 3)
    assert _resolve(WORLD, process_id=1).process_id == 1  # the same value both ways is fine
    with pytest.raises(ConfigError, match=r"^JAXRL_PROCESS_ID=1 and trainer.distributed.process_id=0 disagree"):
        _resolve(WORLD, process_id=0)


@pytest.mark.parametrize("environ, keys, message", [
    ({**WORLD, "JAXRL_NUM_PROCESSES": "two"}, {}, "JAXRL_NUM_PROCESSES='two' is not an integer"),
    ({**WORLD, "JAXRL_PROCESS_ID": "2"}, {}, r"process_id=2 must be in \[0, 2\)"),
    ({**WORLD, "JAXRL_COORDINATOR_ADDRESS": "127.0.0.1"}, {}, "expected host:port"),
    ({**WORLD, "JAXRL_LOCAL_DEVICE_COUNT": "0"}, {}, "local_device_count=0 must be >= 1"),
    ({"JAXRL_COORDINATOR_ADDRESS": "127.0.0.1:1"}, {}, r"mode='env' needs JAXRL_NUM_PROCESSES \(trainer.distribu"),
    (WORLD, {"mode": "local"}, "mode='local' runs one process"),
    (WORLD, {"mode": "auto"}, "mode='auto' lets jax detect the cluster"),
    ({}, {"mode": "ray"}, "mode='ray' is invalid; expected one of 'local', 'env', 'auto'"),
    ({}, {"heartbeat_timeout_s": 0}, r"heartbeat_timeout_s=0 is invalid; expected an int >= 1 \(seconds\)"),
])
def test_bad_worlds_are_one_line_errors(environ, keys, message):
    with pytest.raises(ConfigError, match=message) as e:
        _resolve(environ, **keys)
    assert "\n" not in str(e.value)


def test_auto_mode_joins_whatever_jax_detects():
    spec = _resolve(mode="auto")
    assert (spec.mode, spec.num_processes, spec.multi_process) == ("auto", None, True)


def _cfg(*overrides):
    return load_config("configs/quickstart.yaml", list(overrides))


def _world_cfg(monkeypatch, *overrides):
    """A config loaded as process 1 of 2 (the JAXRL_* contract set)."""
    for k, v in WORLD.items():
        monkeypatch.setenv(k, v)
    return _cfg(*overrides)


def test_nnodes_must_equal_the_process_count(monkeypatch):
    cfg = _cfg()  # nnodes=1, one process: fine
    check_world(cfg, resolve_world(cfg.trainer.distributed, {}))
    with pytest.raises(ConfigError, match=r"^trainer.nnodes=2 but this run has 1 process\(es\) .*jaxrl.launch"):
        _cfg(*MESH)  # the loader checks it
    with pytest.raises(ConfigError, match=r"^trainer.nnodes=1 but this run has 2 process\(es\)"):
        check_world(cfg, _resolve(WORLD))
    check_world(_world_cfg(monkeypatch, *MESH), _resolve(WORLD))


def test_n_gpus_per_node_must_equal_each_processs_devices_with_several_processes(monkeypatch):
    cfg = _world_cfg(monkeypatch, *MESH)
    check_world(cfg, _resolve(WORLD), local_devices=2)
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node=2 but each of the 2 processes has 4 local"):
        check_world(cfg, _resolve(WORLD), local_devices=4)
    for k in WORLD:
        monkeypatch.delenv(k)
    check_world(_cfg("trainer.n_gpus_per_node=2"), _resolve(), local_devices=1)  # one process: not checked


@pytest.mark.parametrize("overrides, message", [
    (["trainer.placement=split", "trainer.rollout_devices=2", "trainer.mesh.fsdp=2"],
     "trainer.placement='split' is not supported with 2 processes: the split weight sync reshards between two "
     "different device sets, which multi-controller JAX refuses across hosts"),
    (["trainer.mesh.fsdp=null"], "a run of 2 processes needs a train mesh"),
    (["actor_rollout_ref.rollout.name=vllm"], "actor_rollout_ref.rollout.name='vllm' is not supported with 2 "),
    (["actor_rollout_ref.rollout.name=jetstream"],
     "actor_rollout_ref.rollout.name='jetstream' is not supported with 2 processes yet"),
])
def test_what_several_processes_cannot_run_is_refused_at_config_load(monkeypatch, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _world_cfg(monkeypatch, *MESH, *overrides)


def test_the_loader_reads_the_env_contract(monkeypatch):
    for k, v in {**WORLD, "JAXRL_LOCAL_DEVICE_COUNT": "2"}.items():
        monkeypatch.setenv(k, v)
    _cfg(*MESH)  # a valid 2-process config loads
    with pytest.raises(ConfigError, match=r"^trainer.nnodes=1 but this run has 2 process"):
        _cfg()
