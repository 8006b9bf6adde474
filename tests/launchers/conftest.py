"""Fixtures for the TPU pod launcher tests: a fake gcloud first on PATH and a launcher runner that cleans up.

Every process these tests start (the launcher, the fake gcloud, the simulated hosts' programs) carries a
marker in its environment (FAKE_GCLOUD_ROOT=<this test's root>, or HOME under <root>/hosts/); `leftovers`
finds them through /proc, the tests assert there are none, and teardown SIGKILLs any, by PID.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launchers import fake_gcloud

REPO = Path(__file__).resolve().parents[2]


def leftovers(root: Path) -> list[int]:
    """PIDs of live processes started for this test's fake pod (launcher, fake gcloud, host programs)."""
    markers = (f"FAKE_GCLOUD_ROOT={root}".encode(), f"HOME={root}/hosts/".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        if any(m in environ for m in markers):
            found.append(int(entry.name))
    return found


class FakePod:
    """A fake gcloud installation plus helpers to run `python -m launchers.tpu_pod` against it."""

    def __init__(self, root: Path):
        self.root = root
        bindir = fake_gcloud.install(root)
        self.env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
                    "FAKE_GCLOUD_ROOT": str(root)}
        found = shutil.which("gcloud", path=self.env["PATH"])
        assert found == str(bindir / "gcloud"), f"the fake gcloud is not first on PATH: {found}"
        self.started: list[subprocess.Popen] = []

    def calls(self) -> list[list[str]]:
        path = self.root / "calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["argv"] for line in path.read_text().splitlines()]

    def host(self, name: str, i: int) -> Path:
        return self.root / "hosts" / name / f"w{i}"

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "launchers.tpu_pod", *args], cwd=REPO,
                             env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        self.started.append(p)
        return p

    def launch(self, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        p = self.start(*args, env=env)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = p.communicate()
            pytest.fail(f"launcher {shlex.join(args)} still running after {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def kill_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in leftovers(self.root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.started:
            p.wait()

    def wait_no_leftovers(self, timeout: float = 5.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while (left := leftovers(self.root)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


@pytest.fixture
def fake_pod(tmp_path):
    pod = FakePod(tmp_path / "gcloud")
    try:
        yield pod
    finally:
        pod.kill_all()


POD = ["--name", "tpu-a", "--zone", "us-central2-b", "--project", "proj-1"]


def pod_args(accel: str, *extra: str) -> list[str]:
    return [*POD, "--accelerator-type", accel, *extra]


@pytest.fixture
def tiny_checkout(tmp_path):
    """A two-file checkout for tests that need ~/jaxrl on the hosts but not the project's code."""
    src = tmp_path / "checkout"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (src / "outputs").mkdir()
    (src / "outputs" / "big.bin").write_text("not shipped")
    return src
