"""The launcher's pure parts: host counts, gcloud argv, remote shell text, checks, the checkout tarball."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import pytest

from launchers import checks, commands, tarball, topology
from launchers.commands import Pod

REPO = Path(__file__).resolve().parents[2]
WHERE = ["--zone=us-central2-b", "--project=proj-1"]
SSH_COMMON = ["--strict-host-key-checking=no", "--quiet"]


@pytest.mark.parametrize("accel,hosts", [
    ("v4-8", 1), ("v4-16", 2), ("v4-32", 4), ("v4-128", 16), ("v5p-16", 2), ("v2-8", 1), ("v3-32", 4),
    ("v5litepod-1", 1), ("v5litepod-8", 1), ("v5litepod-16", 4), ("v6e-8", 1), ("v6e-256", 64)])
def test_num_hosts(accel, hosts):
    assert topology.num_hosts(accel) == hosts


@pytest.mark.parametrize("accel", ["v4-12", "v4-4", "v7-8", "tpu", "v6e-12", "v5litepod-2"])
def test_num_hosts_refuses_with_the_value(accel):
    with pytest.raises(topology.TopologyError, match=re.escape(repr(accel))):
        topology.num_hosts(accel)


def test_create_and_delete_argv():
    pod = Pod("tpu-a", "us-central2-b", "v4-16", project="proj-1")
    assert commands.create_argv(pod) == [
        "gcloud", "compute", "tpus", "tpu-vm", "create", "tpu-a", *WHERE, "--accelerator-type=v4-16",
        "--version=tpu-ubuntu2204-base"]
    assert commands.delete_argv(pod) == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "tpu-a", *WHERE, "--quiet"]
    q = Pod("tpu-a", "us-central2-b", "v4-16", project="proj-1", queued=True, spot=True)
    assert commands.create_argv(q) == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "tpu-a", "--node-id=tpu-a", *WHERE,
        "--accelerator-type=v4-16", "--runtime-version=tpu-ubuntu2204-base", "--spot"]
    assert commands.delete_argv(q) == [
        "gcloud", "compute", "tpus", "queued-resources", "delete", "tpu-a", *WHERE, "--force", "--quiet"]
    no_project = Pod("tpu-a", "europe-west4-a", "v4-8")
    assert commands.describe_argv(no_project) == [
        "gcloud", "compute", "tpus", "tpu-vm", "describe", "tpu-a", "--zone=europe-west4-a", "--format=json"]


def test_run_plan_is_one_ssh_per_worker_with_the_same_program():
    pod = Pod("tpu-a", "us-central2-b", "v4-32", project="proj-1", internal_ip=True)
    program = ["python", "-m", "jaxrl.train", "trainer.default_local_dir=/mnt/gcs/run dir"]
    plan = commands.run_plan(pod, 4, program, {"WANDB_MODE": "offline", "MSG": "a b'c"})
    text = commands.program_command(program, {"WANDB_MODE": "offline", "MSG": "a b'c"})
    assert plan == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu-a", f"--worker={i}", *WHERE, *SSH_COMMON,
                     "--internal-ip", f"--command={text}", "--ssh-flag=-tt"] for i in range(4)]
    # the remote text: into the checkout, venv first, TPU freed, env exported (quoted), then exec the program
    assert text.startswith('cd ~/jaxrl && export PATH="$HOME/jaxrl-venv/bin:$PATH" && { holders=')
    assert text.endswith(" && export WANDB_MODE=offline && export MSG='a b'\"'\"'c' && exec python -m jaxrl.train "
                         "'trainer.default_local_dir=/mnt/gcs/run dir'")
    # a shell reads the exported value back unchanged
    out = subprocess.run(["bash", "-c", f"true{commands._exports({'MSG': 'a b' + chr(39) + 'c $HOME'})} && "
                          "printf %s \"$MSG\""], capture_output=True, text=True).stdout
    assert out == "a b'c $HOME"


def test_free_tpu_command_kills_the_holders_and_removes_the_lockfile(tmp_path):
    """Run the real shell text with a `sudo` that answers `lsof` with a process we started (then nothing once it
    is dead) and runs `kill` for real: the holder dies, the loop ends, the lock file removal is asked for."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        bindir = tmp_path / "bin"
        bindir.mkdir()
        log = tmp_path / "sudo.log"
        (bindir / "sudo").write_text(
            "#!/bin/bash\n"
            f"echo \"$*\" >> {log}\n"
            "case \"$1\" in\n"
            f"  lsof) grep -qs '^State:[[:space:]]*[^Z[:space:]]' /proc/{holder.pid}/status"   # alive, not a zombie
            f" && echo {holder.pid} && exit 0; exit 1;;\n"
            "  kill) exec \"$@\";;\n"
            "  *) exit 0;;\n"
            "esac\n")
        (bindir / "sudo").chmod(0o755)
        t0 = time.monotonic()
        res = subprocess.run(["bash", "-c", commands.free_tpu_command() + " && echo freed"], capture_output=True,
                             text=True, env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}, timeout=30)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [f"jaxrl-tpu: killing stale TPU holders: {holder.pid}", "freed"]
        assert holder.wait(timeout=5) == -9
        assert time.monotonic() - t0 < 5
        lines = log.read_text().splitlines()
        assert lines[0] == "lsof -t /dev/accel* /dev/vfio/*"
        assert f"kill -9 {holder.pid}" in lines
        assert lines[-1] == "rm -f /tmp/libtpu_lockfile"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_sync_and_install_text():
    assert commands.default_install() == (
        "python3 -m pip install --user --quiet --upgrade uv && python3 -m uv venv --seed --allow-existing "
        "--python 3.11 ~/jaxrl-venv && ~/jaxrl-venv/bin/python -m pip install --quiet -e '.[tpu]'")
    assert commands.default_install("tpu,ray").endswith("-e '.[tpu,ray]'")
    assert commands.sync_command("true") == (
        "rm -rf ~/jaxrl && mkdir -p ~/jaxrl && tar -xzf ~/jaxrl.tar.gz -C ~/jaxrl && rm -f ~/jaxrl.tar.gz "
        "&& cd ~/jaxrl && true")


