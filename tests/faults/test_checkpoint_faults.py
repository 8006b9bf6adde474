"""CheckpointStore under faults: a failed save never hides the next one, free space is checked before writing,
a real full disk leaves nothing half-written, a corrupt newest checkpoint is moved aside (kept) and rewritten,
an incompatible checkpoint is reported and never moved, superseded checkpoints are set aside."""

from __future__ import annotations

import errno
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from faultkit import step_entries, tmpfs

from jaxrl.checkpoint import (
    CheckpointIncompatibleError,
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointStore,
    required_bytes,
)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _arrays(n_floats: int, value: float) -> dict:
    """An actor whose params are one ``[n_floats]`` float32 vector (4 * n_floats bytes, random so that it does
    not compress; element 0 is ``value``) and a step counter."""
    w = np.random.default_rng(int(value)).standard_normal(n_floats).astype(np.float32)
    w[0] = value
    return {"actor": {"params": {"w": jnp.asarray(w)}, "opt_state": {"count": jnp.asarray(int(value), jnp.int32)}}}


def _like(n_floats: int) -> dict:
    return {"actor": {"params": {"w": jax.ShapeDtypeStruct((n_floats,), jnp.float32)},
                      "opt_state": {"count": jax.ShapeDtypeStruct((), jnp.int32)}}}


def _restored_value(store, step, n):
    """Element 0 of the restored params of ``step`` (None: the newest restorable step)."""
    got, arrays, meta = store.restore(step, like=_like(n))
    assert meta["step"] == got and (step is None or got == step)
    return float(np.asarray(arrays["actor"]["params"]["w"])[0])


def _fail_json_saves_of(monkeypatch, steps: set[int]):
    """Make orbax's JSON (meta) writer fail with ENOSPC for the given steps (the write runs in orbax's thread)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    real = jch.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
        if x.get("step") in steps:
            (directory / self._filename).write_text('{"partial": ')
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", save_fn)


def test_a_failed_async_save_does_not_hide_the_next_one(tmp_path, monkeypatch, caplog):
    store = CheckpointStore(tmp_path / "run", max_to_keep=None, async_save=True)
    store.save(1, arrays=_arrays(64, 1.0), meta={"step": 1}, wait=True)
    _fail_json_saves_of(monkeypatch, {2})
    assert store.save(2, arrays=_arrays(64, 2.0), meta={"step": 2}) is True  # fails in the background
    with caplog.at_level(logging.ERROR, logger="jaxrl.checkpoint"):
        assert store.save(3, arrays=_arrays(64, 3.0), meta={"step": 3}) is True  # attempted, not blocked
    store.wait()
    assert store.steps() == [1, 3]
    assert list(store.save_errors) == [2] and store.save_errors[2].errno == errno.ENOSPC
    assert "saving checkpoint step 2" in caplog.text
    assert step_entries(tmp_path / "run") == ["global_step_1", "global_step_3"]
    assert _restored_value(store, 3, 64) == 3.0
    store.close()


def test_free_space_shortfall_refuses_the_save_naming_both_sizes(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        store = CheckpointStore(disk / "run", max_to_keep=None, async_save=True)
        big = _arrays(512 * 1024, 1.0)  # 2 MiB of params: with the margin more than the 2 MiB disk
        need = required_bytes(big, {"step": 1})
        assert need > 3 * (1 << 20)
        with pytest.raises(CheckpointSaveError) as ei:
            store.save(1, arrays=big, meta={"step": 1})
        msg = str(ei.value)
        assert f"it needs about {need / (1 << 20):.1f} MiB" in msg and "MiB is free" in msg and str(disk) in msg
        assert ei.value.errno == errno.ENOSPC and store.save_errors[1] is ei.value
        assert step_entries(disk / "run") == []  # nothing written
        assert store.save(2, arrays=_arrays(1024, 2.0), meta={"step": 2}, wait=True)  # a smaller one still fits
        assert store.steps() == [2] and _restored_value(store, 2, 1024) == 2.0
        store.close()


def test_real_full_disk_mid_write_leaves_nothing_half_written(tmp_path):
    """A save that runs out of space while orbax writes (the free-space check off, as if the estimate were
    too low): its temporary folder is removed, the error is recorded, and the next save, started right away
    after space was freed, goes through."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        store = CheckpointStore(disk / "run", max_to_keep=None, async_save=True, check_free_space=False)
        n = 512 * 1024  # 2 MiB per checkpoint
        store.save(1, arrays=_arrays(n, 1.0), meta={"step": 1}, wait=True)
        filler = disk / "filler"
        import shutil

        free = shutil.disk_usage(disk).free
        filler.write_bytes(b"\0" * (free - (1 << 20)))  # leave 1 MiB: step 2 cannot fit
        store.save(2, arrays=_arrays(n, 2.0), meta={"step": 2})
        try:
            store.wait()
        except CheckpointSaveError:
            pass  # a test of the next save: the error is recorded either way
        assert store.save_errors[2].errno == errno.ENOSPC
        assert step_entries(disk / "run") == ["global_step_1"]  # no global_step_2 nor its tmp folder
        filler.unlink()
        assert store.save(3, arrays=_arrays(n, 3.0), meta={"step": 3}) is True
        store.wait()
        assert store.steps() == [1, 3]
        assert _restored_value(store, 1, n) == 1.0 and _restored_value(store, 3, n) == 3.0
        store.close()


