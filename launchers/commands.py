"""Command construction for the TPU pod launcher: pure functions, arguments -> gcloud argv / remote shell text.

Nothing here runs anything; `launchers.tpu_pod` executes what these return, and the tests compare them
word for word (golden argv). Every gcloud call names its zone and, when given, its project, so nothing
depends on `gcloud config` defaults.

Remote layout on every worker: the checkout in `~/jaxrl` (replaced by each sync), a virtual environment in
`~/jaxrl-venv` (Python 3.11 made by `uv`, since the TPU VM images ship Ubuntu 22.04's Python 3.10), and the
program run from `~/jaxrl` with the venv first on `PATH`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

GCLOUD = "gcloud"
REMOTE_DIR = "jaxrl"                 # ~/jaxrl on every worker
REMOTE_TARBALL = "jaxrl.tar.gz"      # ~/jaxrl.tar.gz while a sync unpacks it
REMOTE_VENV = "jaxrl-venv"           # ~/jaxrl-venv
RAY_PORT = 6379
DEFAULT_VERSION = "tpu-ubuntu2204-base"   # the runtime version Google lists for v4 and older (JAX/PyTorch)
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/*")   # v4 and older: /dev/accel<N>; v5e/v5p/v6e: VFIO


@dataclass(frozen=True)
class Pod:
    """The TPU VM (or queued resource) every subcommand addresses.

    name: the TPU VM node name (also the queued resource id with `queued`); zone, project (None: gcloud's
    default project); accelerator_type e.g. "v4-16"; version: the TPU runtime version; queued: create through
    a queued resource; spot / reserved: its tier (queued or plain create); internal_ip: ssh/scp over the VPC.
    """

    name: str
    zone: str
    accelerator_type: str
    project: str | None = None
    version: str = DEFAULT_VERSION
    queued: bool = False
    spot: bool = False
    reserved: bool = False
    internal_ip: bool = False


def _where(pod: Pod) -> list[str]:
    return [f"--zone={pod.zone}"] + ([f"--project={pod.project}"] if pod.project else [])


# ---- lifecycle ------------------------------------------------------------------------------------------

def create_argv(pod: Pod) -> list[str]:
    """The create call: `tpu-vm create` (waits until the node is READY) or `queued-resources create`."""
    if pod.queued:
        argv = [GCLOUD, "compute", "tpus", "queued-resources", "create", pod.name, f"--node-id={pod.name}",
                *_where(pod), f"--accelerator-type={pod.accelerator_type}", f"--runtime-version={pod.version}"]
    else:
        argv = [GCLOUD, "compute", "tpus", "tpu-vm", "create", pod.name, *_where(pod),
                f"--accelerator-type={pod.accelerator_type}", f"--version={pod.version}"]
    if pod.spot:
        argv.append("--spot")
    if pod.reserved:
        argv.append("--reserved")
    return argv


def queued_state_argv(pod: Pod) -> list[str]:
    """Prints the queued resource's state (ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED, ...)."""
    return [GCLOUD, "compute", "tpus", "queued-resources", "describe", pod.name, *_where(pod),
            "--format=value(state.state)"]


def describe_argv(pod: Pod) -> list[str]:
    """The node as JSON; `networkEndpoints` lists one entry (with `ipAddress`) per worker."""
    return [GCLOUD, "compute", "tpus", "tpu-vm", "describe", pod.name, *_where(pod), "--format=json"]


def delete_argv(pod: Pod) -> list[str]:
    """Delete without a prompt; a queued resource is deleted with its node (`--force`)."""
    if pod.queued:
        return [GCLOUD, "compute", "tpus", "queued-resources", "delete", pod.name, *_where(pod), "--force",
                "--quiet"]
    return [GCLOUD, "compute", "tpus", "tpu-vm", "delete", pod.name, *_where(pod), "--quiet"]


# ---- transport ------------------------------------------------------------------------------------------

def _ssh_common(pod: Pod) -> list[str]:
    return ["--strict-host-key-checking=no", "--quiet"] + (["--internal-ip"] if pod.internal_ip else [])


def scp_argv(pod: Pod, local_path: str, remote_path: str, worker: str = "all") -> list[str]:
    """Copy one local file to `remote_path` (relative to the home folder) on `worker` ("all" or an index)."""
    return [GCLOUD, "compute", "tpus", "tpu-vm", "scp", local_path, f"{pod.name}:{remote_path}",
            f"--worker={worker}", *_where(pod), *_ssh_common(pod)]


def ssh_argv(pod: Pod, worker: int | str, command: str, tty: bool = False) -> list[str]:
    """Run shell text `command` on `worker` ("all" or an index).

    tty: force a remote terminal (`ssh -tt`), so that when this ssh client is killed the remote session gets
    SIGHUP and the program dies with it; without it a killed client leaves the remote program running.
    """
    argv = [GCLOUD, "compute", "tpus", "tpu-vm", "ssh", pod.name, f"--worker={worker}", *_where(pod),
            *_ssh_common(pod), f"--command={command}"]
    if tty:
        argv.append("--ssh-flag=-tt")
    return argv


