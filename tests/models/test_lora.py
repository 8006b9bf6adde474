"""LoRA adapters on the decoder (jaxrl.models.lora): B = 0 leaves the model exactly the base model, the adapted and
the merged model equal base + (alpha / r) B A computed independently on the Hugging Face tensors, PEFT's target
matching, the PEFT tensor layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.decoder import Decoder
from jaxrl.models.hf import from_hf_tensors, to_hf_tensors
from jaxrl.models.lora import (
    LoraSpec,
    apply_lora,
    lora_module_names,
    merge_lora,
    peft_adapter_config,
    peft_adapter_tensors,
    resolve_targets,
)
from tests.helpers import tiny_model_config

IDS = np.array([[5, 9, 17, 3, 60, 8, 12], [4, 8, 15, 16, 23, 42, 7]], np.int32)
MASK = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], np.int32)
POS = np.maximum(np.cumsum(MASK, 1) - 1, 0).astype(np.int32)


def logits(graphdef, state) -> np.ndarray:
    out, _ = nnx.merge(graphdef, state)(jnp.asarray(IDS), jnp.asarray(POS), jnp.asarray(MASK))
    return np.asarray(out)


def peaked(state, seed):
    """Random weights ~N(0, 0.3) (norms ~1): logits far from a constant, so differences show."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray((1.0 if x.ndim == 1 else 0.0) + 0.3 * rng.normal(size=x.shape),
                                              x.dtype), state)


def lora_model(model_type="qwen2", spec=LoraSpec(rank=4, alpha=8.0), seed=0):
    """``(base graphdef, base state, lora graphdef, adapters, info)`` of a tiny decoder with random base weights."""
    cfg = tiny_model_config(model_type)
    graphdef, base = nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))
    base = peaked(base, seed)
    model = nnx.merge(graphdef, base)
    adapters, info = apply_lora(model, spec, seed=seed)
    return graphdef, base, nnx.graphdef(model), adapters, info


