"""`python -m launchers.tpu_pod` / `jaxrl-tpu`: run jaxrl on a Cloud TPU pod through gcloud.

    jaxrl-tpu up   --name N --zone Z --accelerator-type v4-16 [--project P] [--queued [--spot|--reserved]]
    jaxrl-tpu sync --name N --zone Z --accelerator-type v4-16 [--extras tpu] [--install CMD]
    jaxrl-tpu run  --name N --zone Z --accelerator-type v4-16 [--env K=V]... [--shared-storage /mnt/x]...
                   [--ray] [--keep] -- python -m jaxrl.train --config configs/x.yaml \\
                   trainer.default_local_dir=/mnt/x/run trainer.distributed.mode=auto
    jaxrl-tpu down --name N --zone Z --accelerator-type v4-16
    (every subcommand takes --dry-run: print the exact gcloud commands, run nothing)

What each does, and when the TPU is deleted (unless --keep):
- up: `tpu-vm create` (returns when the node is READY) or, with --queued, `queued-resources create` then its
  state polled every --poll-interval s until ACTIVE (FAILED/SUSPENDED or --timeout: error). Deleted when the
  wait fails or is interrupted after the request was made.
- sync: the checkout (launchers.tarball: no outputs, venvs, caches, .git) as one tarball to every worker,
  unpacked into a fresh ~/jaxrl, then the install (default: `pip install -e ".[tpu]"` in ~/jaxrl-venv).
  Never deletes: it reminds you of `down` when it fails.
- run: the checks (launchers.checks) first, then `tpu-vm describe` (worker count and IPs), then one
  `tpu-vm ssh --worker=i` per host, all started together, each freeing stale TPU holders before `exec`ing
  the program; output prefixed `[w<i>]`. The first host that exits non-zero stops all others and its exit
  code is returned. The TPU is deleted at exit: success, failure, Ctrl-C or SIGTERM.
  --ray: `ray start --head` on worker 0, `ray start --address=<worker 0>:6379` on the others, then the program
  once, on worker 0, as the Ray driver (the Ray backend it would drive is issue 16).
- down: delete (a queued resource with its node).

Exit codes: 0; 2 for usage errors (one `jaxrl-tpu: error:` line, nothing started); a failing gcloud call's or
host's code; 128 + signal when interrupted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from launchers import checks, commands, procs, tarball, topology
from launchers.commands import Pod

PROG = "jaxrl-tpu"
CHECKOUT = Path(__file__).resolve().parents[1]
QUEUED_OK = "ACTIVE"
QUEUED_FAILED = ("FAILED", "SUSPENDING", "SUSPENDED", "DELETING")


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _show(argv: list[str]) -> None:
    print(shlex.join(argv), flush=True)


# ---- arguments ------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    pod = argparse.ArgumentParser(add_help=False)
    g = pod.add_argument_group("the pod (give the same values to every subcommand)")
    g.add_argument("--name", required=True, help="TPU VM name (also the queued resource id)")
    g.add_argument("--zone", required=True, help="e.g. us-central2-b")
    g.add_argument("--accelerator-type", required=True, help="e.g. v4-16 (2 hosts), v4-32 (4 hosts)")
    g.add_argument("--project", help="GCP project (default: gcloud's configured project)")
    g.add_argument("--version", default=commands.DEFAULT_VERSION, help="TPU runtime version")
    g.add_argument("--queued", action="store_true", help="create through a queued resource")
    tier = g.add_mutually_exclusive_group()
    tier.add_argument("--spot", action="store_true", help="Spot capacity: cheaper, can be preempted any time")
    tier.add_argument("--reserved", action="store_true", help="use the project's reservation")
    g.add_argument("--internal-ip", action="store_true", help="ssh/scp over internal IPs (launcher inside the VPC)")
    g.add_argument("--keep", action="store_true", help="never delete the TPU on exit, failure or Ctrl-C")
    g.add_argument("--dry-run", action="store_true", help="print the exact gcloud commands, run nothing")

    p = argparse.ArgumentParser(prog=PROG, description="Run jaxrl on a Cloud TPU pod through gcloud.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", parents=[pod], help="create the TPU VM (or queued resource) and wait for it")
    up.add_argument("--timeout", type=float, default=3600.0, help="queued: seconds to wait for ACTIVE")
    up.add_argument("--poll-interval", type=float, default=30.0, help="queued: seconds between state checks")
    sync = sub.add_parser("sync", parents=[pod], help="copy the checkout to every worker and install it")
    sync.add_argument("--source", type=Path, default=CHECKOUT, help="checkout to send (default: this one)")
    sync.add_argument("--extras", default="tpu", help="pip extras to install, e.g. tpu or tpu,ray")
    sync.add_argument("--install", help="remote install command run in ~/jaxrl (default: venv + pip install -e)")
    run = sub.add_parser("run", parents=[pod], help="run a program on every host (after --); deletes at exit")
    run.add_argument("--env", action="append", default=[], metavar="K=V", help="export on every host")
    run.add_argument("--shared-storage", action="append", default=[], metavar="PATH",
                     help="a filesystem mounted on every host (allowed for trainer.default_local_dir)")
    run.add_argument("--ray", action="store_true", help="Ray variant: ray start on every host, program on worker 0")
    sub.add_parser("down", parents=[pod], help="delete the TPU VM (or queued resource)")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split at the first `--` (the program), parse the rest; argparse errors exit 2."""
    if "--" in argv:
        cut = argv.index("--")
        argv, program = argv[:cut], argv[cut + 1:]
    else:
        program = []
    args = _parser().parse_args(argv)
    if program and args.cmd != "run":
        raise checks.LaunchError(f"{args.cmd} takes no program after --")
    return args, program


