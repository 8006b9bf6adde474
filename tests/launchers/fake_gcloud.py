"""A fake `gcloud` for the TPU pod launcher's tests: records every call, simulates a pod on this machine.

Installed by `install(root)`: `root/bin/gcloud` (put first on PATH) runs this file with FAKE_GCLOUD_ROOT=root.
Every call appends `{"argv": [...], "pid": <this process>}` to `root/calls.jsonl` before anything else.

What it simulates (the subset of gcloud the launcher uses):
- `compute tpus tpu-vm create NAME --accelerator-type=v4-N` (v4 / v5p: N/8 hosts): host folders
  `root/hosts/NAME/w<i>` (each host's HOME) and one free loopback port for the pod's JAX coordinator;
- `compute tpus queued-resources create QR --node-id=NAME ...`: the same node, its state going
  WAITING_FOR_RESOURCES x FAKE_GCLOUD_QUEUED_POLLS (env at create time, default 1), PROVISIONING, ACTIVE on
  successive `queued-resources describe QR --format=value(state.state)`;
- `tpu-vm describe NAME --format=json`: networkEndpoints, one per host, ipAddress 127.0.0.1;
- `tpu-vm scp SRC NAME:DEST --worker=i|all`: copies SRC into the host folders;
- `tpu-vm ssh NAME --worker=i --command=C`: execs `bash -c C` in host i's folder as host i: HOME = the folder,
  PATH = `root/hostbin` (fake `sudo` and `ray` that only log their argv to `$HOME/<name>.log`) + ours, and
  the JAX world env of issue 15 on loopback: JAXRL_COORDINATOR_ADDRESS=127.0.0.1:<pod port>,
  JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID=i, JAXRL_LOCAL_DEVICE_COUNT=2. Nothing else of our environment
  reaches a host (as with real ssh), except what Python needs to start (PYENV_ROOT, LANG, TMPDIR);
  `--worker=all` runs every host at once and exits with the largest code;
- `tpu-vm delete NAME`, `queued-resources delete QR --force`: the pod is gone (later calls: NOT_FOUND).
Anything else exits 2. Not simulated: auth, quotas, TPU metadata, GCS, real ssh (see launchers/README.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

LOCAL_DEVICES = 2
HOST_ENV_KEEP = ("PYENV_ROOT", "LANG", "LC_ALL", "TMPDIR", "USER", "LOGNAME")
_SHIM = """#!/bin/sh
printf '%s\\n' "$*" >> "$HOME/{name}.log"
exit 0
"""


def install(root: Path) -> Path:
    """Create root/bin/gcloud and root/hostbin/{sudo,ray}; returns root/bin (to put first on PATH)."""
    root = Path(root)
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "hostbin").mkdir(exist_ok=True)
    gcloud = root / "bin" / "gcloud"
    gcloud.write_text(f"#!/bin/sh\nFAKE_GCLOUD_ROOT={root} exec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    for name in ("sudo", "ray"):
        (root / "hostbin" / name).write_text(_SHIM.format(name=name))
    for f in [gcloud, root / "hostbin" / "sudo", root / "hostbin" / "ray"]:
        f.chmod(0o755)
    return root / "bin"


def _fail(msg: str, code: int = 1) -> None:
    print(f"ERROR: (fake gcloud) {msg}", file=sys.stderr)
    sys.exit(code)


@contextmanager
def _state(root: Path):
    """The simulated project ({"pods": {...}}) under an exclusive lock; written back on exit."""
    path = root / "state.json"
    with open(root / "state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text()) if path.exists() else {"pods": {}}
        yield state
        path.write_text(json.dumps(state, indent=1))


def _flags(args: list[str]) -> tuple[list[str], dict[str, str]]:
    pos, flags = [], {}
    for a in args:
        if a.startswith("--"):
            k, _, v = a[2:].partition("=")
            flags[k] = v
        else:
            pos.append(a)
    return pos, flags


def _hosts_of(accel: str) -> int:
    family, _, n = accel.partition("-")
    if family not in ("v4", "v5p") or not n.isdigit() or int(n) % 8:
        _fail(f"the fake only simulates v4-N / v5p-N (N a multiple of 8), got {accel!r}", 2)
    return int(n) // 8


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_pod(root: Path, state: dict, name: str, accel: str, queued: bool) -> None:
    pods = state["pods"]
    if name in pods and not pods[name]["deleted"]:
        _fail(f"ALREADY_EXISTS: node {name}")
    hosts = _hosts_of(accel)
    base = root / "hosts" / name
    shutil.rmtree(base, ignore_errors=True)
    for i in range(hosts):
        (base / f"w{i}").mkdir(parents=True)
    polls = int(os.environ.get("FAKE_GCLOUD_QUEUED_POLLS", "1"))
    pods[name] = {"name": name, "accelerator_type": accel, "hosts": hosts, "port": _free_port(), "deleted": False,
                  "queued": queued, "states": ["WAITING_FOR_RESOURCES"] * polls + ["PROVISIONING"]}


def _live(state: dict, name: str) -> dict:
    pod = state["pods"].get(name)
    if pod is None or pod["deleted"]:
        _fail(f"NOT_FOUND: node {name}")
    return pod


def _workers(pod: dict, worker: str) -> list[int]:
    if worker == "all":
        return list(range(pod["hosts"]))
    if not worker.isdigit() or int(worker) >= pod["hosts"]:
        _fail(f"--worker={worker}: the pod has workers 0..{pod['hosts'] - 1}")
    return [int(worker)]


def host_env(root: Path, pod: dict, i: int) -> dict[str, str]:
    env = {k: os.environ[k] for k in HOST_ENV_KEEP if k in os.environ}
    env.update(PATH=f"{root / 'hostbin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               HOME=str(root / "hosts" / pod["name"] / f"w{i}"),
               JAXRL_COORDINATOR_ADDRESS=f"127.0.0.1:{pod['port']}", JAXRL_NUM_PROCESSES=str(pod["hosts"]),
               JAXRL_PROCESS_ID=str(i), JAXRL_LOCAL_DEVICE_COUNT=str(LOCAL_DEVICES))
    return env


def main(argv: list[str]) -> None:
    root = Path(os.environ["FAKE_GCLOUD_ROOT"])
    with open(root / "calls.jsonl", "a") as f:
        f.write(json.dumps({"argv": ["gcloud", *argv], "pid": os.getpid()}) + "\n")
    if argv[:2] != ["compute", "tpus"] or len(argv) < 4:
        _fail(f"unsupported command: gcloud {' '.join(argv)}", 2)
    group, verb = argv[2], argv[3]
    pos, flags = _flags(argv[4:])
    if group == "tpu-vm" and verb == "create":
        with _state(root) as st:
            _new_pod(root, st, pos[0], flags["accelerator-type"], queued=False)
        print(f"Created tpu [{pos[0]}].", file=sys.stderr)
    elif group == "queued-resources" and verb == "create":
        node = flags["node-id"]
        with _state(root) as st:
            _new_pod(root, st, node, flags["accelerator-type"], queued=True)
            st["pods"][node]["queued_id"] = pos[0]
    elif group == "queued-resources" and verb == "describe":
        with _state(root) as st:
            pod = next((p for p in st["pods"].values() if p.get("queued_id") == pos[0] and not p["deleted"]), None)
            if pod is None:
                _fail(f"NOT_FOUND: queued resource {pos[0]}")
            print(pod["states"].pop(0) if pod["states"] else "ACTIVE")
    elif group == "queued-resources" and verb == "delete":
        with _state(root) as st:
            pod = next((p for p in st["pods"].values() if p.get("queued_id") == pos[0] and not p["deleted"]), None)
            if pod is None:
                _fail(f"NOT_FOUND: queued resource {pos[0]}")
            if "force" not in flags:
                _fail("the queued resource still has a node: use --force", 1)
            pod["deleted"] = True
    elif group == "tpu-vm" and verb == "describe":
        with _state(root) as st:
            pod = _live(st, pos[0])
        print(json.dumps({"name": pos[0], "acceleratorType": pod["accelerator_type"], "state": "READY",
                          "networkEndpoints": [{"ipAddress": "127.0.0.1", "port": 8470}] * pod["hosts"]}))
    elif group == "tpu-vm" and verb == "delete":
        with _state(root) as st:
            _live(st, pos[0])["deleted"] = True
    elif group == "tpu-vm" and verb == "scp":
        src, dest = pos[0], pos[1]
        name, _, remote = dest.partition(":")
        with _state(root) as st:
            pod = _live(st, name)
        for i in _workers(pod, flags.get("worker", "0")):
            target = root / "hosts" / name / f"w{i}" / (remote.removeprefix("~/") or Path(src).name)
            shutil.copyfile(src, target)
    elif group == "tpu-vm" and verb == "ssh":
        with _state(root) as st:
            pod = _live(st, pos[0])
        hosts = _workers(pod, flags.get("worker", "0"))
        command = flags.get("command")
        if command is None:
            _fail("the fake runs only --command=...", 2)
        cwd = lambda i: root / "hosts" / pos[0] / f"w{i}"  # noqa: E731
        if len(hosts) == 1:
            os.chdir(cwd(hosts[0]))
            os.execve("/bin/bash", ["bash", "-c", command], host_env(root, pod, hosts[0]))
        children = [subprocess.Popen(["/bin/bash", "-c", command], cwd=cwd(i), env=host_env(root, pod, i))
                    for i in hosts]
        sys.exit(max(c.wait() for c in children))
    else:
        _fail(f"unsupported command: gcloud {' '.join(argv)}", 2)


if __name__ == "__main__":
    main(sys.argv[1:])