def random_b(adapters, seed=1):
    """The adapters with B drawn ~N(0, 0.2) (a trained adapter), A as initialised."""
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(value=jnp.asarray(0.2 * rng.normal(size=v.shape), v.dtype)) if p[-1] == "lora_b" else v)
            for p, v in nnx.to_flat_state(adapters)]
    return nnx.from_flat_state(flat)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fresh_adapters_leave_the_base_model_exactly(model_type):
    graphdef, base, lgraph, adapters, info = lora_model(model_type)
    assert len(info.targets) == 7 * 2  # every projection of both layers
    b_leaves = [v.get_value() for p, v in nnx.to_flat_state(adapters) if p[-1] == "lora_b"]
    a_leaves = [v.get_value() for p, v in nnx.to_flat_state(adapters) if p[-1] == "lora_a"]
    assert all(not np.any(np.asarray(b)) for b in b_leaves) and all(np.any(np.asarray(a)) for a in a_leaves)
    np.testing.assert_array_equal(logits(lgraph, nnx.merge_state(adapters, base)), logits(graphdef, base))
    # the merged weights of fresh adapters are the base weights, bit for bit
    merged = merge_lora(adapters, base, info.spec.scale)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_adapted_and_merged_models_equal_base_plus_scaled_ba(model_type):
    """Independent reference: in the Hugging Face tensors (torch layout ``[out, in]``) add PEFT's
    ``(alpha / r) * lora_B @ lora_A`` in float64 and load that checkpoint as a plain decoder."""
    spec = LoraSpec(rank=3, alpha=12.0, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    graphdef, base, lgraph, adapters, info = lora_model(model_type, spec)
    adapters = random_b(adapters)
    cfg = tiny_model_config(model_type)
    hf = {k: v.astype(np.float64) for k, v in to_hf_tensors(nnx.merge(graphdef, base)).items()}
    ab = {}
    for p, v in nnx.to_flat_state(adapters):
        ab.setdefault(tuple(str(getattr(k, "key", k)) for k in p[:-1]), {})[p[-1]] = np.asarray(v.get_value(),
                                                                                                 np.float64)
    assert len(ab) == 4 * 2
    for (layers, i, sub, _, name), m in ab.items():
        lora_a, lora_b = m["lora_a"].T, m["lora_b"].T  # PEFT's lora_A.weight [r, in], lora_B.weight [out, r]
        hf[f"model.{layers}.{i}.{sub}.{name}.weight"] += (spec.alpha / spec.rank) * lora_b @ lora_a
    expected = logits(*nnx.split(from_hf_tensors(cfg, {k: v.astype(np.float32) for k, v in hf.items()})))
    adapted = logits(lgraph, nnx.merge_state(adapters, base))
    merged = logits(graphdef, jax.jit(lambda a, b: merge_lora(a, b, spec.scale))(adapters, base))
    assert np.abs(expected - logits(graphdef, base)).max() > 0.1  # the adapters change the model
    np.testing.assert_allclose(adapted, expected, rtol=0, atol=2e-5)
    np.testing.assert_allclose(merged, expected, rtol=0, atol=2e-5)


def test_targets_follow_peft_matching():
    names = lora_module_names(2)
    assert names[:2] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    assert resolve_targets(LoraSpec(8, 16), 2) == tuple(names)
    assert resolve_targets(LoraSpec(8, 16, ["q_proj", "v_proj"]), 2) == (
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj")
    # a list entry matches a whole name or a "."-suffix; a string is a whole-name regex
    assert resolve_targets(LoraSpec(8, 16, ["layers.1.mlp.down_proj"]), 2) == ("model.layers.1.mlp.down_proj",)
    with pytest.raises(ValueError, match="selects no module"):
        resolve_targets(LoraSpec(8, 16, ["proj"]), 2)  # "proj" is no whole name nor a "."-suffix
    assert resolve_targets(LoraSpec(8, 16, r".*\.0\.self_attn\.[qv]_proj"), 2) == (
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj")
    with pytest.raises(ValueError, match="selects no module"):
        resolve_targets(LoraSpec(8, 16, "q_proj"), 2)  # a regex must match the whole name
    # exclude_modules removes names (a list or a regex, the same matching)
    mlp = resolve_targets(LoraSpec(8, 16, "all-linear", exclude_modules=r".*self_attn.*"), 2)
    assert mlp == tuple(n for n in names if ".mlp." in n)
    assert "model.layers.0.mlp.up_proj" not in resolve_targets(LoraSpec(8, 16, exclude_modules=["0.mlp.up_proj"]), 2)
    with pytest.raises(ValueError, match=r"target_modules='\.\*' selects model.embed_tokens, lm_head.*not supported"):
        resolve_targets(LoraSpec(8, 16, ".*"), 2)
    with pytest.raises(ValueError, match="critic.model.target_modules"):
        resolve_targets(LoraSpec(8, 16, ["o_proj"], exclude_modules=["o_proj"]), 2, key="critic.model")


def test_adapter_state_is_only_lora_params_and_the_base_graph_is_unchanged():
    graphdef, base, lgraph, adapters, info = lora_model("llama", LoraSpec(2, 4.0, ["k_proj", "gate_proj"]))
    paths = {".".join(str(getattr(k, "key", k)) for k in p) for p, _ in nnx.to_flat_state(adapters)}
    assert paths == {f"layers.{i}.{s}.lora.{n}.lora_{ab}" for i in (0, 1) for s, n in
                     (("self_attn", "k_proj"), ("mlp", "gate_proj")) for ab in "ab"}
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(adapters))
    shapes = jax.tree.map(lambda x: x.shape, adapters)
    assert shapes["layers"][0]["self_attn"]["lora"]["k_proj"]["lora_a"] == (32, 2)  # [H, r]
    assert shapes["layers"][0]["self_attn"]["lora"]["k_proj"]["lora_b"] == (2, 16)  # [r, nKV*D]
    assert shapes["layers"][1]["mlp"]["lora"]["gate_proj"]["lora_b"] == (2, 64)  # [r, I]
    assert info.base_graphdef == graphdef  # the reference / merged weights' graph is the model without adapters
    with pytest.raises(ValueError, match="lora_rank=0 must be > 0"):
        apply_lora(Decoder(tiny_model_config(), rngs=nnx.Rngs(0)), LoraSpec(0, 16))


def test_peft_tensor_names_layouts_and_config():
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj", "down_proj"])
    _, _, _, adapters, info = lora_model("llama", spec)
    adapters = random_b(adapters)
    tensors = peft_adapter_tensors(adapters, info.targets)
    assert len(tensors) == 2 * 3 * 2
    a = adapters["layers"][1]["self_attn"]["lora"]["o_proj"]
    np.testing.assert_array_equal(tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"],
                                  np.asarray(a["lora_a"].get_value()).T)  # [r, in = nH*D]
    np.testing.assert_array_equal(tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"],
                                  np.asarray(a["lora_b"].get_value()).T)  # [out = H, r]
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 64)
    config = peft_adapter_config(spec, info.targets, num_layers=2, base_model_name_or_path="m")
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", 4, 8.0,
                                                                                           "CAUSAL_LM")
    assert config["target_modules"] == ["q_proj", "o_proj", "down_proj"]
    # per-layer differences keep the full names (PEFT matches both)
    one = resolve_targets(LoraSpec(4, 8, r".*layers\.0\.self_attn\.q_proj"), 2)
    assert peft_adapter_config(spec, one, num_layers=2, base_model_name_or_path=None)["target_modules"] == list(one)


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_adapters_on_some_layers_train_through_per_block_remat_with_either_granularity(remat):
    """Blocks that differ (an adapter on layer 0 only) cannot be one layer scan: each block is rematerialised on its
    own (``nnx.remat`` with the granularity's policy). The gradient equals the one without rematerialisation, and
    ``selective`` recomputes no kept projection (fewer matmuls in the backward than ``full``)."""
    cfg = tiny_model_config()
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=r".*\.0\.self_attn\.[qv]_proj")

    def adapted(r):
        model = Decoder(cfg, rngs=nnx.Rngs(0), remat=r)
        graphdef, base = nnx.split(model)
        model = nnx.merge(graphdef, peaked(base, 0))
        apply_lora(model, spec, seed=0)
        return nnx.split(model)

    def grad_and_jaxpr(r):
        graphdef, state = adapted(r)

        def loss(st):
            out, _ = nnx.merge(graphdef, st)(jnp.asarray(IDS), jnp.asarray(POS), jnp.asarray(MASK))
            return jnp.mean(jax.nn.logsumexp(out, axis=-1))

        return jax.grad(loss)(state), str(jax.make_jaxpr(jax.grad(loss))(state))

    plain, _ = grad_and_jaxpr(False)
    rematted, jaxpr = grad_and_jaxpr(remat)
    assert "remat" in jaxpr and "scan" not in jaxpr  # the per-block path, not the layer scan
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    if remat == "selective":
        full_jaxpr = grad_and_jaxpr("full")[1]
        assert jaxpr.count("dot_general") < full_jaxpr.count("dot_general")
