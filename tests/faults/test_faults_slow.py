"""Faults on real (tiny) quickstart runs in subprocesses (``pytest -m slow``; about 8 minutes on 2 cores).

Each case asserts the exit status, the one-line message, and that nothing was lost: metrics rows, readable
checkpoints, the newest good checkpoint intact.

- two runs in one folder: exactly one trains, the other exits 2 within seconds naming the first's PID;
- a stale lock (dead PID) is taken over with a warning;
- a corrupt newest checkpoint is moved aside, the run resumes from the previous one, rewrites it, and the next
  resume uses the new one;
- a full disk (a small tmpfs) during the saves: later saves are still attempted, the final one's failure exits 1
  naming the newest complete checkpoint, nothing is left half-written, and after freeing space the same command
  resumes and finishes;
- resuming with an incompatible config (another batch size, another model; with and without a fingerprint in the
  checkpoint) exits 2 naming what changed, moves nothing; ``trainer.resume_mode=disable`` then starts over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from faultkit import (
    REPO,
    assert_checkpoint_readable,
    command,
    env,
    error_lines,
    logged_steps,
    records,
    remount,
    run,
    step_entries,
    tmpfs,
)

pytestmark = pytest.mark.slow


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_two_runs_in_one_folder_exactly_one_trains(shared, tmp_path):
    from jaxrl.runlock import lock_holder

    out = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(command(out, ["trainer.total_training_steps=4"]), cwd=REPO, env=env(),
                             stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (lock_holder(out) or {}).get("pid") != first.pid:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = run(out, ["trainer.total_training_steps=4"], timeout=300)
        assert first.poll() is None, "the first run ended before the second one was refused"
        assert first.wait(timeout=900) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        log.close()
    assert second.returncode == 2, second.stderr[-3000:]
    # refused before the build: no model or rollout engine was loaded (the first run logs its engine)
    assert "rollout engine" in (tmp_path / "first.log").read_text()
    assert "rollout engine" not in second.stderr, second.stderr[-3000:]
    (line,) = error_lines(second.stderr)
    assert f"PID {first.pid} on host {socket.gethostname()}" in line
    assert "wait for that run to finish" in line and "another trainer.default_local_dir" in line
    _no_traceback(second)
    # the first run was undisturbed: every step logged once, its checkpoints complete and readable
    assert logged_steps(out) == [1, 2, 3, 4]
    assert step_entries(out) == ["global_step_2", "global_step_4"]
    assert assert_checkpoint_readable(out, 2, 4)["step"] == 4
    assert lock_holder(out) is None and not (out / "jaxrl.lock").exists()  # released at exit


def test_stale_lock_of_a_dead_run_is_taken_over_with_a_warning(shared, tmp_path):
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / "jaxrl.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                "started": "2026-01-01T00:00:00+00:00", "command": "killed run"}))
    proc = _ok(run(out, ["trainer.total_training_steps=1", "trainer.save_freq=1"]))
    assert "taking over the stale run lock" in proc.stderr and f"PID {dead.pid}" in proc.stderr
    assert "no longer running" in proc.stderr
    assert logged_steps(out) == [1] and step_entries(out) == ["global_step_1"]
    assert not (out / "jaxrl.lock").exists()


def _truncate_array_files(step_dir: Path) -> None:
    for f in (step_dir / "actor.params").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_corrupt_newest_checkpoint_is_moved_aside_resumed_past_and_rewritten(shared, tmp_path):
    out = tmp_path / "run"
    _ok(run(out, ["trainer.total_training_steps=4"]))
    _truncate_array_files(out / "global_step_4")
    corrupt = _files(out / "global_step_4")
    good = _files(out / "global_step_2")

    proc = _ok(run(out, ["trainer.total_training_steps=4"]))
    moved = [n for n in step_entries(out) if n.startswith("global_step_4.corrupt-")]
    assert len(moved) == 1, step_entries(out)
    assert f"checkpoint {out}/global_step_4 is corrupt or partial" in proc.stderr and moved[0] in proc.stderr
    assert f"resumed from {out}/global_step_2 at step 2" in proc.stderr
    assert _files(out / moved[0]) == corrupt  # kept as it was, for inspection
    assert _files(out / "global_step_2") == good  # the good one untouched
    assert sorted(n for n in step_entries(out) if "." not in n) == ["global_step_2", "global_step_4"]
    assert assert_checkpoint_readable(out, 4)["step"] == 4  # a fresh global_step_4
    assert logged_steps(out) == [1, 2, 3, 4]

    proc = _ok(run(out, ["trainer.total_training_steps=6"]))  # the next resume uses the rewritten step 4
    assert f"resumed from {out}/global_step_4 at step 4" in proc.stderr and "is corrupt" not in proc.stderr
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]
    assert assert_checkpoint_readable(out, 2, 4, 6)["step"] == 6


def test_full_disk_during_saves_fails_the_final_save_loudly_and_loses_nothing(shared, tmp_path):
    # 6 MiB: the tokenizer, metrics and the step-2 checkpoint (3.2 MB on disk; the free-space check asks for
    # about 4.2 MiB) fit; after it less than 4.2 MiB is free, so the saves of steps 4 and 6 cannot be made.
    with tmpfs(tmp_path / "disk", "6m") as disk:
        out = disk / "run"
        args = ["trainer.total_training_steps=6"]
        proc = run(out, args)
        assert proc.returncode == 1, proc.stderr[-4000:]
        for step in (4, 6):  # every save was attempted on its own, each says what it needs and what is free
            assert f"checkpoint step {step} not saved: it needs about" in proc.stderr
        assert "MiB is free" in proc.stderr
        (line,) = error_lines(proc.stderr)
        assert "the final checkpoint (step 6) was not saved: it needs about" in line
        assert f"the newest complete checkpoint is {out}/global_step_2 (step 2)" in line
        assert "rerun the same command" in line
        _no_traceback(proc)
        assert logged_steps(out) == [1, 2, 3, 4, 5, 6]  # no metrics lost
        assert step_entries(out) == ["global_step_2"]  # nothing half-written or temporary left behind
        assert assert_checkpoint_readable(out, 2)["step"] == 2
        assert not (out / "jaxrl.lock").exists()

        remount(disk, "64m")  # the user frees space and reruns the same command
        proc = _ok(run(out, args))
        assert f"resumed from {out}/global_step_2 at step 2" in proc.stderr
        assert logged_steps(out) == [1, 2, 3, 4, 5, 6]
        assert step_entries(out) == ["global_step_2", "global_step_4", "global_step_6"]
        assert assert_checkpoint_readable(out, 6)["step"] == 6
        assert (out / "hf_model" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------- incompatible configs

SMALLER_BATCH = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


@pytest.fixture(scope="module")
def two_step_run(shared, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    _ok(run(out, ["trainer.total_training_steps=2"]))
    assert step_entries(out) == ["global_step_2"]
    return out


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, shared):
    """A randomly initialised Llama with stories260K's tokenizer but half its width."""
    from flax import nnx

    from jaxrl.models.config import ModelConfig
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.hf import save_hf

    src = shared / "models" / "stories260K"
    hf = json.loads((src / "config.json").read_text())
    hf.update(hidden_size=32, intermediate_size=86, num_attention_heads=4, num_key_value_heads=2)
    cfg = ModelConfig.from_hf_config(hf)
    out = tmp_path_factory.mktemp("other_model")
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    return out


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def _assert_refused(proc, out: Path, before: dict, *changes: str) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    (line,) = error_lines(proc.stderr)
    assert f"cannot resume from {out}/global_step_2: it was written by a run with another configuration" in line
    for change in changes:
        assert change in line, line
    assert "trainer.resume_mode=disable" in line and "another trainer.default_local_dir" in line
    for bad in ("Traceback", "orbax", "is corrupt", "partial"):
        assert bad not in proc.stderr, proc.stderr[-4000:]
    assert _files(out) == before  # nothing moved, rewritten or logged
    return line


