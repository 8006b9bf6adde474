"""Roles on a device mesh (8 simulated CPU devices, tests/conftest.py): a sharded actor / critic update equals the
single-device one and keeps the rule shardings; after a colocated or a split weight sync the rollout sampler
generates exactly what an unsharded sampler on the actor's params generates; placement and config errors."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.batch import RLBatch
from jaxrl.config import ConfigError, load_config
from jaxrl.models.decoder import Decoder
from jaxrl.models.value_model import ValueModel
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.jax_sampler import JaxSampler
from jaxrl.rollout.weight_format import WeightFormat
from jaxrl.rollout.weight_sync import WeightSync
from jaxrl.trainer import Trainer
from jaxrl.workers.actor import ActorWorker, LogProbComputer
from jaxrl.workers.critic import CriticWorker
from jaxrl.workers.placement import batch_shards, make_placement, placement_from_config
from sharding import DEFAULT_RULES, make_mesh
from tests.helpers import actor_setup, critic_setup, tiny_batch, tiny_model_config, tiny_optim

CFG = tiny_model_config("llama")
P, R = 6, 5
N = 16  # rows per RL batch: 2 mini-batches of 8 rows, each 2 micro-batches of 4 rows (1 per device of data 2 x fsdp 2)
SIZES = {"data": 2, "fsdp": 2, "tensor": 2}
PROMPTS = [[1, 5, 9, 33], [1, 40, 41, 42, 43, 44, 45], [1, 17], [1, 60, 3, 8, 22]]
# Gradients of two layouts differ by fp32 summation-order noise; Adam divides each gradient by its own magnitude,
# which amplifies that noise for gradients near eps. eps=1e-3 keeps it below the tolerance while every parameter
# still moves by ~lr (see tests/sharding/test_sharded_step.py).
OPTIM = tiny_optim(lr=1e-3, eps=1e-3, weight_decay=0.1)


def test_eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py must set --xla_force_host_platform_device_count=8"


def peaked(state, seed):
    """Random fp32 weights ~N(0, 0.3) (norm scales ~1): peaked next-token distributions, no greedy near-ties."""
    rng = np.random.default_rng(seed)

    def init(x):
        if x.ndim == 1:
            return jnp.asarray(1.0 + 0.1 * rng.normal(size=x.shape), jnp.float32)
        return jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32)

    return jax.tree.map(init, state)


@pytest.fixture(scope="module")
def policy():
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
    return graphdef, peaked(state, 3)


def copy(params):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)


def make_batch(seed=0, grouped=False) -> RLBatch:
    """``grouped``: each pair of rows repeats one prompt (a GRPO group of n = 2, for the shared-prompt layout)."""
    batch, rng = tiny_batch(N, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size)
    if grouped:
        batch.prompt_ids[1::2], batch.prompt_mask[1::2] = batch.prompt_ids[0::2], batch.prompt_mask[0::2]
    response_mask = batch.response_mask
    batch.advantages = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    batch.old_log_probs = (-rng.uniform(0.5, 4.0, size=(N, R)) * response_mask).astype(np.float32)
    batch.ref_log_probs = batch.old_log_probs  # unused by kl_loss_type="full" but required by update()
    batch.values = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    batch.returns = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    return batch


def make_actor(graphdef, params, mesh=None):
    """Exact ("full") KL: the reference's params enter the sharded update too. Mini-batches of 4 prompts x n=2,
    micro-batches of 4 rows and log-prob calls of 8 rows on one device and on the mesh (``*_per_gpu`` are per device:
    that / the mesh's batch shards on each device)."""
    shards = 1 if mesh is None else batch_shards(mesh, DEFAULT_RULES)
    cfg, plan = actor_setup(rows=N, rollout_n=2, log_prob_micro=8 // shards, ppo_mini_batch_size=4,
                            ppo_micro_batch_size_per_gpu=4 // shards, kl_loss_type="full", optim=OPTIM,
                            batch_shards=shards)
    assert (plan.micro_batch_rows, plan.forward_rows) == (4, 8)
    return ActorWorker(graphdef, copy(params), cfg, plan=plan, temperature=0.9, total_training_steps=1,
                       ref_params=copy(params), mesh=mesh, rules=DEFAULT_RULES)


def value_of(var):
    return var.get_value() if isinstance(var, nnx.Variable) else var


def assert_trees_close(a, b, rtol, atol):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def actors(policy):
    """The same actor unsharded and on a data=2 x fsdp=2 x tensor=2 mesh, each after one update on one batch."""
    graphdef, params = policy
    batch = make_batch()
    single, sharded = make_actor(graphdef, params), make_actor(graphdef, params, make_mesh(**SIZES))
    lp1, _ = single.compute_log_probs(batch)
    lp8, _ = sharded.compute_log_probs(batch)
    m1, m8 = single.update(batch), sharded.update(batch)
    return SimpleNamespace(single=single, sharded=sharded, lp=(lp1, lp8), metrics=(m1, m8), params=params)


def test_sharded_actor_update_equals_single_device(actors):
    lp1, lp8 = actors.lp
    np.testing.assert_allclose(lp8, lp1, rtol=1e-5, atol=1e-6)
    m1, m8 = actors.metrics
    assert set(m1) == set(m8)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert m8["actor/nonfinite_grad"] == 0
    assert_trees_close(actors.sharded.params, actors.single.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(actors.sharded.opt_state, actors.single.opt_state, rtol=1e-5, atol=1e-7)
    # The update moved the params (the comparison is not between two untouched copies).
    before = np.asarray(value_of(actors.params["embed_tokens"]))
    assert np.abs(np.asarray(value_of(actors.sharded.params["embed_tokens"])) - before).max() > 1e-4


def test_sharded_actor_state_carries_the_rule_shardings(actors):
    p, opt = actors.sharded.params, actors.sharded.opt_state
    q = value_of(p["layers"][0]["self_attn"]["q_proj"])  # [E=32, nH=4, D=8] (embed, heads, head_dim)
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (16, 2, 8)
    assert value_of(p["embed_tokens"]).sharding.spec == PartitionSpec("tensor", "fsdp")  # (vocab, embed)
    assert value_of(p["layers"][1]["mlp"]["down_proj"]).sharding.spec == PartitionSpec("tensor", "fsdp")
    adam = opt[1][0]  # chain(clip_by_global_norm, adamw): adamw's ScaleByAdamState
    assert value_of(adam.mu["layers"][0]["self_attn"]["q_proj"]).sharding.spec == PartitionSpec("fsdp", "tensor", None)
    ref_q = value_of(actors.sharded.ref_params["layers"][0]["self_attn"]["q_proj"])
    assert ref_q.sharding == q.sharding
    # The single-device actor stays on one device.
    assert len(value_of(actors.single.params["embed_tokens"]).sharding.device_set) == 1


def test_sharded_critic_update_equals_single_device():
    graphdef, state = nnx.split(ValueModel(CFG, rngs=nnx.Rngs(1)))
    params = peaked(state, 5)
    cfg, plan = critic_setup(rows=N, rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                             forward_micro_batch_size_per_gpu=8, optim=OPTIM)
    # the same global sizes on the mesh: per device, a quarter of them on each of the 4 batch shards
    mesh_cfg, mesh_plan = critic_setup(rows=N, rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                       forward_micro_batch_size_per_gpu=2, optim=OPTIM, batch_shards=4)
    assert (mesh_plan.micro_batch_rows, mesh_plan.forward_rows) == (plan.micro_batch_rows, plan.forward_rows) == (4, 8)
    batch = make_batch(seed=1)
    single = CriticWorker(graphdef, copy(params), cfg, plan=plan, total_training_steps=1)
    sharded = CriticWorker(graphdef, copy(params), mesh_cfg, plan=mesh_plan, total_training_steps=1,
                           mesh=make_mesh(**SIZES))
    np.testing.assert_allclose(sharded.compute_values(batch), single.compute_values(batch), rtol=1e-5, atol=1e-6)
    m1, m8 = single.update(batch), sharded.update(batch)
    for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert_trees_close(sharded.params, single.params, rtol=1e-5, atol=1e-6)
    head = value_of(sharded.params["value_head"])  # [E, 1] (embed, None)
    assert head.sharding.spec == PartitionSpec("fsdp", None)
    q = value_of(sharded.params["backbone"]["layers"][0]["self_attn"]["q_proj"])
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)


@pytest.mark.parametrize("share", [False, True], ids=["packed", "prefix-grouper"])
def test_packed_actor_and_critic_on_the_mesh_equal_single_device_padded(policy, share):
    """use_remove_padding (and a per-device token budget) on data 2 x fsdp 2 x tensor 2: packed rows, one per batch
    shard, give the single-device padded log-probs, update and values; so do shared prompts
    (``use_prefix_grouper``: each pair of rows repeats a prompt, laid once on its device)."""
    graphdef, params = policy
    budget = 20  # real tokens per device: several micro-batches per mini-batch
    batch = make_batch(seed=2, grouped=share)
    single = make_actor(graphdef, params)
    mesh = make_mesh(**SIZES)
    packed = make_actor(graphdef, params, mesh)
    packed.plan = dataclasses.replace(packed.plan, remove_padding=True, share_prompts=share, max_token_len=budget)
    packed.log_prob = LogProbComputer(graphdef, micro_batch_size=8, temperature=0.9, mesh=mesh, remove_padding=True,
                                      share_prompts=share, max_token_len=budget)
    lp1, ent1 = single.compute_log_probs(batch)
    lp8, ent8 = packed.compute_log_probs(batch)
    np.testing.assert_allclose(lp8, lp1, rtol=0, atol=2e-5)
    np.testing.assert_allclose(ent8, ent1, rtol=0, atol=2e-5)
    m1, m8 = single.update(batch), packed.update(batch)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert_trees_close(packed.params, single.params, rtol=1e-4, atol=1e-5)
    q = value_of(packed.params["layers"][0]["self_attn"]["q_proj"])
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)  # the rules' layout survives the packed update

    vgraph, vstate = nnx.split(ValueModel(CFG, rngs=nnx.Rngs(1)))
    vparams = peaked(vstate, 5)
    cfg, plan = critic_setup(rows=N, rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, optim=OPTIM)
    mcfg, mplan = critic_setup(rows=N, rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                               optim=OPTIM, batch_shards=4)
    mplan = dataclasses.replace(mplan, remove_padding=True, max_token_len=budget, forward_max_token_len=budget)
    c1 = CriticWorker(vgraph, copy(vparams), cfg, plan=plan, total_training_steps=1)
    c8 = CriticWorker(vgraph, copy(vparams), mcfg, plan=mplan, total_training_steps=1, mesh=mesh)
    np.testing.assert_allclose(c8.compute_values(batch), c1.compute_values(batch), rtol=0, atol=2e-5)
    v1, v8 = c1.update(batch), c8.update(batch)
    np.testing.assert_allclose(v8["critic/vf_loss"], v1["critic/vf_loss"], rtol=1e-4, atol=1e-6)
    assert_trees_close(c8.params, c1.params, rtol=1e-4, atol=1e-5)


