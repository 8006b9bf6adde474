"""`python -m launchers.tpu_pod` against the fake gcloud: golden gcloud sequences, --dry-run, fail-fast, Ctrl-C.

Each test starts the real launcher as a process; the fake (tests/launchers/fake_gcloud.py) records its argv and
runs each host's command on this machine. Nothing binds outside 127.0.0.1; leftovers are asserted and killed.
"""

from __future__ import annotations

import re
import shlex
import signal
import time

import pytest

from launchers import commands
from launchers.commands import Pod
from tests.launchers.conftest import leftovers, pod_args

WHERE = ["--zone=us-central2-b", "--project=proj-1"]
SSH = ["--strict-host-key-checking=no", "--quiet"]
TARBALL = re.compile(r"^/.+/jaxrl\.tar\.gz$")


def _gc(*words: str) -> list[str]:
    return ["gcloud", "compute", "tpus", *words]


def _host_ssh(worker: int, text: str) -> list[str]:
    return _gc("tpu-vm", "ssh", "tpu-a", f"--worker={worker}", *WHERE, *SSH, f"--command={text}", "--ssh-flag=-tt")


def _normalise_tarball(calls):
    """The local tarball lives in a fresh temp folder: check its form, then name it <TARBALL>."""
    out = []
    for argv in calls:
        if argv[3:5] == ["tpu-vm", "scp"]:
            assert TARBALL.match(argv[5]), argv
            argv = [*argv[:5], "<TARBALL>", *argv[6:]]
        out.append(argv)
    return out


def test_up_sync_run_down_v4_16_golden_sequence(fake_pod, tiny_checkout):
    install = "echo installed > installed.txt"
    program = ["python", "-c", "import os; print('host', os.environ['JAXRL_PROCESS_ID'], os.environ['GREETING'])"]
    steps = [
        ["up", *pod_args("v4-16")],
        ["sync", *pod_args("v4-16"), "--source", str(tiny_checkout), "--install", install],
        ["run", *pod_args("v4-16"), "--keep", "--env", "GREETING=hi there", "--", *program],
        ["down", *pod_args("v4-16")],
    ]
    results = [fake_pod.launch(*s) for s in steps]
    for s, r in zip(steps, results):
        assert r.returncode == 0, (s, r.stdout, r.stderr)
    host_text = commands.program_command(program, {"GREETING": "hi there"})
    expected = [
        _gc("tpu-vm", "create", "tpu-a", *WHERE, "--accelerator-type=v4-16", "--version=tpu-ubuntu2204-base"),
        _gc("tpu-vm", "scp", "<TARBALL>", "tpu-a:jaxrl.tar.gz", "--worker=all", *WHERE, *SSH),
        _gc("tpu-vm", "ssh", "tpu-a", "--worker=all", *WHERE, *SSH, f"--command={commands.sync_command(install)}"),
        _gc("tpu-vm", "describe", "tpu-a", *WHERE, "--format=json"),
        _host_ssh(0, host_text),
        _host_ssh(1, host_text),
        _gc("tpu-vm", "delete", "tpu-a", *WHERE, "--quiet"),
    ]
    calls = _normalise_tarball(fake_pod.calls())
    # the two host ssh calls start together: their order in the record is not fixed
    assert calls[:4] == expected[:4] and sorted(calls[4:6]) == expected[4:6] and calls[6:] == expected[6:]
    # what the hosts did: the checkout (without outputs/) unpacked and installed, the TPU freed, the program run
    run_out = results[2].stdout.splitlines()
    assert sorted(run_out) == ["[w0] host 0 hi there", "[w1] host 1 hi there"]
    for i in range(2):
        home = fake_pod.host("tpu-a", i)
        assert (home / "jaxrl" / "pkg" / "mod.py").read_text() == "X = 1\n"
        assert (home / "jaxrl" / "installed.txt").read_text() == "installed\n"
        assert not (home / "jaxrl" / "outputs").exists() and not (home / "jaxrl.tar.gz").exists()
        assert (home / "sudo.log").read_text().splitlines() == ["lsof -t /dev/accel* /dev/vfio/*",
                                                                 "rm -f /tmp/libtpu_lockfile"]
    assert fake_pod.wait_no_leftovers() == []


