"""Meshes and logical-axis rules on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from sharding import (
    DEFAULT_RULES,
    TENSOR_PARALLEL_RULES,
    batch_sharding,
    logical_to_pspec,
    make_mesh,
    param_shardings,
    rules_from_dict,
    shard_state,
    split_devices,
)


def test_eight_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set --xla_force_host_platform_device_count=8"


# ----------------------------------------------------------------------------------------------- mesh
@pytest.mark.parametrize(
    "kw, shape",
    [
        (dict(), (1, 8, 1)),
        (dict(data=2, tensor=2), (2, 2, 2)),
        (dict(data=-1, fsdp=1, tensor=4), (2, 1, 4)),
        (dict(data=1, fsdp=4, tensor=2), (1, 4, 2)),
        (dict(data=1, fsdp=1, tensor=-1), (1, 1, 8)),
    ],
)
def test_make_mesh_fills_and_names(kw, shape):
    mesh = make_mesh(**kw)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_explicit_devices_keep_order():
    devs = jax.devices()[4:]
    mesh = make_mesh(1, 2, 2, devices=devs)
    assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
    assert mesh.devices.shape == (1, 2, 2)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(data=3, fsdp=1, tensor=1), r"data=3 x fsdp=1 x tensor=1 = 3 .*8 devices"),
        (dict(data=2, fsdp=2, tensor=4), r"= 16 do not match the 8 devices"),
        (dict(data=-1, fsdp=-1, tensor=1), "at most one mesh axis may be -1"),
        (dict(data=3, fsdp=-1, tensor=1), "multiply to 3, which does not divide the 8 devices"),
        (dict(data=0, fsdp=-1), "data=0 is invalid"),
        (dict(data=1.5, fsdp=-1), "data=1.5 is invalid"),
    ],
)
def test_make_mesh_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(**kw)


def test_split_devices_disjoint_and_errors():
    train, rollout = split_devices(5, 3)
    assert [d.id for d in train] == [0, 1, 2, 3, 4] and [d.id for d in rollout] == [5, 6, 7]
    assert not set(train) & set(rollout)
    t, r = split_devices(2, 2, devices=jax.devices()[4:])
    assert [d.id for d in t] == [4, 5] and [d.id for d in r] == [6, 7]
    with pytest.raises(ValueError, match=r"5 \+ 4 = 9 devices, but only 8"):
        split_devices(5, 4)
    with pytest.raises(ValueError, match="n_rollout=0"):
        split_devices(4, 0)


# ----------------------------------------------------------------------------------------------- rules
def test_logical_to_pspec_default_rules():
    mesh = make_mesh(2, 2, 2)
    assert logical_to_pspec(("embed", "heads", "head_dim"), DEFAULT_RULES, mesh) == P("fsdp", "tensor", None)
    assert logical_to_pspec(("vocab", "embed"), DEFAULT_RULES) == P("tensor", "fsdp")
    assert logical_to_pspec(("batch", None), DEFAULT_RULES, mesh) == P(("data", "fsdp"), None)
    assert logical_to_pspec(("mlp", "embed"), TENSOR_PARALLEL_RULES, mesh) == P("tensor", None)
    # An axis already used by an earlier dim is dropped for later ones.
    assert logical_to_pspec(("batch", "embed"), DEFAULT_RULES, mesh) == P(("data", "fsdp"), None)


def test_logical_to_pspec_non_divisible_falls_back():
    mesh = make_mesh(1, 2, 4)
    # kv_heads=2 cannot be split 4 ways -> replicated; heads=8 can.
    assert logical_to_pspec(("embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh, (16, 2, 8)) == P("fsdp", None, None)
    heads = logical_to_pspec(("embed", "heads", "head_dim"), DEFAULT_RULES, mesh, (16, 8, 8))
    assert heads == P("fsdp", "tensor", None)
    # A tuple keeps its longest dividing prefix: batch 6 over (data=2, fsdp=4) -> data only.
    mesh2 = make_mesh(2, 4, 1)
    assert logical_to_pspec(("batch",), DEFAULT_RULES, mesh2, (6,)) == P("data")
    assert logical_to_pspec(("batch",), DEFAULT_RULES, mesh2, (8,)) == P(("data", "fsdp"))
    assert logical_to_pspec(("batch",), DEFAULT_RULES, mesh2, (3,)) == P(None)


def test_logical_to_pspec_errors():
    mesh = make_mesh(1, 8, 1)
    with pytest.raises(ValueError, match="'nope' has no rule; known logical axes"):
        logical_to_pspec(("nope",), DEFAULT_RULES)
    table = rules_from_dict({"embed": "expert"})
    with pytest.raises(ValueError, match=r"\['expert'\] that the mesh"):
        logical_to_pspec(("embed",), table, mesh)
    with pytest.raises(ValueError, match="has 1 dims but names"):
        logical_to_pspec(("embed", "mlp"), DEFAULT_RULES, mesh, (4,))


def test_rules_from_dict_overrides_and_validates():
    table = dict(rules_from_dict({"embed": None, "mlp": ["fsdp", "tensor"], "experts": "data"}))
    assert table["embed"] is None and table["mlp"] == ("fsdp", "tensor") and table["experts"] == "data"
    assert table["vocab"] == "tensor"  # inherited from DEFAULT_RULES
    assert dict(rules_from_dict({"embed": "fsdp"}, base=None)) == {"embed": "fsdp"}
    with pytest.raises(ValueError, match="rule for logical axis 'embed' maps to 3"):
        rules_from_dict({"embed": 3})


# ----------------------------------------------------------------------------------------------- shardings
def _tiny(kv_heads=2):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=4)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return graphdef, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), state)


def test_param_shardings_on_decoder():
    _, state = _tiny(kv_heads=2)
    mesh = make_mesh(1, 2, 4)
    sh = param_shardings(state, mesh, DEFAULT_RULES)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sh)}
    assert flat["embed_tokens"].spec == P("tensor", "fsdp")
    assert flat["layers.0.self_attn.q_proj"].spec == P("fsdp", "tensor", None)
    assert flat["layers.0.self_attn.k_proj"].spec == P("fsdp", None, None)  # 2 kv heads, tensor=4
    assert flat["layers.0.self_attn.o_proj"].spec == P("tensor", None, "fsdp")
    assert flat["layers.0.mlp.down_proj"].spec == P("tensor", "fsdp")
    assert flat["norm.scale"].spec == P("fsdp")
    assert flat["lm_head"].spec == P("fsdp", "tensor")
    placed = shard_state(state, sh)
    q = placed["layers"][0]["self_attn"]["q_proj"].get_value()
    assert q.sharding == flat["layers.0.self_attn.q_proj"]
    assert q.addressable_shards[0].data.shape == (8, 1, 4)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(state["layers"][0]["self_attn"]["q_proj"].get_value()))


def test_param_shardings_on_optimizer_state():
    _, state = _tiny()
    mesh = make_mesh(2, 2, 2)
    opt = optax.adamw(1e-3).init(state)
    sh = param_shardings(opt, mesh, DEFAULT_RULES)
    leaves = jax.tree.leaves(sh, is_leaf=lambda x: isinstance(x, NamedSharding))
    specs = {s.spec for s in leaves}
    assert P() in specs  # the step count is replicated
    assert P("fsdp", "tensor", None) in specs  # moments of q_proj follow the parameter
    placed = shard_state(opt, sh)
    assert placed[0].count.sharding.spec == P()


def test_shard_state_structure_mismatch():
    _, state = _tiny()
    with pytest.raises(ValueError, match="different tree structures"):
        shard_state(state, {"embed_tokens": NamedSharding(make_mesh(), P())})


def test_batch_sharding():
    mesh = make_mesh(2, 2, 2)
    s = batch_sharding(mesh, 2)
    assert s.spec == P(("data", "fsdp"), None)
    x = jax.device_put(jnp.zeros((8, 5)), s)
    assert {sh.data.shape for sh in x.addressable_shards} == {(2, 5)}
    with pytest.raises(ValueError, match="ndim=0"):
        batch_sharding(mesh, 0)


def test_sharding_package_does_not_import_jaxrl():
    import subprocess
    import sys

    code = "import sys, sharding, sharding.translator; print(sorted(m for m in sys.modules if m.startswith('jaxrl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