# ---- remote shell text ----------------------------------------------------------------------------------

def default_install(extras: str = "tpu") -> str:
    """Install the checkout (cwd ~/jaxrl) into ~/jaxrl-venv: `pip install -e ".[<extras>]"` under Python 3.11.

    uv provides the 3.11 interpreter (the TPU VM images have 3.10); `--allow-existing` reuses the venv.
    """
    return (f"python3 -m pip install --user --quiet --upgrade uv"
            f" && python3 -m uv venv --seed --allow-existing --python 3.11 ~/{REMOTE_VENV}"
            f" && ~/{REMOTE_VENV}/bin/python -m pip install --quiet -e {shlex.quote(f'.[{extras}]')}")


def sync_command(install: str) -> str:
    """Unpack ~/jaxrl.tar.gz into a fresh ~/jaxrl, remove the tarball, then run `install` inside ~/jaxrl."""
    return (f"rm -rf ~/{REMOTE_DIR} && mkdir -p ~/{REMOTE_DIR}"
            f" && tar -xzf ~/{REMOTE_TARBALL} -C ~/{REMOTE_DIR} && rm -f ~/{REMOTE_TARBALL}"
            f" && cd ~/{REMOTE_DIR} && {install}")


def free_tpu_command() -> str:
    """Free the host's TPU from stale holders (a crashed earlier run, a notebook): SIGKILL every process that has
    a TPU device open, wait (at most 5 s) until none does, and remove libtpu's lock file.

    The same two things MaxText's multihost_runner.py does before each run (its kill script: the processes
    holding the accelerator device files, then `/tmp/libtpu_lockfile`); both device families are tried so
    the step does not need the TPU generation.
    """
    devices = " ".join(TPU_DEVICE_GLOBS)
    return (f"{{ holders=$(sudo lsof -t {devices} 2>/dev/null | sort -u);"
            f" if [ -n \"$holders\" ]; then echo \"jaxrl-tpu: killing stale TPU holders: $holders\";"
            f" sudo kill -9 $holders;"
            f" for _ in $(seq 50); do sudo lsof -t {devices} >/dev/null 2>&1 || break; sleep 0.1; done; fi;"
            f" sudo rm -f {LIBTPU_LOCKFILE}; }}")


def _exports(env: dict[str, str]) -> str:
    return "".join(f" && export {k}={shlex.quote(v)}" for k, v in env.items())


def host_prelude(env: dict[str, str], free_tpu: bool = True) -> str:
    """What every remote program starts with: cd ~/jaxrl, the venv first on PATH, the TPU freed, `env` exported."""
    text = f"cd ~/{REMOTE_DIR} && export PATH=\"$HOME/{REMOTE_VENV}/bin:$PATH\""
    if free_tpu:
        text += " && " + free_tpu_command()
    return text + _exports(env)


def program_command(program: list[str], env: dict[str, str]) -> str:
    """The text one host runs: the prelude, then `exec <program>` (so the program is the ssh session's process)."""
    return f"{host_prelude(env)} && exec {shlex.join(program)}"


def run_plan(pod: Pod, workers: int, program: list[str], env: dict[str, str]) -> list[list[str]]:
    """One ssh per worker, index i -> `--worker=i`, each with a remote terminal so a stopped client stops it."""
    text = program_command(program, env)
    return [ssh_argv(pod, i, text, tty=True) for i in range(workers)]


# ---- Ray variant (the Ray backend itself is issue 16) ----------------------------------------------------

def ray_head_command(env: dict[str, str]) -> str:
    """Worker 0: start the Ray head (GCS on RAY_PORT); returns once it is up."""
    return f"{host_prelude(env)} && ray start --head --port={RAY_PORT} --disable-usage-stats"


def ray_worker_command(head_ip: str, env: dict[str, str]) -> str:
    """Workers 1..n-1: join the head at `head_ip`:RAY_PORT; returns once joined."""
    return f"{host_prelude(env)} && ray start --address={head_ip}:{RAY_PORT} --disable-usage-stats"


def ray_driver_command(head_ip: str, program: list[str], env: dict[str, str]) -> str:
    """Worker 0: the driver program with RAY_ADDRESS set to the head (the TPU was freed before `ray start`)."""
    driver_env = {**env, "RAY_ADDRESS": f"{head_ip}:{RAY_PORT}"}
    return f"{host_prelude(driver_env, free_tpu=False)} && exec {shlex.join(program)}"


def ray_plan(pod: Pod, workers: int, head_ip: str, program: list[str],
             env: dict[str, str]) -> tuple[list[str], list[list[str]], list[str]]:
    """(head start on worker 0, [joins on workers 1..n-1, started together], driver on worker 0)."""
    head = ssh_argv(pod, 0, ray_head_command(env))
    joins = [ssh_argv(pod, i, ray_worker_command(head_ip, env)) for i in range(1, workers)]
    driver = ssh_argv(pod, 0, ray_driver_command(head_ip, program, env), tty=True)
    return head, joins, driver