def pod_of(args: argparse.Namespace) -> Pod:
    return Pod(name=args.name, zone=args.zone, accelerator_type=args.accelerator_type, project=args.project,
               version=args.version, queued=args.queued, spot=args.spot, reserved=args.reserved,
               internal_ip=args.internal_ip)


# ---- delete ---------------------------------------------------------------------------------------------

def delete(pod: Pod) -> int:
    """Delete the pod; from here on Ctrl-C / SIGTERM are ignored (a delete cut short can leave the pod up)."""
    procs.ignore_interrupts(f"{PROG}: still deleting {pod.name}; wait for it (Ctrl-\\ quits, possibly leaving it up)")
    _say(f"deleting {pod.name} (Ctrl-C is ignored until the delete returns)")
    rc = procs.run(commands.delete_argv(pod)).returncode
    if rc:
        _say(f"delete of {pod.name} failed (exit {rc}); check `gcloud compute tpus tpu-vm list --zone={pod.zone}` "
             f"and delete it by hand: it costs money while it exists")
    return rc


def _down_hint(pod: Pod) -> str:
    return shlex.join(commands.delete_argv(pod))


# ---- subcommands ----------------------------------------------------------------------------------------

def cmd_up(args, pod: Pod) -> int:
    create = commands.create_argv(pod)
    if args.dry_run:
        _show(create)
        if pod.queued:
            print(f"# then, every {args.poll_interval:g} s for at most {args.timeout:g} s, until it prints ACTIVE:")
            _show(commands.queued_state_argv(pod))
        return 0
    created = interrupted = False
    try:
        _say(f"creating {pod.name} ({pod.accelerator_type}, {topology.num_hosts(pod.accelerator_type)} hosts)")
        rc = procs.run(create).returncode
        if rc:
            _say(f"create failed (exit {rc}); if a node was left behind: {_down_hint(pod)}")
            return rc
        created = True
        if pod.queued:
            rc = _wait_active(pod, args.timeout, args.poll_interval)
    except procs.Interrupted as e:
        _say(f"interrupted ({e})")
        rc, interrupted = 128 + e.signum, True
    if rc == 0:
        _say(f"{pod.name} is up; it costs money until `{PROG} down` (or a `run` without --keep) deletes it")
        return 0
    if (created or interrupted) and not args.keep:
        delete(pod)
    elif created or interrupted:
        _say(f"--keep: {pod.name} may exist and cost money: {_down_hint(pod)}")
    return rc


def _wait_active(pod: Pod, timeout: float, interval: float) -> int:
    """Poll the queued resource until ACTIVE (0); 1 on a failed state or the timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        res = procs.run(commands.queued_state_argv(pod), capture=True)
        state = (res.stdout or "").strip()
        if res.returncode:
            _say(f"queued resource {pod.name}: describe failed (exit {res.returncode}): {(res.stderr or '').strip()}")
            return res.returncode
        if state != last:
            _say(f"queued resource {pod.name}: {state}")
            last = state
        if state == QUEUED_OK:
            return 0
        if state in QUEUED_FAILED:
            _say(f"queued resource {pod.name} is {state}, not {QUEUED_OK}")
            return 1
        if time.monotonic() + interval > deadline:
            _say(f"queued resource {pod.name} not {QUEUED_OK} after {timeout:g} s (last state {state}); "
                 f"raise --timeout to wait longer")
            return 1
        time.sleep(interval)


def cmd_sync(args, pod: Pod) -> int:
    install = args.install if args.install is not None else commands.default_install(args.extras)
    if not (args.source / "pyproject.toml").is_file():
        raise checks.LaunchError(f"--source {args.source} is not a checkout (no pyproject.toml there): sync sends a "
                                 f"jaxrl checkout; run from one or pass --source PATH_TO_CHECKOUT")
    files = tarball.checkout_files(args.source)
    workdir = Path(tempfile.mkdtemp(prefix="jaxrl-tpu-"))
    local = str(workdir / commands.REMOTE_TARBALL)
    steps = [commands.scp_argv(pod, local, commands.REMOTE_TARBALL),
             commands.ssh_argv(pod, "all", commands.sync_command(install))]
    try:
        if args.dry_run:
            print(f"# {len(files)} files of {args.source} packed into {local}")
            for argv in steps:
                _show(argv)
            return 0
        tarball.build_tarball(args.source, Path(local), files)
        _say(f"sending {len(files)} files of {args.source} to every worker of {pod.name}")
        for argv in steps:
            rc = procs.run(argv).returncode
            if rc:
                _say(f"sync failed (exit {rc}); {pod.name} is still up and costs money: {_down_hint(pod)}")
                return rc
        return 0
    except procs.Interrupted as e:
        _say(f"interrupted ({e}); {pod.name} is still up and costs money: {_down_hint(pod)}")
        return 128 + e.signum
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _worker_ips(pod: Pod, expected: int) -> list[str]:
    """The workers' IPs from `tpu-vm describe`; LaunchError when their number is not `expected`."""
    res = procs.run(commands.describe_argv(pod), capture=True)
    if res.returncode:
        raise RuntimeError(f"describe of {pod.name} failed (exit {res.returncode}): {(res.stderr or '').strip()}")
    try:
        endpoints = json.loads(res.stdout).get("networkEndpoints") or []
    except (ValueError, AttributeError) as e:
        raise RuntimeError(f"describe of {pod.name} printed no node JSON ({e}): {res.stdout[:200]!r}") from None
    if len(endpoints) != expected:
        raise checks.LaunchError(f"{pod.name} has {len(endpoints)} workers but --accelerator-type "
                                 f"{pod.accelerator_type} means {expected}; give the pod's real type")
    return [e.get("ipAddress", "") for e in endpoints]


