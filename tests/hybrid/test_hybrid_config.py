"""The hybrid controller's config (no Ray, no jax): verl's rollout-pool keys, what a pool requires and refuses, and
the driver's stand-ins over a recording fake group (the unit under test is the proxy: which group method each
Trainer call becomes, what comes back)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config, load_config_with_notes
from jaxrl.ray_backend import uses_rollout_pool

POOL = ["trainer.launcher=ray", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "trainer.n_gpus_per_node=2"]


@pytest.fixture(autouse=True)
def _no_world(monkeypatch):
    for name in ("RAY_ADDRESS", "JAXRL_COORDINATOR_ADDRESS", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)


def test_verl_recipes_rollout_keys_are_read_as_the_rollout_pool():
    loaded = load_config_with_notes("configs/quickstart.yaml", ["trainer.launcher=ray", "rollout.nnodes=1",
                                                                "rollout.n_gpus_per_node=4"])
    r = loaded.config.actor_rollout_ref.rollout
    assert (r.nnodes, r.n_gpus_per_node) == (1, 4)
    assert uses_rollout_pool(loaded.config)
    assert {n.key for n in loaded.notes} >= {"rollout.nnodes", "rollout.n_gpus_per_node"}
    assert not uses_rollout_pool(load_config("configs/quickstart.yaml"))  # default 0: no pool of its own


@pytest.mark.parametrize("extra, message", [
    (["trainer.launcher=local"], r"actor_rollout_ref.rollout.nnodes=1 \(a rollout pool of its own\) needs the Ray "
                                 r"launcher: set trainer.launcher=ray"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=0"], r"needs actor_rollout_ref.rollout.n_gpus_per_node >= 1"),
    # a group of several hosts is one world of several processes: what such a world refuses, for that group
    (["trainer.nnodes=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"],
     r"a run of 2 processes needs a train mesh over all their devices"),
    (["actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.name=jetstream"],
     r"rollout.name='jetstream' is not supported with 2 processes"),
    (["trainer.placement=split", "trainer.rollout_devices=1", "trainer.mesh.fsdp=1"],
     r"trainer.placement='split' / trainer.rollout_devices=1 with .* leave trainer.placement=colocated"),
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     r"tensor_model_parallel_size=4 with rollout.name=vllm .* own vLLM engine over its n_gpus_per_node=2 devices; use "
     r"a tensor-parallel size <= 2"),
    (["trainer.max_restarts=1"], r"trainer.max_restarts=1 with .* rerun the same command to resume"),
    (["actor_rollout_ref.rollout.nnodes=-1"], r"nnodes=-1 / n_gpus_per_node=2 must >= 0"),
])
def test_a_rollout_pool_refuses_what_the_groups_do_not_run_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("configs/quickstart.yaml", [*POOL, *extra])
    assert "\n" not in str(e.value)


def test_groups_of_several_hosts_load_with_the_async_pipeline_in_the_driver():
    """Each group's world is checked with the config it runs: the train world holds no engine and no pipeline, so
    staleness and a multi-host train group go together (a single world of 2 processes refuses staleness)."""
    from jaxrl.hybrid.worker import group_config

    cfg = load_config("configs/quickstart.yaml", [*POOL, "trainer.nnodes=2", "trainer.mesh.fsdp=4",
                                                  "actor_rollout_ref.rollout.nnodes=2", "async_training.staleness=1",
                                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    train, rollout = group_config(cfg, "train"), group_config(cfg, "rollout")
    assert (train.trainer.nnodes, train.async_training.staleness, train.trainer.mesh.fsdp) == (2, 0, 4)
    assert (rollout.trainer.nnodes, rollout.trainer.n_gpus_per_node, rollout.trainer.mesh.data) == (2, 2, -1)
    assert cfg.async_training.staleness == 1 and cfg.trainer.launcher == "ray"  # the driver's config is untouched
    with pytest.raises(ConfigError, match=r"async_training.staleness=1 .* 2 processes"):
        load_config("configs/quickstart.yaml", ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.mesh.fsdp=4",
                                                "trainer.launcher=ray", "async_training.staleness=1",
                                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])


def test_vllm_per_host_makes_each_rollout_member_a_world_of_its_own():
    """vLLM in the rollout group: a pool of 2 hosts is 2 independent engines (each member's world is itself), so the
    config loads where a 2-process JetStream world is refused."""
    from jaxrl.hybrid.worker import group_config

    cfg = load_config("configs/quickstart.yaml", [*POOL, "actor_rollout_ref.rollout.nnodes=2",
                                                  "actor_rollout_ref.rollout.name=vllm",
                                                  "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    rollout = group_config(cfg, "rollout")
    assert (rollout.trainer.nnodes, rollout.trainer.n_gpus_per_node) == (1, 2)
    assert rollout.actor_rollout_ref.rollout.name == "vllm" and group_config(cfg, "train").trainer.nnodes == 1
    assert cfg.actor_rollout_ref.rollout.nnodes == 2  # the driver's config is untouched


@pytest.mark.parametrize("section, key, message", [
    ("algorithm.dpo", "enable", r"algorithm.dpo.enable=True with .* online DPO is not built"),
    ("actor_rollout_ref.rollout.multi_turn", "enable", r"multi_turn.enable=True with .* multi-turn rollouts"),
    ("reward_model", "enable", r"reward_model.enable=True with .* not built for the train group"),
])
def test_the_pool_check_refuses_roles_the_groups_do_not_build(section, key, message):
    """Settings whose own checks need more keys (a reward model path, a tool config): the pool's check alone."""
    import functools

    from jaxrl.ray_backend import check_rollout_pool

    cfg = load_config("configs/quickstart.yaml", POOL)
    check_rollout_pool(cfg)  # the pool itself is fine
    setattr(functools.reduce(getattr, section.split("."), cfg), key, True)
    with pytest.raises(ConfigError, match=message):
        check_rollout_pool(cfg)


class FakeGroup:
    """Records ``call(method, *args)`` and answers from ``answers[method]`` (a value or a function of the args)."""

    def __init__(self, **answers):
        self.calls, self.answers = [], answers

    def call(self, method, *args, timeout_s=None):
        self.calls.append((method, args))
        self.timeouts = getattr(self, "timeouts", []) + [timeout_s]
        a = self.answers.get(method)
        return a(*args) if callable(a) else a


def test_the_stand_ins_turn_each_trainer_call_into_one_group_call():
    from jaxrl.hybrid.proxies import RemoteActor, RemoteCritic, RemoteReference, RemoteRollout, RemoteWeightSync

    lp = np.full((2, 3), -1.5, np.float32)
    train = FakeGroup(compute_log_probs=lambda role, b: (lp if role == "actor" else lp * 2, None),
                      update=lambda role, b: {f"{role}/loss": 1.0}, compute_values=lambda b: lp + 1,
                      weights={"ref": ["REF"], "bytes": 1234, "tensors": 5, "gather_s": 0.25},
                      state=lambda role: ({"params": {"w": np.ones(2)}}, {"num_updates": 3}), load_state=None)
    actor, ref, critic = RemoteActor(train), RemoteReference(train), RemoteCritic(train)
    assert actor.compute_log_probs("B")[0] is lp
    assert np.array_equal(ref.compute_log_probs("B")[0], lp * 2)
    assert np.array_equal(critic.compute_values("B"), lp + 1)
    assert actor.update("B") == {"actor/loss": 1.0} and critic.update("B") == {"critic/loss": 1.0}
    assert actor.state()[1] == {"num_updates": 3}
    actor.load_state({"params": {"w": np.zeros(2)}}, {"num_updates": 3})
    method, (role, arrays, meta) = train.calls[-1]
    assert (method, role, meta) == ("load_state", "actor", {"num_updates": 3})
    assert isinstance(arrays["params"]["w"], np.ndarray)
    assert [c[0] for c in train.calls[:3]] == ["compute_log_probs"] * 2 + ["compute_values"]
    assert train.calls[1][1][0] == "ref"

    rollout = FakeGroup(update_weights={"load_s": 0.5}, generate=lambda p, sp: ("OUT", p, sp))
    engine = RemoteRollout(rollout, {"engine": "jax sampler", "mesh": "data=1 x fsdp=1 x tensor=2 on devices [0, 1]",
                                     "eos_token_ids": (2,)})
    assert engine.generate([[1, 2]], "SP") == ("OUT", [[1, 2]], "SP")
    assert engine.eos_token_ids == (2,) and "rollout group" in engine.engine_name
    sync = RemoteWeightSync(rollout, engine)
    report = sync.sync(actor.merged_params())
    assert rollout.calls[-1] == ("update_weights", ("REF",))  # the object ref itself: Ray resolves it in the member
    assert (report.bytes_moved, report.num_tensors, report.gather_s, report.load_s) == (1234, 5, 0.25, 0.5)
    assert report.seconds >= 0.25 and sync.num_syncs == 1 and sync.reports == [report]


def test_a_sync_that_times_out_is_a_weight_sync_error_never_stale_weights():
    from jaxrl.hybrid.groups import GroupTimeout
    from jaxrl.hybrid.proxies import RemoteRollout, RemoteWeightSync, WeightCopy
    from jaxrl.rollout.base import WeightSyncError

    def stuck(ref):
        raise GroupTimeout("the rollout group's update_weights did not finish within 600 s")

    rollout = FakeGroup(update_weights=stuck)
    engine = RemoteRollout(rollout, {"engine": "jax sampler", "mesh": "tensor=2"})
    sync = RemoteWeightSync(rollout, engine, timeout_s=600.0)
    with pytest.raises(WeightSyncError, match=r"weight sync #1 across worlds into jax sampler in the rollout group .* "
                                              r"did not finish within 600 s .*update_weights_timeout_s"):
        sync.sync(WeightCopy(ref=["REF"], bytes=1, tensors=1, gather_s=0.0))
    assert rollout.timeouts == [600.0] and sync.num_syncs == 0


def test_the_runs_memory_metrics_are_the_groups_members():
    """verl's perf/*memory* keys come from the train group (max over its members), the rollout group's under
    perf/rollout_group/, the driver's RSS under perf/driver/ (each member answers its own memory_metrics)."""
    from jaxrl.hybrid.proxies import GroupMemory

    class Members:
        def __init__(self, answers):
            self.members, self.answers, self.asked = answers, answers, []

        def call_each(self, method, args, timeout_s=None):
            self.asked.append((method, args))
            return self.answers

    train = Members([{"perf/cpu_memory_used_gb": 3.0, "perf/max_memory_allocated_gb": 10.0},
                     {"perf/cpu_memory_used_gb": 4.0, "perf/max_memory_allocated_gb": 9.0}])
    rollout = Members([{"perf/cpu_memory_used_gb": 2.5}])
    got = GroupMemory(train, rollout)()
    assert got["perf/cpu_memory_used_gb"] == 4.0 and got["perf/max_memory_allocated_gb"] == 10.0
    assert got["perf/rollout_group/cpu_memory_used_gb"] == 2.5
    assert 0 < got["perf/driver/cpu_memory_used_gb"] < 100
    assert train.asked == [("memory", [(), ()])] and rollout.asked == [("memory", [()])]
