"""The Ray backend on a 2-node ``ray.cluster_utils.Cluster`` (both nodes on 127.0.0.1, 2 logical GPUs each).

The ``runs`` fixture starts the cluster, runs ``python -m jaxrl.ray_backend.driver --nnodes 2 --devices-per-host 2
--local-devices 2 --module tests.ray_backend.probe`` in modes ``world``, ``fail``, ``single`` (one host) and
``sigterm``, records what it saw (the processes, their sockets while the world was up, the probes' reports), shuts the
cluster down and records which process outlived it. The tests check the records: the pool put one actor on each node,
the two hosts formed one JAX world of 4 devices with an exact psum, every socket was on loopback, a failing host ended
the group at once with its rank and error named, one host ran as a plain single process, SIGTERM to the driver
reached every host, and no process (actor, host process, Ray's own) was left.
"""

from __future__ import annotations

import json
import re
import signal
import time

import psutil
import pytest

from tests.ray_backend.raykit import (LocalCluster, describe, driver_process, kill_all, loopback,
                                      ray_process_env, require_ray, sockets, wait_gone)

DRIVER = ["--nnodes", "2", "--devices-per-host", "2", "--local-devices", "2", "--placement-timeout", "60",
          "--module", "tests.ray_backend.probe", "--"]


def _wait_files(paths, proc, read, timeout_s=120.0):
    t0 = time.monotonic()
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) early: {read()[1][-4000:]}")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{paths} did not appear within {timeout_s} s: {read()[1][-4000:]}")
        time.sleep(0.05)


def _actor_pids(stderr: str) -> dict[int, int]:
    found = re.findall(r"jaxrl: ray: rank (\d) on node \S+ \(\S+, actor pid (\d+)\)", stderr)
    return {int(r): int(p) for r, p in found}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_ray()
    home = tmp_path_factory.mktemp("home")
    cluster = LocalCluster(home, [{"num_cpus": 1, "num_gpus": 2}, {"num_cpus": 1, "num_gpus": 2}])
    rec: dict = {}
    seen: set[int] = set()
    try:
        env = {**ray_process_env(home), "RAY_ADDRESS": cluster.address}
        infra = cluster.pids()  # the cluster's own processes (gcs, raylets, agents)
        rec["raylets"] = {p.pid for p in map(psutil.Process, infra) if p.name() == "raylet"}

        out = tmp_path_factory.mktemp("world")
        with driver_process([*DRIVER, "world", str(out)], env, module="jaxrl.ray_backend.driver") as (proc, read):
            _wait_files([out / "ready-0", out / "ready-1"], proc, read)
            during = cluster.pids() - infra
            seen |= during
            rec["sockets"] = sockets(cluster.pids())
            rec["actor_parents"] = {}
            for rank, pid in _actor_pids(read()[1]).items():
                rec["actor_parents"][rank] = psutil.Process(pid).ppid()
            (out / "go").write_text("")
            rec["world_rc"] = proc.wait(timeout=120)
            rec["world_stdout"], rec["world_stderr"] = read()
        rec["world_left"] = wait_gone(during - {proc.pid}, 30)
        rec["ranks"] = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]

        fail_out = tmp_path_factory.mktemp("fail")
        with driver_process([*DRIVER, "fail", str(fail_out)], env, module="jaxrl.ray_backend.driver") as (proc, read):
            t0 = time.monotonic()
            rec["fail_rc"] = proc.wait(timeout=120)
            rec["fail_s"] = time.monotonic() - t0
            rec["fail_stderr"] = read()[1]
        rec["fail_left"] = wait_gone(cluster.pids() - infra - {proc.pid}, 30)
        rec["fail_rank0_report"] = (fail_out / "rank0.json").exists()
        seen |= cluster.pids() - infra

        one_out = tmp_path_factory.mktemp("single")
        args = ["--nnodes", "1", "--devices-per-host", "2", "--module", "tests.ray_backend.probe", "--", "single",
                str(one_out)]
        with driver_process(args, env, module="jaxrl.ray_backend.driver") as (proc, read):
            rec["single_rc"] = proc.wait(timeout=120)
            rec["single_stderr"] = read()[1]
        rec["single"] = json.loads((one_out / "rank0.json").read_text()) if (one_out / "rank0.json").exists() else {}
        seen |= cluster.pids() - infra

        term_out = tmp_path_factory.mktemp("sigterm")
        args = [*DRIVER, "sigterm", str(term_out)]
        with driver_process(args, env, module="jaxrl.ray_backend.driver") as (proc, read):
            _wait_files([term_out / "ready-0", term_out / "ready-1"], proc, read)
            seen |= cluster.pids() - infra
            proc.send_signal(signal.SIGTERM)  # as `ray job stop` does to a job's entrypoint
            rec["sigterm_rc"] = proc.wait(timeout=60)
            rec["sigterm_stderr"] = read()[1]
        rec["sigterm_ranks"] = [json.loads((term_out / f"rank{i}.json").read_text())
                                for i in range(2) if (term_out / f"rank{i}.json").exists()]
    finally:
        everything = cluster.pids()
        cluster.shutdown()
        rec["after_shutdown"] = wait_gone(everything | seen, 30)
        rec["after_shutdown_named"] = describe(rec["after_shutdown"])
        kill_all(rec["after_shutdown"])  # a failed shutdown must not leave processes behind
    return rec