def test_another_batch_size_is_refused_naming_it(two_step_run, tmp_path):
    out = _copy(two_step_run, tmp_path)
    before = _files(out)
    _assert_refused(run(out, [*SMALLER_BATCH, "trainer.total_training_steps=4"]), out, before,
                    "data.train_batch_size: 4 -> 2")


def test_another_model_is_refused_naming_what_changed(two_step_run, other_model, tmp_path):
    out = _copy(two_step_run, tmp_path)
    before = _files(out)
    line = _assert_refused(run(out, [f"actor_rollout_ref.model.path={other_model}",
                                     "trainer.total_training_steps=4"]), out, before,
                           "model.hidden_size: 64 -> 32", "model.intermediate_size: 172 -> 86",
                           "actor.params: ")
    assert "data." not in line  # the same tokenizer, so the same prompts


def test_checkpoint_without_fingerprint_still_resumes_and_is_still_checked(two_step_run, tmp_path):
    """Checkpoints written before fingerprints existed: compared on their meta (model config, data-iterator
    settings) and orbax's array metadata; a compatible one resumes as before."""
    out = _copy(two_step_run, tmp_path)
    meta_file = out / "global_step_2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["fingerprint"]
    meta_file.write_text(json.dumps(meta))
    before = _files(out)
    _assert_refused(run(out, [*SMALLER_BATCH, "trainer.total_training_steps=4"]), out, before,
                    "data.train_batch_size: 4 -> 2")
    proc = _ok(run(out, ["trainer.total_training_steps=3"]))
    assert f"resumed from {out}/global_step_2 at step 2" in proc.stderr
    assert logged_steps(out) == [1, 2, 3]


def test_resume_mode_disable_starts_over_and_keeps_the_old_checkpoints(two_step_run, tmp_path):
    out = _copy(two_step_run, tmp_path)
    old = _files(out / "global_step_2")
    proc = _ok(run(out, [*SMALLER_BATCH, "trainer.total_training_steps=2", "trainer.resume_mode=disable"]))
    assert "resumed from" not in proc.stderr
    entries = step_entries(out)
    assert len(entries) == 2 and entries[0] == "global_step_2" and entries[1].startswith("global_step_2.superseded-")
    assert _files(out / entries[1]) == old  # the earlier run's checkpoint, kept
    meta = assert_checkpoint_readable(out, 2)
    assert meta["fingerprint"]["data.train_batch_size"] == 2  # the new run's own checkpoint
    assert [r["step"] for r in records(out)] == [1, 2]
