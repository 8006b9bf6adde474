"""Helpers of the fault suite: tiny quickstart runs in subprocesses, a size-limited tmpfs, checkpoint checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The quickstart (real stories260K, built-in prompts) cut down: 4 prompts x 2 responses per step, 12 new tokens.
TINY = [
    "data.train_batch_size=4", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=2", "trainer.logger=['jsonl']",
]


def command(out_dir: Path, extra=()) -> list[str]:
    """``python -m jaxrl.train`` on the tiny quickstart writing to ``out_dir`` (later overrides win)."""
    return [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *TINY,
            f"trainer.default_local_dir={out_dir}", *extra]


def env() -> dict:
    """This process's environment (PYTHONPATH included, so subprocesses import the same jaxrl)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(out_dir: Path, extra=(), timeout=900) -> subprocess.CompletedProcess:
    """Run a training command to completion (any exit status)."""
    return subprocess.run(command(out_dir, extra), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """The ``jaxrl: error: ...`` lines of a run's stderr."""
    return [line for line in stderr.splitlines() if line.startswith("jaxrl: error:")]


def records(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def logged_steps(out_dir: Path) -> list[int]:
    return [r["step"] for r in records(out_dir)]


def step_entries(root: Path) -> list[str]:
    """Names of everything under ``root`` that starts with ``global_step`` (complete, moved aside, or temporary)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("global_step"))


def assert_checkpoint_readable(root: Path, *steps: int) -> dict:
    """Restore every array of each checkpoint in ``steps`` (targets from orbax's metadata) and check they are
    finite; returns the last one's meta. Runs in a fresh subprocess, as a resuming run would (no cached file
    handles)."""
    script = f"""
import json
import jax, numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jaxrl.checkpoint import CheckpointStore
store = CheckpointStore({str(root)!r}, max_to_keep=None, read_only=True)
for step in {list(steps)!r}:
    assert step in store.steps(), (step, store.steps())
    items = sorted(p.name for p in store.step_path(step).iterdir() if p.is_dir() and p.name != "meta")
    like = {{}}
    for name in items:
        tree = ocp.StandardCheckpointHandler().metadata(epath.Path(store.step_path(step) / name)).tree
        role, part = name.split(".")
        like.setdefault(role, {{}})[part] = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    got, arrays, meta = store.restore(step, like=like)
    leaves = jax.tree.leaves(arrays)
    assert got == step and meta["step"] == step and "actor" in arrays and leaves
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)
store.close()
print("META=" + json.dumps(meta))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("META=")][-1]
    return json.loads(line[len("META="):])


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` (mount's syntax, e.g. ``6m``) mounted at ``path`` for the block; unmounted after.

    Needs root (CI runs as root). Where mounting is impossible: a failure under CI, a skip elsewhere.
    """
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        msg = f"cannot mount a tmpfs at {path} ({proc.stderr.strip() or proc.returncode}); needs root"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, size: str) -> None:
    """Resize a tmpfs mounted by :func:`tmpfs` (the user freeing space)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