def test_ray_plan():
    pod = Pod("tpu-a", "us-central2-b", "v4-32", project="proj-1")
    head, joins, driver = commands.ray_plan(pod, 4, "10.0.0.2", ["python", "drive.py"], {"K": "v"})
    assert head[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu-a", "--worker=0"]
    assert head[-1].endswith(" && export K=v && ray start --head --port=6379 --disable-usage-stats")
    assert [j[6] for j in joins] == ["--worker=1", "--worker=2", "--worker=3"]
    assert all(j[-1].endswith("ray start --address=10.0.0.2:6379 --disable-usage-stats") for j in joins)
    assert driver[6] == "--worker=0" and driver[-1] == "--ssh-flag=-tt"
    assert driver[-2].endswith("export K=v && export RAY_ADDRESS=10.0.0.2:6379 && exec python drive.py")
    assert "lsof" not in driver[-2]   # freeing the TPU now would kill Ray's own workers


# ---- checks ---------------------------------------------------------------------------------------------

TRAIN = ["python", "-m", "jaxrl.train", "--config", "configs/quickstart.yaml"]


def test_parse_env():
    assert checks.parse_env(["A=1", "B=x=y", "A=2", "C="]) == {"A": "2", "B": "x=y", "C": ""}
    for bad in ["A", "1A=2", "A-B=1", "=v"]:
        with pytest.raises(checks.LaunchError, match=re.escape(repr(bad))):
            checks.parse_env([bad])


@pytest.mark.parametrize("program,workers,shared,error", [
    (TRAIN + ["trainer.distributed.mode=auto"], 2, [], "sets no trainer.default_local_dir"),
    (TRAIN + ["trainer.default_local_dir=outputs/x", "trainer.distributed.mode=auto"], 2, [], "'outputs/x' is not"),
    (TRAIN + ["trainer.default_local_dir=/mnt/nfsx/r", "trainer.distributed.mode=auto"], 2, ["/mnt/nfs"],
     "'/mnt/nfsx/r' is not shared storage"),
    (TRAIN + ["trainer.default_local_dir=gs://b/r", "trainer.distributed.mode=auto"], 2, ["/mnt/gcs"],
     "'gs://b/r' is a URL, which jaxrl.train cannot use"),
    (TRAIN + ["trainer.default_local_dir=gs://b/r"], 1, [], "'gs://b/r' is a URL"),
    (TRAIN + ["trainer.default_local_dir=/mnt/nfs/r"], 2, ["/mnt/nfs"],
     "2 hosts but the program sets no trainer.distributed"),
    (TRAIN + ["trainer.default_local_dir=/mnt/nfs/r"], 1, ["mnt/nfs"], "'mnt/nfs': expected an absolute path"),
    ([], 2, [], "no program given"),
])
def test_check_program_refuses(program, workers, shared, error):
    with pytest.raises(checks.LaunchError, match=re.escape(error)):
        checks.check_program(program, workers, shared)


@pytest.mark.parametrize("program,workers,shared,driver_only", [
    (TRAIN + ["trainer.default_local_dir=/mnt/gcs/r", "trainer.distributed.mode=auto"], 4, ["/mnt/gcs"], False),
    (TRAIN + ["trainer.default_local_dir=/mnt/nfs/r", "++trainer.distributed.mode=auto"], 2, ["/mnt/nfs/"], False),
    (TRAIN + ["trainer.default_local_dir=/mnt/nfs"], 1, ["/mnt/nfs"], False),
    (TRAIN + ["trainer.default_local_dir=/mnt/gcs/r"], 4, ["/mnt/gcs"], True),  # Ray: one driver process
    (["python", "-c", "print(1)"], 4, [], False),                          # not jaxrl.train: no trainer checks
])
def test_check_program_accepts(program, workers, shared, driver_only):
    checks.check_program(program, workers, shared, driver_only=driver_only)


def test_override_last_wins_and_plus_forms():
    prog = TRAIN + ["trainer.default_local_dir=a", "+trainer.default_local_dir=b", "x.trainer.default_local_dir=c"]
    assert checks.override(prog, "trainer.default_local_dir") == "b"
    assert checks.is_train_program(["python3", "jaxrl/train.py"]) and not checks.is_train_program(["jaxrl.train"])


# ---- tarball --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,out", [
    ("jaxrl/train.py", False), ("configs/quickstart.yaml", False), ("tests/launchers/world_check.py", False),
    ("outputs/quickstart/metrics.jsonl", True), ("jaxrl/__pycache__/x.pyc", True), (".git/HEAD", True),
    (".venv/bin/python", True), (".venv-bench/x", True), ("jaxrl.egg-info/PKG-INFO", True), ("a/b.pyc", True),
    (".pytest_cache/v", True), ("checkpoints/global_step_1/meta", True), ("docs/outputs/x.md", False),
    ("jaxrl.tar.gz", True)])
