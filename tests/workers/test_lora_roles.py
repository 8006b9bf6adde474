"""LoRA in the trained roles: only the adapters get gradients, optimizer state and checkpoint arrays; the base stays
bit-for-bit frozen; the reference is the base with the adapters off (the actor's own arrays, no copy); the merged
weights are what the policy computes; the critic trains adapters + value head; on a mesh the same update and the
rule shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.build import _build_actor_and_reference
from jaxrl.models.decoder import Decoder
from jaxrl.models.lora import LoraSpec, apply_lora, merge_lora
from jaxrl.models.value_model import ValueModel
from jaxrl.workers.actor import ActorWorker, LogProbComputer
from jaxrl.workers.critic import CriticWorker
from sharding import DEFAULT_RULES, make_mesh
from tests.helpers import (
    actor_setup,
    critic_setup,
    tiny_actor_config,
    tiny_batch,
    tiny_model_config,
    tiny_optim,
    tiny_run_config,
)

CFG = tiny_model_config("qwen2")
P, R, N = 6, 5, 8
SPEC = LoraSpec(rank=4, alpha=8.0)


def peaked(state, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray((1.0 if x.ndim == 1 else 0.0) + 0.3 * rng.normal(size=x.shape),
                                              x.dtype), state)


def host(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def make_batch(seed=0):
    batch, rng = tiny_batch(N, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size)
    batch.advantages = (rng.normal(size=(N, R)) * batch.response_mask).astype(np.float32)
    return batch


@pytest.fixture()
def base():
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
    return graphdef, peaked(state, 1)


def lora_actor(graphdef, base_state, *, mesh=None, shards=1, **overrides):
    model = nnx.merge(graphdef, base_state)
    adapters, info = apply_lora(model, SPEC, seed=2)
    cfg, plan = actor_setup(rows=N, log_prob_micro=N // shards, ppo_mini_batch_size=N,
                            ppo_micro_batch_size_per_gpu=4 // shards, batch_shards=shards, **overrides)
    return ActorWorker(nnx.graphdef(model), adapters, cfg, plan=plan, temperature=1.0, total_training_steps=2,
                       frozen=base_state, lora=info, mesh=mesh, rules=DEFAULT_RULES if mesh is not None else None)


def flat(tree):
    """``{dotted path: leaf}`` of a pytree of arrays (a Variable's ``value`` attribute left out of the path)."""
    def part(k):
        return str(k.key) if hasattr(k, "key") else str(getattr(k, "name", getattr(k, "idx", k)))

    return {".".join(part(k) for k in p if part(k) != "value"): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_only_adapters_train_and_the_base_stays_exact(base):
    graphdef, base_state = base
    actor = lora_actor(graphdef, base_state, use_kl_loss=False)
    actor.init_optimizer()
    batch = make_batch()
    base_lp, _ = LogProbComputer(graphdef, micro_batch_size=N, temperature=1.0)(base_state, batch)
    lp0, _ = actor.compute_log_probs(batch)
    np.testing.assert_array_equal(lp0, base_lp)  # B = 0: step 0 is the base model, exactly
    batch.old_log_probs = lp0

    # gradients: one per adapter and nothing else; at B = 0 only B gets a nonzero one
    stacked, nt, ns = actor.stack_micro(actor.minibatch_arrays(batch), np.arange(N), N, 4)
    grads, _ = jax.jit(actor.accumulate_grads, static_argnames="prompt_width")(
        actor.params, stacked, nt, ns, None, actor.frozen, prompt_width=P)
    assert jax.tree.structure(grads) == jax.tree.structure(actor.params)
    g = flat(grads)
    assert all(("lora_a" in k or "lora_b" in k) for k in g) and len(g) == 2 * 14
    assert all(np.abs(np.asarray(v)).max() > 0 for k, v in g.items() if k.endswith("lora_b"))
    assert all(not np.any(np.asarray(v)) for k, v in g.items() if k.endswith("lora_a"))
    # ... while the same loss differentiated w.r.t. the whole model would move the base: frozen is a choice
    full, _ = jax.jit(actor.accumulate_grads, static_argnames="prompt_width")(
        actor.model_state(), stacked, nt, ns, prompt_width=P)
    assert np.abs(np.asarray(flat(full)["layers.0.self_attn.q_proj"])).max() > 1e-4

    # optimizer state: AdamW moments shaped like the adapters only
    adam = actor.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(actor.params)
    frozen_before, adapters_before = host(actor.frozen), host(actor.params)
    actor.update(batch)
    for k, v in flat(actor.frozen).items():
        np.testing.assert_array_equal(np.asarray(v), flat(frozen_before)[k], err_msg=k)
    after = flat(actor.params)
    before = flat(adapters_before)
    assert all(np.abs(np.asarray(after[k]) - before[k]).max() > 1e-4 for k in after if k.endswith("lora_b"))
    # A had a zero gradient and there is no weight decay: Adam leaves it exactly in place this once
    assert all(np.array_equal(np.asarray(after[k]), before[k]) for k in after if k.endswith("lora_a"))
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    actor.update(batch)
    assert any(not np.array_equal(np.asarray(v), before[k]) for k, v in flat(actor.params).items()
               if k.endswith("lora_a"))

    # the checkpoint holds adapters and their optimizer state only
    arrays, meta = actor.state()
    assert jax.tree.structure(arrays["params"]) == jax.tree.structure(adapters_before)
    assert meta["num_updates"] == 2
    # the merged weights (rollout / export) compute what the adapted policy computes
    merged = actor.merged_params()
    assert jax.tree.structure(merged) == jax.tree.structure(base_state)
    lp_merged, _ = LogProbComputer(graphdef, micro_batch_size=N, temperature=1.0)(merged, batch)
    lp_actor, _ = actor.compute_log_probs(batch)
    assert np.abs(lp_actor - lp0).max() > 1e-3
    np.testing.assert_allclose(lp_merged, lp_actor, rtol=0, atol=2e-5)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(merge_lora(actor.params, actor.frozen, SPEC.scale))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_reference_is_the_base_with_adapters_off_and_no_copy(base):
    graphdef, base_state = base
    cfg = tiny_run_config(rows=N, log_prob_micro=N, actor=tiny_actor_config(ppo_mini_batch_size=N,
                                                                               ppo_micro_batch_size_per_gpu=4))
    cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha = 4, 8.0
    cfg.actor_rollout_ref.model.target_modules = ["q_proj", "v_proj", "gate_proj"]
    actor, ref = _build_actor_and_reference(cfg, graphdef, base_state, 2)
    assert ref.params is actor.frozen is base_state  # one copy of the base weights
    assert len(actor.lora.targets) == 6 and actor.graphdef != graphdef and actor.base_graphdef == graphdef
    batch = make_batch(seed=3)
    ref_before, _ = ref.compute_log_probs(batch)
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    batch.ref_log_probs = ref_before
    np.testing.assert_array_equal(batch.old_log_probs, ref_before)
    metrics = actor.update(batch)
    assert metrics["actor/kl_loss"] == 0.0  # the policy is the reference until the first update
    lp, _ = actor.compute_log_probs(batch)
    ref_after, _ = ref.compute_log_probs(batch)
    assert np.abs(lp - ref_before).max() > 1e-4
    np.testing.assert_array_equal(ref_after, ref_before)


def test_exact_kl_against_the_base_inside_the_loss(base):
    graphdef, base_state = base
    actor = lora_actor(graphdef, base_state, kl_loss_type="full")
    assert actor.ref_params is actor.frozen
    batch = make_batch(seed=4)
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    batch.ref_log_probs = batch.old_log_probs
    first = actor.update(batch)
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    second = actor.update(batch)
    # the first update's policy is the base (B = 0; inside the gradient program XLA may fuse the +0 differently, so
    # float32 noise, not exactly 0); after one update the policy has moved away from the reference
    assert abs(first["actor/kl_loss"]) < 1e-6 and second["actor/kl_loss"] > 100 * abs(first["actor/kl_loss"])


def test_lora_critic_trains_adapters_and_the_value_head():
    model = ValueModel(CFG, rngs=nnx.Rngs(1))
    apply_lora(model.backbone, LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"]))
    head = nnx.Any(nnx.PathContains("value_head"), nnx.PathContains("value_bias"))
    graphdef, params, frozen = nnx.split(model, nnx.Any(nnx.LoRAParam, head), ...)
    assert set(flat(params)) == {"value_bias", "value_head"} | {
        f"backbone.layers.{i}.{s}.lora.{n}.lora_{ab}" for i in (0, 1)
        for s, n in (("self_attn", "q_proj"), ("mlp", "down_proj")) for ab in "ab"}
    cfg, plan = critic_setup(rows=N, ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=4)
    critic = CriticWorker(graphdef, params, cfg, plan=plan, total_training_steps=1, frozen=frozen)
    batch = make_batch(seed=5)
    batch.values = critic.compute_values(batch)
    batch.returns = (batch.values + 1.0) * batch.response_mask
    frozen_before, params_before = host(critic.frozen), flat(host(critic.params))
    critic.update(batch)
    for k, v in flat(critic.frozen).items():
        np.testing.assert_array_equal(np.asarray(v), flat(frozen_before)[k], err_msg=k)
    after = flat(critic.params)
    assert np.abs(np.asarray(after["value_head"]) - params_before["value_head"]).max() > 1e-4
    assert np.abs(np.asarray(after["backbone.layers.0.self_attn.lora.q_proj.lora_b"])).max() > 0
    assert jax.tree.structure(critic.state()[0]["params"]) == jax.tree.structure(params)


def test_lora_actor_on_a_mesh_equals_one_device_and_keeps_the_rule_shardings(base):
    graphdef, base_state = base
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    batch = make_batch(seed=6)
    # Adam divides each gradient by its own magnitude: eps=1e-3 keeps the layouts' fp32 summation noise below the
    # tolerance (as tests/workers/test_sharded_training.py)
    optim = tiny_optim(lr=1e-2, eps=1e-3)
    single = lora_actor(graphdef, base_state, use_kl_loss=False, optim=optim)
    sharded = lora_actor(graphdef, base_state, use_kl_loss=False, optim=optim, mesh=mesh, shards=4)
    lp1, _ = single.compute_log_probs(batch)
    lp8, _ = sharded.compute_log_probs(batch)
    np.testing.assert_allclose(lp8, lp1, rtol=1e-5, atol=1e-6)
    batch.old_log_probs = lp1
    m1, m8 = single.update(batch), sharded.update(batch)
    for k in ("actor/pg_loss", "actor/grad_norm"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for x, y in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    q = sharded.frozen["layers"][0]["self_attn"]["q_proj"].get_value()  # the base as today: (embed, heads, head_dim)
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)
    lora_q = sharded.params["layers"][0]["self_attn"]["lora"]["q_proj"]
    assert lora_q["lora_a"].get_value().sharding.spec == PartitionSpec("fsdp", None)  # (embed, rank)
    assert lora_q["lora_b"].get_value().sharding.spec == PartitionSpec(None, "tensor")  # (rank, heads)
    merged = sharded.merged_params()
    assert merged["layers"][0]["self_attn"]["q_proj"].get_value().sharding == q.sharding
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(single.merged_params())):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
