"""PRIME's implicit PRM role (jaxrl.workers.prime_rm) on a tiny decoder: the loss it minimises is the paper's CE on
its own forward, it learns the labels (accuracy and loss move), the update modes, exact state save / restore."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.algorithms.prime import implicit_log_ratio, prm_ce_loss
from jaxrl.config.batch_plan import prime_plan
from jaxrl.config.schema import JaxRLConfig, PRMOptimConfig
from jaxrl.models.decoder import Decoder
from jaxrl.workers.prime_rm import ImplicitPRMWorker
from tests.helpers import tiny_batch, tiny_model_config

CFG = tiny_model_config("llama")
N, P, R = 8, 6, 5


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))


def make(split_model, *, update="before", beta=0.5, lr=3e-2, mini=8, micro=4, mesh=None, shards=1):
    graphdef, params = split_model
    cfg = JaxRLConfig()
    cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = N // 2, 2
    rm = cfg.reward_model
    rm.mini_batch_size, rm.micro_batch_size_per_gpu = mini, micro
    rm.model.update, rm.model.beta_train = update, beta
    rm.model.optim = PRMOptimConfig(lr=lr)
    copy = lambda t: jax.tree.map(lambda x: x.copy(), t)  # noqa: E731
    return ImplicitPRMWorker(graphdef, copy(params), graphdef, copy(params), rm,
                             plan=prime_plan(cfg, batch_shards=shards), total_training_steps=10, seed=0, mesh=mesh)


def labelled_batch(seed=0):
    batch = tiny_batch(N, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size, group_size=2)[0]
    batch.acc = np.array([1, 0, 0, 1, 1, 0, 0.5, 1], np.float32)
    return batch


def test_the_update_loss_is_the_papers_ce_on_the_prms_own_log_probs(split_model):
    prm = make(split_model, update="after", lr=1e-3)
    batch = labelled_batch()
    # perturb the PRM away from its reference, so the loss is not log 2 everywhere
    prm.params = jax.tree.map(lambda x: x * 1.3, prm.params)
    ref, lp = prm.ref_log_probs(batch), prm.log_probs(batch)
    expect = float(prm_ce_loss(lp, ref, batch.response_mask, batch.acc, beta=0.5))
    _, metrics = prm.step(batch)
    # one mini-batch of 8 in 2 micro-batches: the summed micro losses = the mini-batch mean
    assert metrics["reward_model/dpo_loss"] == pytest.approx(expect, rel=1e-4)
    assert prm.num_updates == 1 and metrics["reward_model/lr"] == pytest.approx(1e-3)


def test_the_prm_learns_the_labels_and_its_scores_follow(split_model):
    prm = make(split_model)
    batch = labelled_batch()
    first = None
    for _ in range(8):
        scores, m = prm.step(batch)
        first = first if first is not None else m
    assert first["reward_model/dpo_acc_before"] == pytest.approx(0.5)  # PRM == reference: every pair a tie
    assert m["reward_model/dpo_loss"] < first["reward_model/dpo_loss"] - 0.05
    assert m["reward_model/dpo_acc"] == 1.0 and m["reward_model/dpo_acc_abs"] >= 7 / 8
    q = implicit_log_ratio(prm.log_probs(batch), prm.ref_log_probs(batch), batch.response_mask)
    seq = np.asarray(q).sum(-1)
    assert seq[batch.acc == 1].min() > seq[batch.acc == 0].max()  # correct responses score above wrong ones
    assert scores.shape == (N, R) and np.all(scores[batch.response_mask == 0] == 0)
    to_go = np.flip(np.cumsum(np.flip(scores, 1), 1), 1)
    assert np.abs(to_go).max() <= 1.0 + 1e-5  # prime_norm=batch_norm


def test_update_modes(split_model):
    batch = labelled_batch()
    none = make(split_model, update="none")
    scores, m = none.step(batch)
    assert none.num_updates == 0 and "reward_model/dpo_loss" not in m
    np.testing.assert_allclose(scores, 0.0, atol=1e-6)  # PRM == its reference: no process reward
    after = make(split_model, update="after")
    scores, m = after.step(batch)
    assert after.num_updates == 1
    np.testing.assert_allclose(scores, 0.0, atol=1e-6)  # scored before its update
    before = make(split_model, update="before")
    scores, _ = before.step(batch)
    assert np.abs(scores).max() > 1e-3  # scored by the updated PRM


def test_state_round_trip_continues_exactly(split_model):
    a, b = make(split_model), make(split_model)
    batch, other = labelled_batch(0), labelled_batch(1)
    a.step(batch)
    arrays, meta = a.state()
    b.load_state(jax.tree.map(lambda x: x.copy(), arrays), dict(meta))
    sa, ma = a.step(other)
    sb, mb = b.step(other)
    np.testing.assert_array_equal(sa, sb)
    assert ma == mb


def test_step_needs_labels(split_model):
    batch = dataclasses.replace(labelled_batch(), acc=None)
    with pytest.raises(ValueError, match="batch.acc"):
        make(split_model).step(batch)


def test_on_a_mesh_equals_one_device(split_model):
    """The PRM on a data 2 x fsdp 2 mesh (its params, optimizer state and reference placed by the rules, each
    micro-batch's rows split over the batch axes) trains and scores as on one device."""
    from jax.sharding import PartitionSpec

    from sharding import make_mesh

    mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    single = make(split_model, micro=4)
    sharded = make(split_model, micro=2, mesh=mesh, shards=4)  # 2 rows per device = the single run's 4-row micro x 2
    for seed in (0, 1):
        batch = labelled_batch(seed)
        s1, m1 = single.step(batch)
        s2, m2 = sharded.step(batch)
        np.testing.assert_allclose(s1, s2, atol=2e-5)
        for k in m1:
            assert m2[k] == pytest.approx(m1[k], abs=2e-5), k
    leaves = jax.tree.leaves(sharded.params)
    assert any(leaf.sharding.spec != PartitionSpec() for leaf in leaves)  # really sharded, not replicated
