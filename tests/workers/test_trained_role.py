"""The trained-role base: the epochs x shuffled mini-batches loop with micro-batch accumulation, the optimizer, the
metric averaging and state()/load_state(), on a toy linear role checked against a plain full-mini-batch loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.config.batch_plan import RolePlan
from jaxrl.workers.trained_role import TrainedRole
from sharding import make_mesh
from tests.helpers import tiny_optim

D, R = 3, 4  # features, "response" positions


@dataclasses.dataclass
class ToyBatch:
    """What the loop reads of a batch: its row count, prompt width and the arrays the toy loss uses."""

    x: np.ndarray  # [N, R, D]
    y: np.ndarray  # [N, R]
    mask: np.ndarray  # [N, R] 0/1
    prompt_width: int = 1

    @property
    def size(self) -> int:
        return self.x.shape[0]


def toy_loss(w, x, y, mask, num_tokens):
    """Masked squared error normalised by the mini-batch's token count (what the actor/critic losses do)."""
    return jnp.sum(jnp.square(x @ w - y) * mask) / num_tokens


class ToyRole(TrainedRole):
    name = "toy"

    def minibatch_arrays(self, batch):
        return {"x": batch.x, "y": batch.y, "response_mask": batch.mask.astype(np.float32)}

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra):
        mask = micro["response_mask"]
        loss = toy_loss(params["w"], micro["x"], micro["y"], mask, num_tokens)
        tokens = jnp.sum(mask)
        pred = jax.lax.stop_gradient(micro["x"] @ params["w"])
        return loss, ({"toy/loss": loss}, {"toy/pred_mean": jnp.sum(pred * mask)}, tokens)


def make_batch(n, seed=0) -> ToyBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, size=n)
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    return ToyBatch(rng.normal(size=(n, R, D)).astype(np.float32), rng.normal(size=(n, R)).astype(np.float32), mask)


def make_role(*, rows=10, mini=4, micro=2, epochs=2, shuffle=True, seed=3, **kw) -> ToyRole:
    plan = RolePlan.derive("toy", rollout_n=1, rows_per_step=rows, mini_batch_size=mini,
                           micro_batch_size_per_gpu=micro, forward_key="toy.forward", forward_per_gpu=None,
                           ppo_epochs=epochs)
    params = {"w": jnp.asarray(np.linspace(-1, 1, D), jnp.float32)}
    return ToyRole(None, params, plan=plan, optim=tiny_optim(), grad_clip=1.0, shuffle=shuffle,
                   total_training_steps=5, seed=seed, **kw)


def reference_step(w, batch, *, mini, epochs, rng, opt_state, tx):
    """verl's loop written plainly: per epoch a permutation, mini-batches of ``mini`` rows, one full-mini-batch
    gradient (no micro-batches) and one optax update each."""
    losses = []
    for _ in range(epochs):
        order = rng.permutation(batch.size)
        for start in range(0, batch.size, mini):
            idx = order[start : start + mini]
            x, y, m = batch.x[idx], batch.y[idx], batch.mask[idx]
            num_tokens = max(m.sum(), 1.0)
            loss, g = jax.value_and_grad(toy_loss)(w, x, y, m, num_tokens)
            updates, opt_state = tx.update(g, opt_state, w)
            w = optax.apply_updates(w, updates)
            losses.append(float(loss))
    return w, opt_state, losses


