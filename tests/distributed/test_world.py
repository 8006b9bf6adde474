"""Two processes x two CPU devices through ``python -m jaxrl.launch``: one JAX world on 127.0.0.1.

The ``world`` fixture starts one world (``tests/distributed/probe.py``, mode ``world``) and, while it waits, reads
every listening and connected socket of its processes; the tests then check what each process recorded. Other tests
start their own small worlds: a process that fails, SIGTERM to one process, split placement refused.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time

import psutil
import pytest

from tests.distributed.worldkit import alive, launched, output, require_loopback_hostname, track, wait_for

PROBE = ["--nproc", "2", "--local-devices", "2", "--module", "tests.distributed.probe", "--"]


def test_hostname_resolves_to_loopback():
    require_loopback_hostname()


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _sockets(procs: list[psutil.Process]) -> list[tuple[int, str, str, str]]:
    """``(pid, status, local ip, remote ip)`` of every inet socket of ``procs``."""
    out = []
    for p in procs:
        for c in p.net_connections(kind="inet"):
            out.append((p.pid, c.status, c.laddr.ip if c.laddr else "", c.raddr.ip if c.raddr else ""))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    with launched([*PROBE, "world", str(out)]) as (proc, tracked):
        kids = track(proc, tracked, 2)
        wait_for([out / "ready-0", out / "ready-1"], proc)
        sockets = _sockets(kids)
        (out / "go").write_text("")
        rc = proc.wait(timeout=120)
        stdout, stderr = output(proc)
        assert rc == 0, stderr[-4000:]
        left = alive(tracked)
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    return {"ranks": ranks, "sockets": sockets, "stderr": stderr, "left": left, "out": out}


def test_one_world_of_two_processes_with_four_devices(world):
    for i, r in enumerate(world["ranks"]):
        assert (r["rank"], r["process_count"], r["device_count"], r["local_device_count"]) == (i, 2, 4, 2)
        assert r["primary"] is (i == 0)
        assert r["mode"] == "env" and r["bind"].startswith("127.0.0.1:")  # the JAXRL_* contract, loopback bind
    assert world["left"] == []  # the launcher returned: no process it started is alive


def test_sharded_matmul_and_psum_equal_numpy(world):
    for r in world["ranks"]:
        assert r["a_spans_processes"]  # the operand really lives on both processes' devices
        assert r["matmul_err"] < 1e-5 and r["psum_err"] < 1e-5


def test_to_global_and_to_host_round_trip_every_layout(world):
    for r in world["ranks"]:
        assert (r["roundtrip_rows"], r["roundtrip_cols"], r["roundtrip_replicated"]) == (True, True, True)


def test_orbax_save_in_one_sharding_restores_exactly_into_another(world):
    for r in world["ranks"]:
        assert r["restore_cols"] and r["restore_replicated"]
        assert r["steps_listed"] == [1]
    assert (world["out"] / "ckpt" / "global_step_1").is_dir()


def test_no_socket_outside_loopback(world):
    sockets = world["sockets"]
    listening = [s for s in sockets if s[1] == psutil.CONN_LISTEN]
    assert listening, sockets  # the coordinator (rank 0) and the collectives listen while the world is up
    outside = [s for s in sockets if any(ip and not _loopback(ip) for ip in s[2:])]
    assert not outside, outside


def test_run_on_primary_gives_everyone_the_primarys_result_and_exception(world):
    for r in world["ranks"]:
        assert r["shared_result"] == {"rank": 0}
        assert r["shared_error"] == ["ProbeError", "probe failure on the primary", 7, str(world["out"])]


def test_agreement_and_the_replica_check(world):
    for r in world["ranks"]:
        assert r["any_process"] is True and r["all_processes"] is False
        msg = r["divergence"]
        assert msg is not None and msg.startswith("step 7: the batch's token ids differ across processes")
        assert "processes [1] differ from process 0" in msg
        assert r["shared_dir_clean"]


def test_a_failing_process_ends_the_group_at_once(tmp_path):
    with launched([*PROBE, "fail", str(tmp_path)]) as (proc, tracked):
        track(proc, tracked, 2)
        t0 = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
        stdout, stderr = output(proc)
        assert rc == 1, stderr[-3000:]
        assert "[rank 1] RuntimeError: probe failure on rank 1" in stderr
        assert took < 30, took  # not the coordination service's shutdown / heartbeat timeouts
        assert alive(tracked) == []
    assert not (tmp_path / "rank0.json").exists()  # rank 0 was ended in its barrier


def test_sigterm_to_one_process_stops_every_process(tmp_path):
    with launched([*PROBE, "sigterm", str(tmp_path)]) as (proc, tracked):
        kids = track(proc, tracked, 2)
        wait_for([tmp_path / "ready-0", tmp_path / "ready-1"], proc)
        rank1 = next(p for p in kids if p.environ().get("JAXRL_PROCESS_ID") == "1")
        os.kill(rank1.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 0, output(proc)[1][-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["stopped_by_signal_here"] for r in ranks] == [False, True]  # rank 0 stopped because rank 1 did


def test_split_placement_with_two_processes_exits_2_before_loading_the_model(tmp_path):
    args = ["--nproc", "2", "--", "--config", "configs/quickstart.yaml", "trainer.nnodes=2",
            "trainer.n_gpus_per_node=2", "trainer.placement=split", "trainer.rollout_devices=2",
            "trainer.mesh.fsdp=2", f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
    with launched(args) as (proc, tracked):
        rc = proc.wait(timeout=120)
        stdout, stderr = output(proc)
    assert rc == 2, stderr[-3000:]
    reason = ("trainer.placement='split' is not supported with 2 processes: the split weight sync reshards between "
              "two different device sets, which multi-controller JAX refuses across hosts")
    assert f"[rank 0] jaxrl: config error: {reason}" in stderr or f"[rank 1] jaxrl: config error: {reason}" in stderr
    assert "placement" not in "".join(line for line in stderr.splitlines() if " INFO " in line)  # nothing built
    assert not list(tmp_path.iterdir())  # nothing written: refused at config load


def test_launcher_usage_errors_start_nothing(capsys):
    from jaxrl.launch import main

    assert main(["--nproc", "2", "--config", "x.yaml"]) == 2
    assert "put the jaxrl.train arguments after '--'" in capsys.readouterr().err
    assert main(["--nproc", "0", "--"]) == 2
    assert "--nproc=0 must be >= 1" in capsys.readouterr().err
