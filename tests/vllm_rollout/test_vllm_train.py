"""Training runs with ``actor_rollout_ref.rollout.name=vllm`` through the real CLI (subprocesses, vllm-cpu).

Model: a tiny random Qwen2 (head_dim 32, vLLM's CPU minimum) with the stories260K tokenizer, written as a Hugging
Face directory, trained on the quickstart's story prompts. Proves that the trainer feeds vLLM through the
translator's ``"hf"`` plan every step (colocated in-process engine, and split placement with vLLM in its own worker
process), and that a weight sync that times out stops the run with a clear error and leaves the last checkpoint
untouched, so the same command resumes from it.

Runs only in the venv built by ``scripts/setup_vllm_cpu.sh``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_runs import metric_rows, run_tiny  # noqa: E402

TIMEOUT_KEY = "actor_rollout_ref.rollout.update_weights_timeout_s"


def _run(model_dir: Path, out_dir: Path, *extra: str, devices: int = 1) -> subprocess.CompletedProcess:
    return run_tiny(model_dir, out_dir, *extra, devices=devices)


def _records(out_dir: Path) -> list[dict]:
    return metric_rows(out_dir)


def _files(d: Path) -> dict:
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_sync_timeout_stops_the_run_and_keeps_the_checkpoint(tiny_model_dir, colocated_vllm_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(colocated_vllm_run, out)  # 2 steps, a checkpoint after each (the fixture's folder stays as is)
    recs = _records(out)
    assert [r["step"] for r in recs] == [1, 2]
    # vLLM's log-probs vs the trainer's recompute (same weights after every sync), and the hf plan's bytes
    # (a stale engine at step 2 would be off by the step-1 update, ~1e-3 and more at lr 1e-4)
    diffs = [r["training/rollout_probs_diff_max"] for r in recs]
    assert all(d < 2e-4 for d in diffs), diffs
    assert all(r["sync/bytes"] == 0 for r in recs)  # one device: the hf plan re-lays tensors out in place
    ckpt = _files(out / "global_step_2")

    # Resume with a sync timeout nobody can meet: the resume sync into vLLM fails, cleanly.
    failed = _run(tiny_model_dir, out, "trainer.total_training_steps=3", "trainer.save_freq=1", f"{TIMEOUT_KEY}=0.001")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert f"did not finish within 0.001 s ({TIMEOUT_KEY})" in failed.stderr
    assert f"{out}/global_step_2 (untouched by the failed sync)" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert _files(out / "global_step_2") == ckpt and not (out / "global_step_3").exists()

    again = _run(tiny_model_dir, out, "trainer.total_training_steps=3", "trainer.save_freq=1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in _records(out)] == [1, 2, 3]


def test_split_placement_runs_vllm_as_a_worker_process(tiny_model_dir, tmp_path):
    out = tmp_path / "split"
    proc = _run(tiny_model_dir, out, "trainer.total_training_steps=2", "trainer.save_freq=-1",
                "trainer.placement=split", "trainer.rollout_devices=1", "trainer.mesh.fsdp=1", devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["training/rollout_probs_diff_max"] < 2e-4 for r in recs)  # the worker got every step's weights
    assert "started vllm worker pid" in proc.stderr  # vLLM ran in its own process
