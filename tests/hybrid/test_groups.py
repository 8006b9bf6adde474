"""Worker groups on a real 2-node Ray cluster on loopback (tests/ray_backend/raykit.py), with members that import no
jax (tests/hybrid/toy_worker.py): one member per node, one-to-all calls return the primary's answer, a member's
exception comes back as itself, a member killed in one group ends a call waiting on the other group within seconds
naming the group and its host, a call past its time limit raises GroupTimeout, and shutting the groups down leaves
none of their processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.ray_backend.raykit import LocalCluster, require_ray, wait_gone


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    ray = require_ray()
    from jaxrl.hybrid.groups import HybridGroups, WorkerGroup
    from tests.hybrid.toy_worker import ToyWorker

    home = tmp_path_factory.mktemp("home")
    cluster = LocalCluster(home, [{"num_cpus": 1}, {"num_cpus": 1}])
    g = None
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        cwd = str(tmp_path_factory.mktemp("cwd"))
        a = WorkerGroup("train", ToyWorker, nnodes=1, devices_per_host=2, resource="CPU", env={"TOY": "yes"}, cwd=cwd)
        b = WorkerGroup("rollout", ToyWorker, nnodes=1, devices_per_host=3, resource="CPU", cwd=cwd)
        g = HybridGroups(a, b)
        a.start(60)
        b.start(60)
        g.cwd = cwd
        yield g
    finally:
        if g is not None:
            g.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_each_group_has_its_member_on_its_own_node_with_the_drivers_environment(groups):
    a, b = groups["train"], groups["rollout"]
    assert len(a.members) == len(b.members) == 1
    assert a.members[0].info["node_id"] != b.members[0].info["node_id"]  # 1 CPU per node: one bundle each
    assert a.call("pid") == a.members[0].info["pid"]  # the primary's answer
    assert a.call("env", "TOY") == "yes" and b.call("env", "TOY") is None
    # on a CPU cluster each member simulates its pool's devices (n_gpus_per_node CPU devices)
    assert a.call("env", "JAXRL_LOCAL_DEVICE_COUNT") == "2" and b.call("env", "JAXRL_LOCAL_DEVICE_COUNT") == "3"
    assert a.call("cwd") == groups.cwd


def test_a_members_exception_comes_back_as_itself(groups):
    with pytest.raises(ValueError, match="bad value 7"):
        groups["train"].call("boom", 7)
    assert groups["train"].call("sleep", 0.01) == 0.01  # the member is still there


def test_a_call_past_its_time_limit_raises_group_timeout(groups):
    from jaxrl.hybrid.groups import GroupTimeout

    t0 = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"the train group's sleep did not finish within 0.5 s"):
        groups["train"].call("sleep", 2.0, timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    time.sleep(2.0)  # the member finishes its sleep (it was alive and busy, not lost)
    assert groups["train"].call("sleep", 0.01) == 0.01


def test_a_killed_member_of_the_other_group_ends_a_waiting_call_naming_it_and_nothing_is_left(groups):
    from jaxrl.hybrid.groups import GroupFailure

    victim = groups["rollout"].members[0].info["pid"]
    pids = [m.info["pid"] for g in groups.groups.values() for m in g.members]
    t0 = time.monotonic()
    import threading

    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    with pytest.raises(GroupFailure) as e:
        groups["train"].call("sleep", 60)  # the train group is busy; the rollout group's member dies meanwhile
    waited = time.monotonic() - t0
    assert waited < 15, waited
    assert e.value.group == "rollout" and e.value.rank == 0
    assert f"actor pid {victim}" in str(e.value) and "every group was stopped" in str(e.value)
    groups.shutdown()
    assert wait_gone(pids, 30) == []