def test_excluded(path, out):
    assert tarball.excluded(path) is out


def test_tarball_of_a_checkout(tmp_path):
    src = tmp_path / "src"
    for rel in ["pkg/a.py", "pkg/__pycache__/a.cpython-311.pyc", "outputs/run/m.jsonl", ".git/config",
                "README.md", ".venv/lib/x.py", "tests/t.py"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    files = tarball.checkout_files(src)
    assert files == ["README.md", "pkg/a.py", "tests/t.py"]
    dest = tmp_path / "c.tar.gz"
    tarball.build_tarball(src, dest, files)
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == files
        assert tar.extractfile("pkg/a.py").read() == b"pkg/a.py"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tarball.checkout_files(tmp_path / "missing")


# ---- packaging ------------------------------------------------------------------------------------------

def test_pyproject_tpu_extra_matches_the_project_jax_and_installs_the_launcher():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    jax_pin = next(d for d in meta["project"]["dependencies"] if re.match(r"jax==", d))
    assert meta["project"]["optional-dependencies"]["tpu"] == [f"jax[tpu]=={jax_pin.split('==')[1]}"]
    assert meta["project"]["scripts"]["jaxrl-tpu"] == "launchers.tpu_pod:main"
    assert "launchers*" in meta["tool"]["setuptools"]["packages"]["find"]["include"]


def test_launchers_import_only_the_standard_library():
    """The launcher runs on a laptop with only gcloud and Python: nothing outside the stdlib (and itself)."""
    code = ("import sys, launchers.tpu_pod; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names "
            "and m.split('.')[0] not in ('launchers', '__main__')); print(bad)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_names_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "launchers.tpu_pod", "--help"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0
    assert "{up,sync,run,down}" in out.stdout