def cmd_run(args, pod: Pod, program: list[str]) -> int:
    workers = topology.num_hosts(pod.accelerator_type)
    checks.check_program(program, workers, args.shared_storage, driver_only=args.ray)
    env = checks.parse_env(args.env)
    if args.dry_run:
        _show(commands.describe_argv(pod))
        if args.ray:
            head, joins, driver = commands.ray_plan(pod, workers, "<worker-0-ip>", program, env)
            print("# <worker-0-ip>: networkEndpoints[0].ipAddress of the describe output")
            _show(head)
            print("# started together:" if joins else "# (no other workers)")
            for argv in joins:
                _show(argv)
            _show(driver)
        else:
            print("# started together, one per worker; the first non-zero exit stops the others:")
            for argv in commands.run_plan(pod, workers, program, env):
                _show(argv)
        if not args.keep:
            _show(commands.delete_argv(pod))
        return 0
    rc = 1
    try:
        ips = _worker_ips(pod, workers)
        rc = _run_ray(pod, workers, ips[0], program, env) if args.ray else _run_hosts(pod, workers, program, env)
    except procs.Interrupted as e:
        _say(f"interrupted ({e}); the hosts were stopped")
        rc = 128 + e.signum
    except checks.LaunchError as e:
        _say(f"error: {e}")
        rc = 2
    except RuntimeError as e:
        _say(f"error: {e}")
        rc = 1
    finally:
        if not args.keep:
            delete(pod)
        else:
            _say(f"--keep: {pod.name} stays up and costs money until: {_down_hint(pod)}")
    return rc


def _run_hosts(pod: Pod, workers: int, program: list[str], env: dict[str, str]) -> int:
    _say(f"starting {shlex.join(program)} on {workers} hosts of {pod.name}")
    code, index = procs.run_together(commands.run_plan(pod, workers, program, env),
                                     [f"[w{i}] " for i in range(workers)])
    if code:
        _say(f"worker {index} exited with code {code}; the other hosts were stopped")
    else:
        _say(f"all {workers} hosts exited 0")
    return code


def _run_ray(pod: Pod, workers: int, head_ip: str, program: list[str], env: dict[str, str]) -> int:
    head, joins, driver = commands.ray_plan(pod, workers, head_ip, program, env)
    _say(f"starting the Ray head on worker 0 ({head_ip})")
    code, _ = procs.run_together([head], ["[w0] "])
    if code:
        _say(f"ray start --head failed on worker 0 (exit {code})")
        return code
    if joins:
        code, index = procs.run_together(joins, [f"[w{i}] " for i in range(1, workers)])
        if code:
            _say(f"ray start failed on worker {index + 1} (exit {code})")
            return code
    _say(f"starting the driver on worker 0: {shlex.join(program)}")
    code, _ = procs.run_together([driver], ["[driver] "])
    _say(f"the driver exited with code {code}")
    return code


def cmd_down(args, pod: Pod) -> int:
    if args.dry_run:
        _show(commands.delete_argv(pod))
        return 0
    return delete(pod)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    procs.raise_on_interrupt(f"{PROG}: already stopping; wait for it (Ctrl-\\ quits at once)")
    try:
        args, program = parse(argv)
        pod = pod_of(args)
        topology.num_hosts(pod.accelerator_type)
        if pod.reserved and not pod.queued:
            raise checks.LaunchError("--reserved needs --queued (a reservation is used through a queued resource)")
        if args.cmd == "up":
            return cmd_up(args, pod)
        if args.cmd == "sync":
            return cmd_sync(args, pod)
        if args.cmd == "run":
            return cmd_run(args, pod, program)
        return cmd_down(args, pod)
    except (checks.LaunchError, topology.TopologyError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