def _truncate_arrays(step_dir):
    data = [p for p in (step_dir / "actor.params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)


def test_corrupt_newest_is_moved_aside_then_rewritten(tmp_path, caplog):
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    for s in (1, 2, 3):
        store.save(s, arrays=_arrays(4096, float(s)), meta={"step": s})
    store.close()
    _truncate_arrays(root / "global_step_3")
    kept = {p.name: p.stat().st_size for p in (root / "global_step_3").rglob("*") if p.is_file()}

    with CheckpointStore(root, max_to_keep=None, read_only=True) as reader:  # a reader (export) only skips it
        assert reader.restore(like=_like(4096))[0] == 2
    assert step_entries(root) == ["global_step_1", "global_step_2", "global_step_3"]

    store = CheckpointStore(root, max_to_keep=None, async_save=False)  # the resumed run's store
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        step, arrays, meta = store.restore(like=_like(4096))
    assert step == 2 and float(np.asarray(arrays["actor"]["params"]["w"])[0]) == 2.0
    moved = [n for n in step_entries(root) if n.startswith("global_step_3.corrupt-")]
    assert len(moved) == 1 and not (root / "global_step_3").exists()
    assert {p.name: p.stat().st_size for p in (root / moved[0]).rglob("*") if p.is_file()} == kept  # kept as is
    assert moved[0] in caplog.text and "corrupt" in caplog.text
    assert store.steps() == [1, 2]
    assert store.save(3, arrays=_arrays(4096, 33.0), meta={"step": 3}) is True  # a fresh global_step_3
    assert store.steps() == [1, 2, 3]
    store.close()
    store = CheckpointStore(root, max_to_keep=None, read_only=True)  # the next resume uses the new one
    assert _restored_value(store, None, 4096) == 33.0
    store.close()


def test_incompatible_checkpoint_is_reported_and_never_moved(tmp_path):
    root = tmp_path / "run"
    with CheckpointStore(root, max_to_keep=None, async_save=False) as store:
        for s in (1, 2):
            store.save(s, arrays=_arrays(12, float(s)), meta={"step": s})
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    # arrays of another shape (another model): listed, not treated as corrupt, older steps not tried
    with pytest.raises(CheckpointIncompatibleError) as ei:
        store.restore(like=_like(20))
    assert ei.value.step == 2
    assert ei.value.differences == ["actor.params: 1 of 1 arrays changed shape/dtype (e.g. w: float32[12] -> "
                                    "float32[20])"]
    # the caller's check (the trainer's fingerprint) says no: same
    def check(step, meta):
        raise CheckpointIncompatibleError("another batch size", step=step, path=None,
                                          differences=["data.train_batch_size: 4 -> 2"])

    with pytest.raises(CheckpointIncompatibleError, match="another batch size") as ei:
        store.restore(like=_like(12), check=check)
    assert ei.value.step == 2 and ei.value.path == store.step_path(2)  # the store names the checkpoint
    with pytest.raises(CheckpointIncompatibleError):
        store.restore(1, like=_like(12), check=check)
    # a check that fails for another reason is the caller's bug: raised as is, the checkpoint is not corrupt
    with pytest.raises(KeyError, match="no_such_key"):
        store.restore(like=_like(12), check=lambda step, meta: meta["no_such_key"])
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert store.restore(like=_like(12))[0] == 2  # and it restores fine with a matching target
    store.close()


def test_no_restorable_checkpoint_lists_each_step_and_where_it_went(tmp_path):
    root = tmp_path / "run"
    with CheckpointStore(root, max_to_keep=None, async_save=False) as store:
        store.save(1, arrays=_arrays(4096, 1.0), meta={"step": 1})
    _truncate_arrays(root / "global_step_1")
    with CheckpointStore(root, max_to_keep=None, async_save=False) as store:
        with pytest.raises(CheckpointRestoreError) as ei:
            store.restore(like=_like(4096))
    (moved,) = step_entries(root)
    assert moved.startswith("global_step_1.corrupt-") and f"moved to {moved}" in str(ei.value)


def test_supersede_after_sets_newer_checkpoints_aside(tmp_path):
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    for s in (2, 4, 6):
        store.save(s, arrays=_arrays(16, float(s)), meta={"step": s})
    moved = store.supersede_after(2)
    assert sorted(p.name.split(".")[0] for p in moved) == ["global_step_4", "global_step_6"]
    assert store.steps() == [2]
    assert store.save(4, arrays=_arrays(16, 44.0), meta={"step": 4}) is True  # not "already complete"
    assert _restored_value(store, 4, 16) == 44.0
    store.supersede_after(None)
    assert store.steps() == [] and len(step_entries(root)) == 4  # 2, 4, 6 and the new 4, all kept
    store.close()


def test_a_failed_final_save_names_the_newest_complete_checkpoint(tmp_path):
    from jaxrl.run_checkpoint import check_final_checkpoint

    with tmpfs(tmp_path / "disk", "2m") as disk:
        store = CheckpointStore(disk / "run", max_to_keep=None, async_save=True)
        store.save(1, arrays=_arrays(1024, 1.0), meta={"step": 1})
        with pytest.raises(CheckpointSaveError):
            store.save(2, arrays=_arrays(512 * 1024, 2.0), meta={"step": 2})  # the run's last step: too big
        with pytest.raises(CheckpointSaveError) as ei:
            check_final_checkpoint(store, 2)
        msg = str(ei.value)
        assert msg.startswith("the final checkpoint (step 2) was not saved: it needs about ")
        assert f"the newest complete checkpoint is {disk}/run/global_step_1 (step 1)" in msg
        assert "rerun the same command" in msg and "\n" not in msg
        check_final_checkpoint(store, 1)  # complete: fine
        check_final_checkpoint(store, None)  # a run without a final save
        store.close()
    with CheckpointStore(tmp_path / "empty", max_to_keep=None) as store:
        with pytest.raises(CheckpointSaveError, match="no complete checkpoint exists in"):
            check_final_checkpoint(store, 3)