def test_loop_equals_plain_full_mini_batch_updates():
    role = make_role()
    assert (role.mini_batch_rows, role.micro_batch_rows, role.updates_per_step) == (4, 2, 2 * 3)
    batch = make_batch(10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    w_ref = jnp.array(role.params["w"], copy=True)  # the role donates its buffers to the update
    ref_state = tx.init(w_ref)
    rng = np.random.default_rng(3)
    all_losses = []
    for step in range(2):
        metrics = role.run_updates(batch)
        w_ref, ref_state, losses = reference_step(w_ref, batch, mini=4, epochs=2, rng=rng, opt_state=ref_state, tx=tx)
        all_losses += losses
        np.testing.assert_allclose(np.asarray(role.params["w"]), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics["toy/loss"], np.mean(losses), rtol=1e-5)
        assert role.num_updates == 6 * (step + 1)
    assert metrics["toy/nonfinite_grad"] == 0 and metrics["toy/lr"] == pytest.approx(1e-2)
    assert metrics["toy/grad_norm"] > 0 and set(metrics) == {"toy/loss", "toy/pred_mean", "toy/grad_norm",
                                                             "toy/nonfinite_grad", "toy/lr"}
    assert len(set(np.round(all_losses, 6))) == len(all_losses)  # the params moved between updates


def test_a_new_batch_shape_compiles_only_its_gradient_program():
    """The optimizer step is a program of its own: batches of other widths (here other prompt widths, a static
    argument of the gradient program) each compile a gradient program, and the one optimizer step serves them all."""
    role = make_role(epochs=1)
    for width in (1, 3, 5, 3):
        role.run_updates(dataclasses.replace(make_batch(10, seed=width), prompt_width=width))
    assert role._grads_fn._cache_size() == 3
    assert role._step_fn._cache_size() == 1
    assert role.num_updates == 4 * 3


def test_shuffle_off_keeps_the_row_order_and_nonfinite_updates_are_counted():
    ordered, shuffled = make_role(shuffle=False, epochs=1), make_role(shuffle=True, epochs=1)
    batch = make_batch(10, seed=1)
    m_o, m_s = ordered.run_updates(batch), shuffled.run_updates(batch)
    # the same rows in another order make other mini-batches: the first update's params already differ
    assert not np.allclose(np.asarray(ordered.params["w"]), np.asarray(shuffled.params["w"]))
    assert m_o["toy/loss"] != pytest.approx(m_s["toy/loss"])
    bad = dataclasses.replace(batch, y=np.where(np.arange(10)[:, None] < 4, np.nan, batch.y).astype(np.float32))
    role = make_role(shuffle=False, epochs=1)
    before = np.asarray(role.params["w"]).copy()
    m = role.run_updates(bad)  # rows 0-3 are the first mini-batch: NaN loss there, that update is skipped
    assert m["toy/nonfinite_grad"] == 1 and role.num_updates == 3
    assert np.all(np.isfinite(np.asarray(role.params["w"]))) and not np.allclose(np.asarray(role.params["w"]), before)


def test_state_round_trip_continues_identically():
    a = make_role()
    batch = make_batch(10, seed=2)
    a.run_updates(batch)
    arrays, meta = a.state()
    assert set(arrays) == {"params", "opt_state"} and set(meta) == {"num_updates", "rng"}
    assert meta["num_updates"] == 6 and meta["rng"]["bit_generator"] == "PCG64"
    b = make_role(seed=99)  # another shuffling seed: load_state must restore the RNG too (and keep the opt state)
    b.load_state(jax.tree.map(lambda x: x.copy(), arrays), meta)
    assert b.num_updates == 6
    ma, mb = a.run_updates(batch), b.run_updates(batch)
    assert ma == mb
    np.testing.assert_array_equal(np.asarray(a.params["w"]), np.asarray(b.params["w"]))


def test_sizes_are_checked_against_the_plan_and_the_mesh():
    with pytest.raises(ValueError, match=r"toy.ppo_mini_batch_size\*rollout.n = 4 must be divisible by "
                                         r"toy.ppo_micro_batch_size_per_gpu = 3"):
        make_role(micro=3)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)  # 4 batch shards
    # a plan derived for one device (its per-gpu sizes are per device) does not run on 4 data-parallel devices
    with pytest.raises(ValueError, match=r"toy: the batch plan was derived for 1 data-parallel device\(s\) but the "
                                         r"role runs on 4 .*batch_shards=4"):
        make_role(mesh=mesh)

    def plan4(**kw):
        args = dict(rollout_n=1, rows_per_step=8, mini_batch_size=8, micro_batch_size_per_gpu=1,
                    forward_key="toy.forward", forward_per_gpu=None, batch_shards=4)
        return RolePlan.derive("toy", **{**args, **kw})

    with pytest.raises(ValueError, match=r"toy.ppo_mini_batch_size\*rollout.n = 8 / 4 data-parallel devices = 2 per "
                                         r"device must be divisible by toy.ppo_micro_batch_size_per_gpu = 3 \(a "
                                         r"micro-batch of 3 x 4 = 12 rows\)"):
        plan4(micro_batch_size_per_gpu=3).check()
    with pytest.raises(ValueError, match=r"toy.ppo_mini_batch_size\*rollout.n = 6 responses per mini-batch do not "
                                         r"split over the 4 data-parallel devices"):
        plan4(mini_batch_size=6).check()
    # an unset forward micro-batch stands for global rows (here 6), which must split over the mesh
    with pytest.raises(ValueError, match=r"the micro-batch of toy.forward: 6 rows per call must be a positive "
                                         r"multiple of the 4 batch shards"):
        ToyRole(None, {"w": jnp.zeros(D)}, plan=plan4(forward_fallback=6), optim=tiny_optim(), grad_clip=1.0,
                shuffle=False, total_training_steps=1, mesh=mesh)
    # a plan for 4 devices does not run on one either
    with pytest.raises(ValueError, match=r"derived for 4 data-parallel device\(s\) but the role runs on 1"):
        ToyRole(None, {"w": jnp.zeros(D)}, plan=plan4(), optim=tiny_optim(), grad_clip=1.0, shuffle=False,
                total_training_steps=1)