def greedy(sampler):
    out = sampler.generate(PROMPTS, SamplingParams(n=2, do_sample=False, max_new_tokens=8))
    return out.response_ids, out.rollout_log_probs


def on_one_device(params):
    """A single-device copy of (possibly sharded) ``params``, through the host."""
    return jax.device_put(jax.tree.map(lambda x: np.asarray(x), params), jax.devices()[0])


@pytest.fixture(scope="module")
def single_device_sampler(policy):
    """A plain sampler on one device (the unsharded reference); tests give it their params."""
    graphdef, params = policy
    return JaxSampler(CFG, graphdef, on_one_device(params), pad_token_id=0, eos_token_ids=(), max_prompt_length=8,
                      prompt_length_bucket=8)


@pytest.mark.parametrize("kind", ["colocated", "split"])
def test_sampler_after_sync_generates_what_the_actor_params_generate(policy, single_device_sampler, kind):
    graphdef, params = policy
    if kind == "colocated":
        placement = make_placement("colocated", SIZES, rollout_tp=2)
    else:
        placement = make_placement("split", {"data": 1, "fsdp": 2, "tensor": 2}, rollout_devices=4, rollout_tp=2)
    train_ids = {d.id for d in placement.train_mesh.devices.flat}
    rollout_ids = {d.id for d in placement.rollout_mesh.devices.flat}
    assert dict(placement.rollout_mesh.shape) == ({"data": 4, "fsdp": 1, "tensor": 2} if kind == "colocated"
                                                  else {"data": 2, "fsdp": 1, "tensor": 2})
    assert (train_ids == rollout_ids) if kind == "colocated" else (train_ids.isdisjoint(rollout_ids)
                                                                   and rollout_ids == {4, 5, 6, 7})

    actor = make_actor(graphdef, params, placement.train_mesh)
    weight_sync = WeightSync.start(  # the initial sync: the sampler starts on the actor's params translated
        WeightFormat.jax(placement.rollout_mesh, placement.rollout_rules), actor.params,
        lambda initial: JaxSampler(CFG, graphdef, initial, mesh=placement.rollout_mesh, rules=placement.rollout_rules,
                                   pad_token_id=0, eos_token_ids=(), max_prompt_length=8, prompt_length_bucket=8))
    sampler, report = weight_sync.engine, weight_sync.initial_report
    assert report.bytes_moved > 0
    ids0, lp0 = greedy(sampler)
    single_device_sampler.update_weights(on_one_device(actor.params))
    ref_ids0, ref_lp0 = greedy(single_device_sampler)
    assert len(set(ref_ids0.ravel().tolist())) > 3  # a non-degenerate continuation
    np.testing.assert_array_equal(ids0, ref_ids0)
    np.testing.assert_allclose(lp0, ref_lp0, rtol=1e-4, atol=1e-5)

    # New actor params in the train layout (as an update leaves them; the update itself is tested above), then
    # the trainer's own sync step: the sampler follows them.
    noise = peaked(params, 7)
    actor.params = jax.tree.map(lambda p, e: p + 0.1 * e, actor.params, noise)
    assert value_of(actor.params["embed_tokens"]).sharding.spec == PartitionSpec("tensor", "fsdp")
    fake = SimpleNamespace(c=SimpleNamespace(weight_sync=weight_sync, rollout=sampler, actor=actor), pipeline=None)
    moved = Trainer.sync_rollout(fake)
    assert moved == report.bytes_moved > 0
    for leaf in jax.tree.leaves(sampler.params):  # the weights live on the rollout mesh, tensor-parallel layout
        assert {d.id for d in leaf.sharding.device_set} == rollout_ids
    q = value_of(sampler.params["layers"][0]["self_attn"]["q_proj"])
    assert q.sharding.spec == PartitionSpec(None, "tensor", None)
    ids1, lp1 = greedy(sampler)
    single_device_sampler.update_weights(on_one_device(actor.params))
    ref_ids1, ref_lp1 = greedy(single_device_sampler)
    np.testing.assert_array_equal(ids1, ref_ids1)
    np.testing.assert_allclose(lp1, ref_lp1, rtol=1e-4, atol=1e-5)
    assert not np.allclose(lp1, lp0)  # the new params changed what the sampler computes

    # Generated rows are split over the rollout mesh's data axis (KV cache batch dim sharded over "data").
    ids, mask = np.zeros((8, 8), np.int32), np.ones((8, 8), np.int32)
    cache = sampler._prefill(sampler.params, ids, mask, max_new_tokens=4)
    assert all(k.sharding.spec[0] == "data" for k in cache.k)  # each layer's [B, nKV, S, D]


