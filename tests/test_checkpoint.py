"""CheckpointStore: exact round trips, async saves, pruning, corrupt/partial checkpoints, full disk, resume."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.checkpoint import (
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointStore,
    find_resume_checkpoint,
    max_to_keep_from_config,
    parse_step_dir,
    step_dir,
)
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder

# orbax leaves the sibling read coroutines of a failed restore unawaited (reported at a later GC); harmless
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CFG = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, bos_token_id=1, eos_token_id=2,
)


@pytest.fixture(scope="module")
def state():
    """A tiny decoder's params and an AdamW state after one real update (non-zero moments, count 1)."""
    graphdef, params = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-2)
    opt = tx.init(params)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4)))
        return jnp.mean(logits ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    updates, opt = jax.jit(tx.update)(grads, opt, params)
    params = optax.apply_updates(params, updates)
    return {"graphdef": graphdef, "params": params, "opt_state": opt, "tx": tx}


def _arrays(state, scale: float = 0.0):
    params = jax.tree.map(lambda x: x + scale, state["params"])
    return {"actor": {"params": params, "opt_state": state["opt_state"]}}


def _meta(step: int) -> dict:
    return {
        "step": step,
        "data_state": {"epoch": 1, "step_in_epoch": step},
        "rng": {"bit_generator": "PCG64", "state": {"state": 2**100 + step, "inc": 7}},
        "kl_ctrl": {"value": 0.001},
        "num_updates": 4 * step,
        "model": {"hf_config": CFG.to_hf_config(), "path": "tiny", "param_dtype": "float32"},
        "config": {"trainer": {"seed": 1}, "lr": 1e-6, "nan": None},
    }


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _snapshot(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def test_roundtrip_is_exact(tmp_path, state):
    store = CheckpointStore(tmp_path / "run", max_to_keep=None, async_save=False)
    arrays = _arrays(state)
    assert store.save(3, arrays=arrays, meta=_meta(3)) is True
    assert store.steps() == [3] and store.latest_step() == 3
    assert (tmp_path / "run" / "global_step_3" / "actor.params").is_dir()
    step, restored, meta = store.restore(like=arrays)
    assert step == 3 and meta == _meta(3)
    assert isinstance(restored["actor"]["params"], nnx.State)
    _assert_tree_equal(restored["actor"]["params"], arrays["actor"]["params"])
    _assert_tree_equal(restored["actor"]["opt_state"], arrays["actor"]["opt_state"])
    # the restored state trains on: the optimizer accepts it with the restored params
    updates, _ = state["tx"].update(restored["actor"]["params"], restored["actor"]["opt_state"],
                                    restored["actor"]["params"])
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
    store.close()


def test_restore_into_abstract_target_with_sharding(tmp_path, state):
    store = CheckpointStore(tmp_path / "run", max_to_keep=None, async_save=False)
    arrays = _arrays(state, scale=0.5)
    store.save(1, arrays=arrays, meta=_meta(1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        jax.eval_shape(lambda: arrays))
    _, restored, _ = store.restore(1, like=like)
    _assert_tree_equal(restored, arrays)
    assert all(isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
               for x in jax.tree.leaves(restored))
    # a partial target: only the actor's params (what export needs)
    abstract_params = jax.eval_shape(lambda: arrays["actor"]["params"])
    _, only, _ = store.restore(1, like=lambda meta: {"actor": {"params": abstract_params}})
    assert list(only["actor"]) == ["params"]
    _assert_tree_equal(only["actor"]["params"], arrays["actor"]["params"])
    store.close()


def test_restore_resharded_across_two_devices(tmp_path):
    """A checkpoint saved on one device restores sharded over a 2-device mesh (fresh process: 2 CPU devices)."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jaxrl.checkpoint import CheckpointStore
        assert jax.device_count() == 2
        w = jnp.arange(48.0).reshape(8, 6)
        store = CheckpointStore({str(tmp_path / 'run')!r}, max_to_keep=None, async_save=True)
        store.save(5, arrays={{"actor": {{"params": {{"w": w}}}}}}, meta={{"step": 5}}, wait=True)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        like = {{"actor": {{"params": {{"w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=sh)}}}}}}
        step, out, meta = store.restore(like=like)
        r = out["actor"]["params"]["w"]
        assert step == 5 and meta == {{"step": 5}}
        assert r.sharding == sh and len(r.addressable_shards) == 2
        assert {{s.data.shape for s in r.addressable_shards}} == {{(4, 6)}}
        np.testing.assert_array_equal(np.asarray(r), np.asarray(w))
        store.close()
        print("RESHARD_OK")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "RESHARD_OK" in out.stdout, out.stderr[-3000:]


def test_async_save_is_isolated_from_later_updates(tmp_path, state):
    """save() returns before the write ends; updating (and donating) the live params right after must
    neither change what is written nor break the live state."""
    store = CheckpointStore(tmp_path / "run", max_to_keep=None, async_save=True)
    arrays = _arrays(state, scale=1.0)
    before = _snapshot(arrays)
    assert store.save(7, arrays=arrays, meta=_meta(7)) is True
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x * 2.0 + 1.0, p), donate_argnums=0)
    live = bump(arrays["actor"]["params"])
    # XLA donates the buffers unless the pending save still references them (then it copies); either way the
    # checkpoint must hold the values at save() time and the live state must be the updated one.
    store.wait()
    assert store.steps() == [7]
    _, restored, _ = store.restore(like=_arrays(state))
    _assert_tree_equal(restored, before)
    expected_live = jax.tree.map(lambda x: x * 2.0 + 1.0, before["actor"]["params"])
    _assert_tree_equal(_snapshot(live), expected_live)
    store.close()


def test_settle_finishes_the_pending_save_and_records_its_failure_without_raising(tmp_path, state, monkeypatch):
    """What the trainer calls before its update: the save in flight is finished (``pending`` None after), and a
    failed background write is logged and kept in ``save_errors`` instead of raised into the training step."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    store = CheckpointStore(tmp_path / "run", max_to_keep=None, async_save=True)
    assert store.pending is None
    store.save(1, arrays=_arrays(state), meta=_meta(1))
    assert store.pending == 1
    store.settle()
    assert store.pending is None and store.steps() == [1] and store.save_errors == {}

    async def broken(self, x, directory):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", broken)
    store.save(2, arrays=_arrays(state), meta=_meta(2))
    store.settle()  # does not raise
    assert store.pending is None and set(store.save_errors) == {2} and store.steps() == [1]
    assert "Input/output error" in str(store.save_errors[2])
    monkeypatch.undo()
    store.settle()  # nothing pending: a no-op
    store.close()


def test_max_to_keep_prunes_oldest(tmp_path, state):
    store = CheckpointStore(tmp_path / "run", max_to_keep=2, async_save=True)
    for s in (1, 2, 3, 4):
        store.save(s, arrays=_arrays(state, scale=float(s)), meta=_meta(s))
    store.wait()
    assert store.steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("global_step")) == [
        "global_step_3", "global_step_4"]
    _, restored, _ = store.restore(3, like=_arrays(state))
    _assert_tree_equal(restored, _snapshot(_arrays(state, scale=3.0)))
    store.close()


def test_corrupt_newest_falls_back_with_warning(tmp_path, state, caplog):
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=True)
    for s in (1, 2, 3):
        store.save(s, arrays=_arrays(state, scale=float(s)), meta=_meta(s))
    store.wait()
    store.close()
    data = [p for p in (root / "global_step_3" / "actor.params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:  # truncated array data
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    (root / "global_step_2" / "meta" / "metadata").unlink()  # missing meta file
    # a resumed run opens the folder afresh (the writing store's tensorstore cache still holds what it wrote)
    store = CheckpointStore(root, max_to_keep=None, read_only=True)
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        step, restored, meta = store.restore(like=_arrays(state))
    assert step == 1 and meta == _meta(1)
    _assert_tree_equal(restored, _snapshot(_arrays(state, scale=1.0)))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "global_step_3" in warned and "global_step_2" in warned
    with pytest.raises(CheckpointRestoreError, match="global_step_3"):
        store.restore(3, like=_arrays(state))
    # bad meta (not the step it claims) also counts as corrupt
    (root / "global_step_1" / "meta" / "metadata").write_text('{"step": 9}')
    with pytest.raises(CheckpointRestoreError) as ei:
        store.restore(like=_arrays(state))
    msg = str(ei.value)
    assert str(root) in msg and all(f"step {s}" in msg for s in (1, 2, 3))
    store.close()


def test_partial_checkpoint_is_not_listed(tmp_path, state):
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    store.save(1, arrays=_arrays(state), meta=_meta(1))
    # an interrupted save: orbax's temporary folder, even with every file inside it
    tmp = root / "global_step_2.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(root / "global_step_1", tmp)
    assert store.steps() == [1] and store.latest_step() == 1
    assert store.restore(like=_arrays(state))[0] == 1
    with pytest.raises(CheckpointRestoreError, match="interrupted"):
        store.restore(2, like=_arrays(state))
    assert find_resume_checkpoint("auto", root, None) == (root.absolute(), None)
    store.close()
    store = CheckpointStore(root, max_to_keep=None, async_save=False)  # reopened by a resumed run:
    store.save(3, arrays=_arrays(state), meta=_meta(3))  # its first save clears interrupted saves
    assert not tmp.exists() and store.steps() == [1, 3]
    store.close()


# A full disk surfaces as OSError(ENOSPC) from Python writes and as tensorstore's RESOURCE_EXHAUSTED ValueError
# (the text below is what a 300 KiB tmpfs produced) from array writes.
_ENOSPC_ERRORS = {
    "oserror": lambda path: OSError(errno.ENOSPC, "No space left on device", path),
    "tensorstore": lambda path: ValueError(
        f'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file "{path}": Failed writing: '
        f'"{path}/d/1d64": Failed to write 20782 bytes to file 12: No space left on device [os_error_code=\'28\']'),
}


@pytest.mark.parametrize("kind", sorted(_ENOSPC_ERRORS))
@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_raises_and_keeps_earlier(tmp_path, state, monkeypatch, async_save, kind):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=1, async_save=async_save)
    store.save(1, arrays=_arrays(state, scale=1.0), meta=_meta(1), wait=True)
    live = _arrays(state, scale=2.0)
    live_before = _snapshot(live)

    async def disk_full(self, x, directory):
        (directory / self._filename).write_text('{"partial": ')
        raise _ENOSPC_ERRORS[kind](str(directory))

    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", disk_full)
    with pytest.raises(CheckpointSaveError) as ei:
        store.save(2, arrays=live, meta=_meta(2))
        store.wait()  # async: the error of the background write surfaces here
    err = ei.value
    assert err.step == 2 and err.errno == errno.ENOSPC and err.directory == root.absolute()
    assert "step 2" in str(err) and str(root) in str(err) and "disk is full" in str(err)
    assert store.steps() == [1]  # not pruned by max_to_keep=1, since step 2 never completed
    assert not any(p.name.startswith("global_step_2") for p in root.iterdir())
    _assert_tree_equal(_snapshot(live), live_before)  # in-memory state untouched
    step, restored, _ = store.restore(like=_arrays(state))
    assert step == 1
    _assert_tree_equal(restored, _snapshot(_arrays(state, scale=1.0)))
    monkeypatch.undo()  # space is back: the same store saves again and prunes as configured
    assert store.save(2, arrays=live, meta=_meta(2), wait=True)
    assert store.steps() == [2]
    store.close()


def test_save_validates_inputs_and_step_order(tmp_path, state, caplog):
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    with pytest.raises(TypeError, match=r"meta\['rng'\]\['seed'\]"):
        store.save(1, arrays=_arrays(state), meta={"rng": {"seed": np.int64(3)}})
    with pytest.raises(TypeError, match="must be a str"):
        store.save(1, arrays=_arrays(state), meta={1: "x"})
    with pytest.raises(ValueError, match="role name"):
        store.save(1, arrays={"actor.x": {"params": {}}}, meta={})
    with pytest.raises(ValueError, match="step must be an int"):
        store.save(-1, arrays=_arrays(state), meta={})
    assert store.steps() == []
    store.save(5, arrays=_arrays(state), meta=_meta(5))
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        assert store.save(5, arrays=_arrays(state), meta=_meta(5)) is False
    assert "already exists" in caplog.text
    with pytest.raises(CheckpointSaveError, match="newer checkpoint"):
        store.save(4, arrays=_arrays(state), meta=_meta(4))
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointStore(root, max_to_keep=0)
    with pytest.raises(FileNotFoundError):
        CheckpointStore(tmp_path / "nope", max_to_keep=None, read_only=True)
    store.close()


def test_find_resume_checkpoint_modes(tmp_path, state):
    root = tmp_path / "run"
    assert find_resume_checkpoint("disable", root, None) is None
    assert find_resume_checkpoint("auto", root, None) is None  # nothing there: start fresh
    root.mkdir()
    assert find_resume_checkpoint("auto", root, None) is None
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    store.save(2, arrays=_arrays(state), meta=_meta(2))
    store.save(4, arrays=_arrays(state), meta=_meta(4))
    store.close()
    assert find_resume_checkpoint("auto", root, None) == (root.absolute(), None)
    assert find_resume_checkpoint("disable", root, str(root)) is None
    assert find_resume_checkpoint("resume_path", tmp_path / "other", root) == (root.absolute(), None)
    assert find_resume_checkpoint("resume_path", tmp_path / "other", root / "global_step_2") == (root.absolute(), 2)
    with pytest.raises(ValueError, match="requires trainer.resume_from_path"):
        find_resume_checkpoint("resume_path", root, None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_resume_checkpoint("resume_path", root, tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_resume_checkpoint("resume_path", root, root / "global_step_3")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        find_resume_checkpoint("resume_path", root, empty)
    tmp = root / "global_step_6.orbax-checkpoint-tmp-1"
    tmp.mkdir()
    with pytest.raises(FileNotFoundError, match="interrupted"):
        find_resume_checkpoint("resume_path", root, tmp)
    with pytest.raises(ValueError, match="resume_mode"):
        find_resume_checkpoint("latest", root, None)
    assert parse_step_dir(root / "global_step_4") == 4 and parse_step_dir(tmp) is None
    assert step_dir(root, 4) == root / "global_step_4"


def test_max_to_keep_from_config():
    assert max_to_keep_from_config(None, None, has_critic=False) is None
    assert max_to_keep_from_config(0, 3, has_critic=False) is None  # verl: 0 = keep all
    assert max_to_keep_from_config(2, None, has_critic=False) == 2
    assert max_to_keep_from_config(2, None, has_critic=True) is None
    assert max_to_keep_from_config(2, 5, has_critic=True) == 5


def test_trainer_checkpoint_config_keys():
    from jaxrl.checkpoint import RESUME_MODES
    from jaxrl.config import ConfigError, load_config
    from jaxrl.config.schema import RESUME_MODE_CHOICES

    assert RESUME_MODE_CHOICES == RESUME_MODES
    t = load_config(None).trainer
    assert (t.resume_mode, t.resume_from_path, t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep,
            t.max_nonfinite_steps, t.checkpoint_async) == ("auto", None, None, None, 3, True)
    t = load_config(None, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/r/global_step_5",
                           "trainer.max_actor_ckpt_to_keep=2", "trainer.checkpoint_async=False"]).trainer
    assert (t.resume_from_path, t.max_actor_ckpt_to_keep, t.checkpoint_async) == ("/r/global_step_5", 2, False)
    for overrides, key in (
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
        (["trainer.resume_mode=latest"], "trainer.resume_mode"),
        (["trainer.max_critic_ckpt_to_keep=-2"], "trainer.max_critic_ckpt_to_keep"),
        (["trainer.max_nonfinite_steps=0"], "trainer.max_nonfinite_steps"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, overrides)