def test_queued_spot_request_golden_sequence(fake_pod, tiny_checkout):
    queued = pod_args("v4-16", "--queued", "--spot")
    up = fake_pod.launch("up", *queued, "--poll-interval", "0.01", env={"FAKE_GCLOUD_QUEUED_POLLS": "2"})
    assert up.returncode == 0, up.stderr
    assert "queued resource tpu-a: WAITING_FOR_RESOURCES" in up.stderr and "tpu-a: ACTIVE" in up.stderr
    fake_pod.launch("sync", *queued, "--source", str(tiny_checkout), "--install", "true")
    run = fake_pod.launch("run", *queued, "--", "true")
    assert run.returncode == 0, run.stderr
    state = _gc("queued-resources", "describe", "tpu-a", *WHERE, "--format=value(state.state)")
    text = commands.program_command(["true"], {})
    calls = _normalise_tarball(fake_pod.calls())
    assert calls[:5] == [
        _gc("queued-resources", "create", "tpu-a", "--node-id=tpu-a", *WHERE, "--accelerator-type=v4-16",
            "--runtime-version=tpu-ubuntu2204-base", "--spot"),
        state, state, state, state]          # WAITING, WAITING, PROVISIONING, ACTIVE
    assert calls[5:7] == [
        _gc("tpu-vm", "scp", "<TARBALL>", "tpu-a:jaxrl.tar.gz", "--worker=all", *WHERE, *SSH),
        _gc("tpu-vm", "ssh", "tpu-a", "--worker=all", *WHERE, *SSH, f"--command={commands.sync_command('true')}")]
    assert calls[7] == _gc("tpu-vm", "describe", "tpu-a", *WHERE, "--format=json")
    assert sorted(calls[8:10]) == [_host_ssh(0, text), _host_ssh(1, text)]
    assert calls[10:] == [_gc("queued-resources", "delete", "tpu-a", *WHERE, "--force", "--quiet")]


def test_dry_run_calls_nothing_and_prints_the_exact_commands(fake_pod):
    program = ["python", "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
               "trainer.default_local_dir=/mnt/gcs/run", "trainer.distributed.mode=auto"]
    pod = Pod("tpu-a", "us-central2-b", "v4-16", project="proj-1", queued=True, spot=True)
    outs = {}
    for sub, extra in [("up", []), ("sync", []), ("run", ["--env", "K=v", "--shared-storage", "/mnt/gcs", "--", *program]), ("down", [])]:
        r = fake_pod.launch(sub, "--dry-run", *pod_args("v4-16", "--queued", "--spot"), *extra)
        assert r.returncode == 0, r.stderr
        outs[sub] = [shlex.split(line) for line in r.stdout.splitlines() if not line.startswith("#")]
    assert fake_pod.calls() == [] and not (fake_pod.root / "hosts").exists()
    assert outs["up"] == [commands.create_argv(pod), commands.queued_state_argv(pod)]
    assert outs["sync"][0][5] != "<TARBALL>" and TARBALL.match(outs["sync"][0][5])
    assert outs["sync"][1] == commands.ssh_argv(pod, "all", commands.sync_command(commands.default_install()))
    assert outs["run"] == [commands.describe_argv(pod), *commands.run_plan(pod, 2, program, {"K": "v"}),
                           commands.delete_argv(pod)]
    assert outs["down"] == [commands.delete_argv(pod)]


def test_refused_program_starts_nothing(fake_pod):
    r = fake_pod.launch("run", *pod_args("v4-16"), "--", "python", "-m", "jaxrl.train", "--config",
                        "configs/quickstart.yaml", "trainer.distributed.mode=auto")
    assert r.returncode == 2
    assert r.stderr.startswith("jaxrl-tpu: error: the program sets no trainer.default_local_dir=...")
    assert len(r.stderr.splitlines()) == 1
    assert fake_pod.calls() == []


def test_sync_refuses_a_folder_that_is_no_checkout(fake_pod, tmp_path):
    r = fake_pod.launch("sync", *pod_args("v4-16"), "--source", str(tmp_path))
    assert r.returncode == 2 and "is not a checkout (no pyproject.toml there)" in r.stderr
    assert fake_pod.calls() == []


def _ready_program(fail_worker: int | None, exit_code: int = 3) -> list[str]:
    """Every host writes its PID to `ready` in its checkout (atomically), then sleeps 60 s; `fail_worker` exits
    `exit_code` after 0.5 s."""
    code = ("import os, sys, time; i = os.environ['JAXRL_PROCESS_ID'];"
            " f = open('ready.tmp', 'w'); f.write(str(os.getpid())); f.close(); os.rename('ready.tmp', 'ready');"
            " print('up', i, flush=True);"
            f" (time.sleep(0.5), sys.exit({exit_code})) if i == '{fail_worker}' else time.sleep(60)")
    return ["python", "-c", code]