def test_the_pool_puts_one_actor_on_each_node(runs):
    stderr = runs["world_stderr"]
    assert runs["world_rc"] == 0, stderr[-4000:]
    assert "jaxrl: ray: placed 2 host(s) x {CPU: 1, GPU: 2}" in stderr
    nodes = re.findall(r"jaxrl: ray: rank \d on node 127\.0\.0\.1 \(.*\), Ray node ([0-9a-f]+)", stderr)
    assert len(nodes) == 2 and len(set(nodes)) == 2, stderr[-3000:]  # two Ray nodes
    parents = runs["actor_parents"]
    assert set(parents) == {0, 1} and set(parents.values()) == runs["raylets"]  # one actor under each raylet
    for r in runs["ranks"]:
        assert r["cuda_visible_devices"] == "0,1"  # the actor holds both of its node's GPUs (Ray set them)
        assert r["ray_address"] is None  # a host process never becomes a driver itself


def test_two_hosts_form_one_jax_world_with_an_exact_psum(runs):
    for i, r in enumerate(runs["ranks"]):
        assert (r["rank"], r["process_count"], r["device_count"], r["local_device_count"]) == (i, 2, 4, 2)
        assert r["mode"] == "env"  # the jaxrl.distributed env contract
        assert r["spans_processes"] and r["psum_exact"] and r["psum"] == [27.0, 33.0, 39.0]
    coordinators = {r["coordinator"] for r in runs["ranks"]}
    assert len(coordinators) == 1 and next(iter(coordinators)).startswith("127.0.0.1:")  # rank 0's node IP
    assert runs["ranks"][0]["bind"] == runs["ranks"][0]["coordinator"]  # bound to that address only
    assert runs["ranks"][0]["ppid"] != runs["ranks"][1]["ppid"]  # each host's process is its own actor's child


def test_logs_stream_to_the_driver_prefixed_by_rank(runs):
    out = runs["world_stdout"] + runs["world_stderr"]
    assert re.search(r"^\[rank 0\] ", out, re.M) and re.search(r"^\[rank 1\] ", out, re.M)


def test_every_socket_is_on_loopback(runs):
    socks = runs["sockets"]
    assert any(s[2] == psutil.CONN_LISTEN for s in socks), socks
    outside = [s for s in socks if any(ip and not loopback(ip) for ip in s[3:])]
    assert not outside, outside


def test_a_failing_host_ends_the_group_naming_its_rank_and_error(runs):
    stderr = runs["fail_stderr"]
    assert runs["fail_rc"] == 1, stderr[-4000:]
    assert "[rank 1] RuntimeError: probe failure on rank 1" in stderr
    assert re.search(r"jaxrl: error: rank 1 on node 127\.0\.0\.1 \(.*\) exited with status 1: "
                     r"RuntimeError: probe failure on rank 1", stderr), stderr[-3000:]
    assert runs["fail_s"] < 30, runs["fail_s"]  # rank 0 (waiting in a barrier) was ended, not timed out
    assert not runs["fail_rank0_report"]
    assert runs["fail_left"] == []


def test_one_host_runs_as_a_plain_single_process(runs):
    """verl's single-node command (trainer.nnodes=1) through Ray: one actor, a process that joins no world."""
    assert runs["single_rc"] == 0, runs["single_stderr"][-4000:]
    assert "jaxrl: ray: placed 1 host(s) x {CPU: 1, GPU: 2}" in runs["single_stderr"]
    r = runs["single"]
    assert (r["mode"], r["process_count"], r["world_env"]) == ("local", 1, [])
    assert r["cuda_visible_devices"] == "0,1" and r["launcher"] == "local"


def test_sigterm_to_the_driver_reaches_every_host(runs):
    assert runs["sigterm_rc"] == 0, runs["sigterm_stderr"][-4000:]
    assert [r["stopped_by_signal_here"] for r in runs["sigterm_ranks"]] == [True, True]


def test_no_process_is_left(runs):
    assert runs["world_left"] == []  # the actors and their processes ended with the driver
    # and the cluster's own processes with the cluster
    assert runs["after_shutdown"] == [], runs["after_shutdown_named"]