# -- placement and config errors --------------------------------------------------------------------------------


def test_mesh_that_does_not_fit_names_sizes_device_count_and_xla_flags():
    with pytest.raises(ConfigError) as e:
        make_placement("colocated", {"data": 2, "fsdp": 2, "tensor": 4})
    msg = str(e.value)
    assert "data=2 x fsdp=2 x tensor=4" in msg and "jax.device_count()=8" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in msg
    with pytest.raises(ConfigError, match=r"split: 4 train devices.*device_count=12"):
        make_placement("split", {"data": 1, "fsdp": 8, "tensor": 1}, rollout_devices=4)
    with pytest.raises(ConfigError, match="rollout_devices=8"):
        make_placement("split", {"data": 1, "fsdp": -1, "tensor": 1}, rollout_devices=8)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 must divide the 4 rollout devices"):
        make_placement("split", {"data": 1, "fsdp": -1, "tensor": 1}, rollout_devices=4, rollout_tp=3)


def _cfg(*overrides):
    return load_config(None, [
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.n_gpus_per_node=1", *overrides,
    ])


def test_no_mesh_configured_means_single_device():
    assert placement_from_config(_cfg()) is None


def test_placement_from_config_fills_fsdp_and_uses_rules():
    cfg = _cfg("trainer.mesh.tensor=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "trainer.sharding_rules={embed: null}",
               "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    pl = placement_from_config(cfg)
    assert pl.kind == "colocated" and dict(pl.train_mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert dict(pl.rollout_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(pl.rules)["embed"] is None and dict(pl.rules)["mlp"] == "tensor"
    split = placement_from_config(_cfg("trainer.placement=split", "trainer.rollout_devices=4",
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"))
    assert split.kind == "split" and dict(split.train_mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    assert [d.id for d in split.rollout_mesh.devices.flat] == [4, 5, 6, 7]
    assert dict(split.rollout_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}  # rollout TP defaults to 2


def test_per_device_micro_batches_must_divide_the_per_device_mini_batch():
    """16 responses per mini-batch over data x fsdp = 4 devices: 4 per device, which a per-device micro-batch of 8
    (fine on one device, 16 % 8 == 0) does not divide; the message names the per-device value, the data-parallel
    size and the global micro-batch."""
    expected = (r"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \(rows per device, as in verl\) must divide "
                r"the per-device mini-batch: .*= 16 responses / 4 data-parallel devices \(trainer.mesh data=2 x "
                r"fsdp=2\) = 4; a micro-batch is 8 x 4 = 32 rows on the mesh; valid: a divisor of 4")
    # Known at load time (no -1 among the batch axes): the loader rejects it.
    with pytest.raises(ConfigError, match=expected):
        _cfg("trainer.mesh.data=2", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    # fsdp=-1 fills from the device count: checked when the placement is built.
    cfg = _cfg("trainer.mesh.tensor=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    with pytest.raises(ConfigError, match=expected.replace("data=2 x fsdp=2", "data=1 x fsdp=4")):
        placement_from_config(cfg)
    # an unset log-prob micro-batch is one call over the whole step (16 rows): it must split too
    with pytest.raises(ConfigError, match=r"log_prob_micro_batch_size_per_gpu=null stands for all responses of a step "
                                          r"in one call: 6 rows per call, which do not split over the 4 data-parallel"):
        placement_from_config(load_config(None, [
            "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.n_gpus_per_node=1", "trainer.mesh.tensor=2"]))


@pytest.mark.parametrize("override, expected", [
    (["trainer.placement=spilt"], "trainer.placement='spilt' is invalid; expected one of 'colocated', 'split'"),
    (["trainer.placement=split"], "trainer.rollout_devices=None is invalid"),
    (["trainer.rollout_devices=4"], "null unless trainer.placement='split'"),
    (["trainer.mesh.tensor=-1", "trainer.mesh.fsdp=-1"], "more than one axis set to -1"),
    (["trainer.mesh.data=0"], "trainer.mesh.data=0 is invalid"),
    (["trainer.sharding_rules={embd: null}"], "did you mean 'embed'"),
    (["trainer.sharding_rules={mlp: [tensor, model]}"], "trainer.sharding_rules.mlp"),
])
def test_config_errors(override, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(*override)
    assert expected in str(e.value)


def test_activations_follow_the_batch_rule_at_block_boundaries():
    """On a mesh the residual stream is constrained to rows over (data, fsdp) after every block."""
    from flax import nnx as _nnx

    from jaxrl.models.decoder import Decoder as _Decoder
    from jaxrl.workers.placement import activation_sharding
    from sharding.mesh import make_mesh
    from sharding.rules import DEFAULT_RULES

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sh = activation_sharding(mesh, DEFAULT_RULES)
    assert sh.spec[0] == ("data", "fsdp")
    graphdef, params = _nnx.split(_Decoder(CFG, rngs=_nnx.Rngs(0)))
    ids = jnp.ones((4, 6), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (4, 6))

    def fwd(p, act=None):
        return _nnx.merge(graphdef, p)(ids, pos, jnp.ones((4, 6)), activation_sharding=act)[0]

    text = jax.jit(lambda p: fwd(p, sh)).lower(params).as_text()
    assert text.count("sdy.sharding_constraint") == CFG.num_hidden_layers + 1  # after the embedding, every block
    assert "sdy.sharding_constraint" not in jax.jit(fwd).lower(params).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(lambda p: fwd(p, sh))(params)), np.asarray(fwd(params)), atol=1e-5)
    assert activation_sharding(None, DEFAULT_RULES) is None