def test_failing_host_stops_the_others_and_its_code_is_returned(fake_pod, tiny_checkout):
    assert fake_pod.launch("up", *pod_args("v4-32")).returncode == 0
    assert fake_pod.launch("sync", *pod_args("v4-32"), "--source", str(tiny_checkout), "--install", "true") \
        .returncode == 0
    t0 = time.monotonic()
    r = fake_pod.launch("run", *pod_args("v4-32"), "--", *_ready_program(fail_worker=2), timeout=30)
    elapsed = time.monotonic() - t0
    print(f"run with worker 2 failing returned {r.returncode} after {elapsed:.2f} s (whole launcher process)")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert elapsed < 5, f"the launcher took {elapsed:.1f} s to return after worker 2 failed"
    assert "jaxrl-tpu: worker 2 exited with code 3; the other hosts were stopped" in r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[w{i}] up {i}" for i in range(4)]
    assert fake_pod.calls()[-1] == _gc("tpu-vm", "delete", "tpu-a", *WHERE, "--quiet")
    assert fake_pod.wait_no_leftovers(timeout=1) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_run_stops_the_hosts_and_deletes(fake_pod, tiny_checkout, sig):
    assert fake_pod.launch("up", *pod_args("v4-16")).returncode == 0
    assert fake_pod.launch("sync", *pod_args("v4-16"), "--source", str(tiny_checkout), "--install", "true") \
        .returncode == 0
    p = fake_pod.start("run", *pod_args("v4-16"), "--", *_ready_program(fail_worker=None))
    ready = [fake_pod.host("tpu-a", i) / "jaxrl" / "ready" for i in range(2)]
    deadline = time.monotonic() + 20
    while not all(f.exists() for f in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(f.exists() for f in ready), "the hosts never started"
    host_pids = [int(f.read_text()) for f in ready]
    p.send_signal(sig)
    out, err = p.communicate(timeout=15)
    assert p.returncode == 128 + sig, err
    assert f"interrupted ({sig.name}); the hosts were stopped" in err
    assert fake_pod.calls()[-1] == _gc("tpu-vm", "delete", "tpu-a", *WHERE, "--quiet")
    assert fake_pod.wait_no_leftovers(timeout=1) == []
    assert host_pids and not set(host_pids) & set(leftovers(fake_pod.root))


def test_queued_request_not_active_in_time_is_deleted(fake_pod):
    r = fake_pod.launch("up", *pod_args("v4-16", "--queued"), "--timeout", "0.05", "--poll-interval", "0.01",
                        env={"FAKE_GCLOUD_QUEUED_POLLS": "1000"})
    assert r.returncode == 1
    assert "not ACTIVE after 0.05 s (last state WAITING_FOR_RESOURCES); raise --timeout" in r.stderr
    assert fake_pod.calls()[-1] == _gc("queued-resources", "delete", "tpu-a", *WHERE, "--force", "--quiet")


def test_ray_variant_starts_head_then_workers_then_the_driver_on_worker_0(fake_pod, tiny_checkout):
    """The hosts' `ray` is the fake's logger (no Ray runs here): the order, addresses and the one driver."""
    assert fake_pod.launch("up", *pod_args("v4-32")).returncode == 0
    fake_pod.launch("sync", *pod_args("v4-32"), "--source", str(tiny_checkout), "--install", "true")
    driver = ["python", "-c", "import os; open('driver', 'w').write(os.environ['RAY_ADDRESS']); print('driving')"]
    r = fake_pod.launch("run", *pod_args("v4-32"), "--ray", "--", *driver)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[driver] driving"]
    assert (fake_pod.host("tpu-a", 0) / "ray.log").read_text() == "start --head --port=6379 --disable-usage-stats\n"
    for i in range(1, 4):
        assert (fake_pod.host("tpu-a", i) / "ray.log").read_text() == \
            "start --address=127.0.0.1:6379 --disable-usage-stats\n"
        assert not (fake_pod.host("tpu-a", i) / "jaxrl" / "driver").exists()
    assert (fake_pod.host("tpu-a", 0) / "jaxrl" / "driver").read_text() == "127.0.0.1:6379"
    ssh_workers = [a[6] for a in fake_pod.calls() if a[3:5] == ["tpu-vm", "ssh"] and a[6] != "--worker=all"]
    assert ssh_workers[0] == "--worker=0" and sorted(ssh_workers[1:4]) == ["--worker=1", "--worker=2", "--worker=3"]
    assert ssh_workers[4:] == ["--worker=0"]
    assert fake_pod.calls()[-1][3:5] == ["tpu-vm", "delete"]
