"""What the launcher refuses before it calls gcloud at all (pure; each failure is one LaunchError line).

- `--env K=V`: K a shell variable name.
- A `jaxrl.train` program on a pod: `trainer.default_local_dir=` given on the command line as a path under a
  `--shared-storage` mount, not a URL (every host writes the same checkpoint folder, so it must be one
  folder all hosts see; the config file's own value is not read: it is usually a local `outputs/...`).
- A `jaxrl.train` program on more than one host: `trainer.distributed.mode=` given (on a TPU pod `auto`: every
  host joins one JAX world; without it each host would train alone).
"""

from __future__ import annotations

import os
import re

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LaunchError(Exception):
    """A usage error found before anything started (exit 2, one line)."""


def parse_env(items: list[str]) -> dict[str, str]:
    """`["K=V", ...]` -> `{"K": "V"}` (later wins). Raises LaunchError naming the bad item."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise LaunchError(f"--env {item!r}: expected NAME=VALUE with NAME a shell variable name "
                              f"(letters, digits, _; e.g. --env WANDB_MODE=offline)")
        env[key] = value
    return env


def is_train_program(program: list[str]) -> bool:
    """True when `program` runs `python -m jaxrl.train` (or the file jaxrl/train.py)."""
    for i, tok in enumerate(program):
        if tok == "-m" and i + 1 < len(program) and program[i + 1] == "jaxrl.train":
            return True
        if tok.endswith("jaxrl/train.py"):
            return True
    return False


def override(program: list[str], key: str) -> str | None:
    """The last `key=value` (also `+key=` / `++key=`) among the program's arguments, else None."""
    value = None
    for tok in program:
        name, sep, val = tok.lstrip("+").partition("=")
        if sep and name == key:
            value = val
    return value


def check_output_dir(value: str | None, shared_storage: list[str]) -> None:
    """`trainer.default_local_dir` must be an absolute path under one of `shared_storage` (not a URL: jaxrl.train
    keeps a lock and appended logs in the run folder, which need a filesystem; a bucket is mounted with gcsfuse)."""
    shared = ", ".join(shared_storage) if shared_storage else "none given"
    hint = ("every host writes the same run folder: give trainer.default_local_dir=/mnt/PATH/run, a path under a "
            "filesystem mounted on every host (Filestore/NFS, or a bucket mounted with gcsfuse) and named with "
            f"--shared-storage /mnt/PATH (given: {shared})")
    if value is None:
        raise LaunchError(f"the program sets no trainer.default_local_dir=...; {hint}")
    if "://" in value:
        raise LaunchError(f"trainer.default_local_dir={value!r} is a URL, which jaxrl.train cannot use as its run "
                          f"folder; {hint}")
    if os.path.isabs(value):
        path = os.path.normpath(value)
        for mount in shared_storage:
            root = os.path.normpath(mount)
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return
    raise LaunchError(f"trainer.default_local_dir={value!r} is not shared storage; {hint}")


def check_shared_storage(mounts: list[str]) -> None:
    """Each `--shared-storage` mount is an absolute path."""
    for mount in mounts:
        if not os.path.isabs(mount):
            raise LaunchError(f"--shared-storage {mount!r}: expected an absolute path mounted on every host "
                              f"(e.g. /mnt/nfs)")


def check_program(program: list[str], workers: int, shared_storage: list[str], driver_only: bool = False) -> None:
    """All checks for a program before anything starts. driver_only: the Ray variant (one driver process)."""
    if not program:
        raise LaunchError("no program given: put it after --, e.g. --shared-storage /mnt/gcs -- python -m jaxrl.train "
                          "--config configs/x.yaml trainer.default_local_dir=/mnt/gcs/run trainer.distributed.mode=auto")
    check_shared_storage(shared_storage)
    if not is_train_program(program):
        return
    check_output_dir(override(program, "trainer.default_local_dir"), shared_storage)
    if workers > 1 and not driver_only and override(program, "trainer.distributed.mode") is None:
        raise LaunchError(f"the pod has {workers} hosts but the program sets no trainer.distributed.mode=...; add "
                          f"trainer.distributed.mode=auto so every host joins one JAX world (without it each host "
                          f"trains alone)")
