"""The weight translator and its operations, on 8 simulated CPU devices.

References are independent of the code under test: vLLM's per-rank layout is rebuilt here by slicing the
unfused Hugging Face tensors that ``jaxrl.models.hf.to_hf_tensors`` exports, following the rule in vLLM's
``QKVParallelLinear.weight_loader`` (rank r: q heads r*nH/tp.., kv head block r // replicas).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf import to_hf_tensors
from sharding import (
    DEFAULT_RULES,
    TENSOR_PARALLEL_RULES,
    ModelInfo,
    TargetSpec,
    Translator,
    build_plan,
    make_mesh,
    param_shardings,
    rank_shards,
    shard_state,
    split_devices,
    validate_plan,
)
from sharding import ops
from sharding.translator import Plan

RNG = np.random.default_rng(0)


def test_eight_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set --xla_force_host_platform_device_count=8"


# ----------------------------------------------------------------------------------------------- ops
def test_transpose_reshape_split():
    x = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(ops.transpose(x, (2, 0, 1))[3, 1, 2], x[1, 2, 3])
    np.testing.assert_array_equal(ops.reshape(x, (6, -1)), x.reshape(6, 4))
    with pytest.raises(ValueError, match="not a permutation"):
        ops.transpose(x, (0, 0, 1))
    with pytest.raises(ValueError, match="cannot reshape"):
        ops.reshape(x, (5, 5))
    a, b = ops.split(x, (1, 3), axis=2)
    np.testing.assert_array_equal(a, x[:, :, :1])
    np.testing.assert_array_equal(b, x[:, :, 1:])
    with pytest.raises(ValueError, match="do not add up"):
        ops.split(x, (1, 2), axis=2)


def test_stack_unstack_layers():
    layers = [RNG.normal(size=(3, 5)) for _ in range(4)]
    s = ops.stack_layers(layers, axis=1)
    assert s.shape == (3, 4, 5)
    for i in range(4):
        np.testing.assert_array_equal(s[:, i], layers[i])
    for a, b in zip(ops.unstack_layers(s, axis=1), layers):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="one shape"):
        ops.stack_layers([np.zeros(2), np.zeros(3)])


def test_pad_axis_and_head_dim():
    x = np.ones((3, 2, 4), np.float32)
    y = ops.pad_head_dim(x, 6)
    assert y.shape == (3, 2, 6)
    np.testing.assert_array_equal(y[..., :4], x)
    np.testing.assert_array_equal(y[..., 4:], 0)
    z = ops.pad_axis(x, 5, axis=0, fill=-1)
    assert z.shape == (5, 2, 4) and (z[3:] == -1).all()
    with pytest.raises(ValueError, match="new_size 2 < current size 3"):
        ops.pad_axis(x, 2, axis=0)


def test_cast_and_scale():
    x = np.array([1.0, 1.0 + 2**-10], np.float32)
    y = ops.cast(jnp.asarray(x), jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and float(y[1]) == 1.0  # bf16 keeps 7 mantissa bits
    s = ops.scale(x, 0.5)
    assert s.dtype == np.float32
    np.testing.assert_array_equal(s, x * 0.5)


def test_rope_permutations():
    d = 8
    x = np.arange(2 * d).reshape(2, d)
    y = ops.rope_halves_to_interleaved(x)
    for i in range(d // 2):  # pair (i, i + D/2) of rotate-half lands on (2i, 2i+1)
        np.testing.assert_array_equal(y[:, 2 * i], x[:, i])
        np.testing.assert_array_equal(y[:, 2 * i + 1], x[:, i + d // 2])
    # MaxText's to-HF direction is concat(evens, odds): our inverse.
    np.testing.assert_array_equal(ops.rope_interleaved_to_halves(y), np.concatenate([y[:, ::2], y[:, 1::2]], -1))
    np.testing.assert_array_equal(ops.rope_interleaved_to_halves(y), x)
    with pytest.raises(ValueError, match="even"):
        ops.rope_halves_to_interleaved(np.zeros((2, 3)))


def test_repeat_kv_heads_order():
    x = np.array([[10, 11], [20, 21]])  # [kv_heads=2, D=2]
    np.testing.assert_array_equal(ops.repeat_kv_heads(x, 3, axis=0), [[10, 11]] * 3 + [[20, 21]] * 3)
    assert ops.repeat_kv_heads(x, 1) is x
    with pytest.raises(ValueError, match="n_rep=0"):
        ops.repeat_kv_heads(x, 0)


def test_kv_layout():
    assert ops.kv_layout(8, 2, 1) == (8, 2, 1)
    assert ops.kv_layout(8, 2, 2) == (4, 1, 1)
    assert ops.kv_layout(8, 2, 4) == (2, 1, 2)
    assert ops.kv_layout(8, 2, 8) == (1, 1, 4)
    with pytest.raises(ValueError, match="must divide num_heads=9"):
        ops.kv_layout(9, 3, 2)
    with pytest.raises(ValueError, match="multiple of it"):
        ops.kv_layout(12, 4, 6)


def _vllm_qkv_rank(q, k, v, nh, nkv, d, tp, r):
    """Rank r's rows, written from vLLM's weight_loader rule (no use of sharding.ops)."""
    q_per = nh // tp
    if tp >= nkv:
        kv_per, kv_rank = 1, r // (tp // nkv)
    else:
        kv_per, kv_rank = nkv // tp, r
    qs = q[r * q_per * d : (r + 1) * q_per * d]
    ks = k[kv_rank * kv_per * d : (kv_rank + 1) * kv_per * d]
    vs = v[kv_rank * kv_per * d : (kv_rank + 1) * kv_per * d]
    return np.concatenate([qs, ks, vs], axis=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("nkv", [2, 4])
def test_fuse_qkv_per_rank_matches_vllm_slicing(tp, nkv):
    nh, d, e = 8, 3, 5
    q, k, v = (RNG.normal(size=(n * d, e)) for n in (nh, nkv, nkv))
    fused = ops.fuse_qkv_per_rank(q, k, v, num_heads=nh, num_kv_heads=nkv, tp=tp)
    blocks = np.split(fused, tp, axis=0)
    for r in range(tp):
        np.testing.assert_array_equal(blocks[r], _vllm_qkv_rank(q, k, v, nh, nkv, d, tp, r))
    # Bias (1-D) and jnp-under-jit give the same layout.
    qb, kb, vb = q[:, 0], k[:, 0], v[:, 0]
    np.testing.assert_array_equal(ops.fuse_qkv_per_rank(qb, kb, vb, num_heads=nh, num_kv_heads=nkv, tp=tp),
                                  fused[:, 0])
    jitted = jax.jit(lambda a, b, c: ops.fuse_qkv_per_rank(a, b, c, num_heads=nh, num_kv_heads=nkv, tp=tp))
    np.testing.assert_allclose(np.asarray(jitted(q, k, v)), fused.astype(np.float32), rtol=1e-6)
    q2, k2, v2 = ops.unfuse_qkv_per_rank(fused, num_heads=nh, num_kv_heads=nkv, tp=tp)
    for a, b in ((q2, q), (k2, k), (v2, v)):
        np.testing.assert_array_equal(a, b)


def test_fuse_qkv_repeats_kv_when_tp_exceeds_kv_heads():
    nh, nkv, d, e, tp = 8, 2, 2, 3, 8
    q, k, v = (RNG.normal(size=(n * d, e)) for n in (nh, nkv, nkv))
    fused = ops.fuse_qkv_per_rank(q, k, v, num_heads=nh, num_kv_heads=nkv, tp=tp)
    assert fused.shape == (tp * (1 + 2) * d, e)  # one q head + one (replicated) kv head per rank
    blocks = np.split(fused, tp)
    for r in range(tp):
        kv = r // 4  # 4 ranks share each kv head
        np.testing.assert_array_equal(blocks[r][d : 2 * d], k[kv * d : (kv + 1) * d])
        np.testing.assert_array_equal(blocks[r][2 * d :], v[kv * d : (kv + 1) * d])
    with pytest.raises(ValueError, match="k has shape"):
        ops.fuse_qkv_per_rank(q, k[:-1], v, num_heads=nh, num_kv_heads=nkv, tp=tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fuse_gate_up_per_rank(tp):
    i, e = 8, 3
    gate, up = RNG.normal(size=(i, e)), RNG.normal(size=(i, e))
    fused = ops.fuse_gate_up_per_rank(gate, up, tp)
    w = i // tp
    for r, blk in enumerate(np.split(fused, tp)):
        np.testing.assert_array_equal(blk, np.concatenate([gate[r * w : (r + 1) * w], up[r * w : (r + 1) * w]]))
    g2, u2 = ops.unfuse_gate_up_per_rank(fused, tp)
    np.testing.assert_array_equal(g2, gate)
    np.testing.assert_array_equal(u2, up)
    with pytest.raises(ValueError, match="dividing the intermediate size 8"):
        ops.fuse_gate_up_per_rank(gate, up, 3)


# ----------------------------------------------------------------------------------------------- model fixtures
def _cfg(model_type: str) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=4)
    if model_type == "llama":
        return ModelConfig(model_type="llama", tie_word_embeddings=False, **base)
    if model_type == "qwen2":
        return ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=True, **base)
    return ModelConfig(model_type="qwen3", qk_norm=True, tie_word_embeddings=True, **base)


def _model(model_type: str, train_mesh):
    """A decoder with every parameter random (biases and norms too), its HF export and its train-sharded state."""
    cfg = _cfg(model_type)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(1)))  # abstract: no eager init
    rng = np.random.default_rng(7)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), nnx.state(model))
    nnx.update(model, state)
    hf = to_hf_tensors(model)
    sharded = shard_state(state, param_shardings(state, train_mesh, DEFAULT_RULES))
    return cfg, hf, sharded


@pytest.fixture(scope="module")
def train_mesh():
    return make_mesh(1, 4, 2)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, train_mesh):
    return _model(request.param, train_mesh)


def _flat(state) -> dict[str, jax.Array]:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _shard_bytes(arrays) -> int:
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards)


# ----------------------------------------------------------------------------------------------- hf target
@pytest.mark.parametrize("devices", [[0], [7], [6, 7]])
def test_sync_hf_target_equals_hf_export(model, devices):
    """From the sharded train layout to whole HF-named tensors on the engine's device(s): names, shapes, dtypes
    and values equal ``to_hf_tensors``' export (the checkpoint format vLLM's weight loaders read)."""
    cfg, hf, state = model
    devs = [jax.devices()[i] for i in devices]
    plan = build_plan(state, TargetSpec("hf", devices=devs), ModelInfo.from_config(cfg))
    out, report = Translator(plan).sync(state)
    assert sorted(out) == sorted(hf)
    for name, arr in out.items():
        assert arr.shape == hf[name].shape and arr.dtype == hf[name].dtype, name
        np.testing.assert_array_equal(np.asarray(arr), hf[name], err_msg=name)
        assert arr.sharding.is_fully_replicated and {d.id for d in arr.sharding.device_set} == set(devices), name
    # the train layout spreads every tensor over 8 devices, so each target device receives nearly every byte
    total = sum(a.nbytes for a in hf.values()) * len(devices)
    assert 0 < report.bytes_moved <= total and report.num_tensors == len(hf)


# ----------------------------------------------------------------------------------------------- jax target
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_sync_jax_target_values_and_shardings(placement, train_mesh):
    if placement == "colocated":
        _, _, state = _model("llama", train_mesh)
        tmesh = make_mesh(1, 1, 8)
    else:
        train, rollout = split_devices(4, 4)
        _, _, state = _model("llama", make_mesh(1, 2, 2, devices=train))
        tmesh = make_mesh(1, 1, 4, devices=rollout)
    plan = build_plan(state, TargetSpec("jax", mesh=tmesh))
    out, report = Translator(plan).sync(state)
    assert isinstance(out, nnx.State)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state)
    want = _flat(param_shardings(state, tmesh, TENSOR_PARALLEL_RULES))
    got, src = _flat(out), _flat(state)
    assert set(got) == set(src)
    for name, arr in got.items():
        assert arr.sharding == want[name], name
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(src[name]))
    assert got["layers.0.mlp.gate_proj"].sharding.spec == P(None, "tensor")
    # vocab 100 splits 4 ways but not 8: the non-divisible fallback replicates it.
    assert got["embed_tokens"].sharding.spec == (P(None, None) if placement == "colocated" else P("tensor", None))
    assert report.num_tensors == len(src)
    if placement == "split":  # nothing was on the rollout devices before
        assert report.bytes_moved == _shard_bytes(got.values())
        assert all({d.id for d in a.sharding.device_set} == {4, 5, 6, 7} for a in got.values())
    else:
        assert 0 < report.bytes_moved < _shard_bytes(got.values())


def test_sync_jax_target_bf16_feeds_nothing_back(train_mesh):
    _, _, state = _model("qwen3", train_mesh)
    before = {k: np.asarray(v) for k, v in _flat(state).items()}
    out, _ = Translator(build_plan(state, TargetSpec("jax", mesh=make_mesh(1, 2, 4), dtype=jnp.bfloat16))).sync(state)
    for name, arr in _flat(out).items():
        assert arr.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(arr), before[name].astype(jnp.bfloat16))
    for name, arr in _flat(state).items():  # the source is untouched
        np.testing.assert_array_equal(np.asarray(arr), before[name])


def test_bytes_moved_exact_on_known_layouts():
    mesh = make_mesh(1, 8, 1)
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
    same = build_plan({"w": x}, TargetSpec("jax", mesh=mesh, shardings={"w": x.sharding}))
    out, rep = Translator(same).sync({"w": x})
    assert rep.bytes_moved == 0 and out["w"].sharding == x.sharding
    # Sharded 8 ways -> replicated on the same devices: each device already had 1/8.
    rep_plan = build_plan({"w": x}, TargetSpec("jax", mesh=mesh, shardings={"w": NamedSharding(mesh, P())}))
    _, rep = Translator(rep_plan).sync({"w": x})
    assert rep.bytes_moved == 8 * x.nbytes * 7 // 8
    # Row-sharded -> column-sharded: device i keeps the one element block it shares with its new column.
    col = build_plan({"w": x}, TargetSpec("jax", mesh=mesh, shardings={"w": NamedSharding(mesh, P(None, "fsdp"))}))
    _, rep = Translator(col).sync({"w": x})
    assert rep.bytes_moved == x.nbytes - 8 * 4


def test_piece_transfer_unaligned_and_collective_agree():
    """Pieces cut across shard boundaries (8 row blocks -> 3 row blocks on other devices) land exactly; the
    colocated collective path and the forced pieces path give identical arrays."""
    mesh8 = make_mesh(1, 8, 1)
    x = jax.device_put(jnp.arange(24 * 5, dtype=jnp.float32).reshape(24, 5), NamedSharding(mesh8, P("fsdp", None)))
    tmesh = jax.sharding.Mesh(np.array(jax.devices()[5:]), ("tensor",))
    target = NamedSharding(tmesh, P("tensor", None))
    out, rep = Translator(build_plan({"w": x}, TargetSpec("jax", mesh=tmesh, shardings={"w": target}))).sync({"w": x})
    assert out["w"].sharding == target
    assert [s.data.shape for s in out["w"].addressable_shards] == [(8, 5)] * 3
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(x))
    # Device 5 held rows 15..17, 6 held 18..20, 7 held 21..23; each needs 8 rows of its new block.
    held = {5: range(15, 18), 6: range(18, 21), 7: range(21, 24)}
    need = {5: range(0, 8), 6: range(8, 16), 7: range(16, 24)}
    assert rep.bytes_moved == sum(len(set(need[d]) - set(held[d])) for d in held) * 5 * 4

    t8 = NamedSharding(make_mesh(1, 1, 8), P(None, None))
    spec = TargetSpec("jax", mesh=t8.mesh, shardings={"w": t8})
    a, _ = Translator(build_plan({"w": x}, spec), transfer="collective").sync({"w": x})
    b, _ = Translator(build_plan({"w": x}, spec), transfer="pieces").sync({"w": x})
    assert a["w"].sharding == b["w"].sharding == t8
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
    with pytest.raises(ValueError, match="transfer='collective' needs the target mesh"):
        Translator(build_plan({"w": x}, TargetSpec("jax", mesh=tmesh, shardings={"w": target})),
                   transfer="collective").sync({"w": x})
    with pytest.raises(ValueError, match="valid: \\['auto', 'collective', 'pieces'\\]"):
        Translator(build_plan({"w": x}, spec), transfer="nccl")


# ----------------------------------------------------------------------------------------------- vllm target
def _vllm_reference(cfg: ModelConfig, hf: dict[str, np.ndarray], tp: int, vp: int) -> dict[str, list[np.ndarray]]:
    """name -> per-rank numpy shards, sliced from the unfused HF tensors."""
    nh, nkv, d, i = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    ref: dict[str, list[np.ndarray]] = {}

    def rows(x):
        return np.split(x, tp, axis=0)

    emb = np.concatenate([hf["model.embed_tokens.weight"], np.zeros((vp - cfg.vocab_size, cfg.hidden_size))])
    ref["model.embed_tokens.weight"] = rows(emb)
    if not cfg.tie_word_embeddings:
        ref["lm_head.weight"] = rows(np.concatenate([hf["lm_head.weight"],
                                                     np.zeros((vp - cfg.vocab_size, cfg.hidden_size))]))
    ref["model.norm.weight"] = [hf["model.norm.weight"]] * tp
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            ref[p + n + ".weight"] = [hf[p + n + ".weight"]] * tp
        a = p + "self_attn."
        q, k, v = (hf[a + f"{x}_proj.weight"] for x in "qkv")
        ref[a + "qkv_proj.weight"] = [_vllm_qkv_rank(q, k, v, nh, nkv, d, tp, r) for r in range(tp)]
        if cfg.attention_bias:
            qb, kb, vb = (hf[a + f"{x}_proj.bias"] for x in "qkv")
            ref[a + "qkv_proj.bias"] = [_vllm_qkv_rank(qb, kb, vb, nh, nkv, d, tp, r) for r in range(tp)]
        ref[a + "o_proj.weight"] = np.split(hf[a + "o_proj.weight"], tp, axis=1)
        if cfg.qk_norm:
            ref[a + "q_norm.weight"] = [hf[a + "q_norm.weight"]] * tp
            ref[a + "k_norm.weight"] = [hf[a + "k_norm.weight"]] * tp
        m = p + "mlp."
        w = i // tp
        g, u = hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]
        ref[m + "gate_up_proj.weight"] = [np.concatenate([g[r * w:(r + 1) * w], u[r * w:(r + 1) * w]])
                                          for r in range(tp)]
        ref[m + "down_proj.weight"] = np.split(hf[m + "down_proj.weight"], tp, axis=1)
    return ref


@pytest.mark.parametrize("tp", [2, 4])
def test_sync_vllm_matches_per_rank_reference(tp, model):
    cfg, hf, state = model
    devices = jax.devices()[8 - tp :]  # disjoint from part of the train mesh
    plan = build_plan(state, TargetSpec("vllm", devices=devices), ModelInfo.from_config(cfg))
    out, report = Translator(plan).sync(state)
    vp = 128  # vocab 100 padded to a multiple of 64
    ref = _vllm_reference(cfg, hf, tp, vp)
    assert set(out) == set(ref)
    assert report.num_tensors == len(ref)
    for name, arr in out.items():
        shards = rank_shards(arr)
        assert [s.device.id for s in shards] == [d.id for d in devices]
        assert len(shards) == tp
        for r in range(tp):
            np.testing.assert_array_equal(np.asarray(shards[r]), ref[name][r].astype(np.float32), err_msg=name)
    assert out["model.layers.0.self_attn.qkv_proj.weight"].sharding.spec == P("tensor", None)
    assert out["model.layers.1.self_attn.o_proj.weight"].sharding.spec == P(None, "tensor")
    assert out["model.norm.weight"].sharding.spec == P()
    # Inverse ops give back the trainer's tensors.
    q, k, v = ops.unfuse_qkv_per_rank(np.asarray(out["model.layers.1.self_attn.qkv_proj.weight"]),
                                      num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, tp=tp)
    src = _flat(state)
    np.testing.assert_array_equal(q.T.reshape(32, 8, 4), np.asarray(src["layers.1.self_attn.q_proj"]))
    np.testing.assert_array_equal(k.T.reshape(32, 2, 4), np.asarray(src["layers.1.self_attn.k_proj"]))
    g, _ = ops.unfuse_gate_up_per_rank(np.asarray(out["model.layers.0.mlp.gate_up_proj.weight"]), tp)
    np.testing.assert_array_equal(g.T, np.asarray(src["layers.0.mlp.gate_proj"]))
    np.testing.assert_array_equal(np.asarray(out["model.embed_tokens.weight"])[:100], np.asarray(src["embed_tokens"]))


def test_vllm_split_bytes_and_placement():
    train, rollout = split_devices(4, 4)
    cfg, _, state = _model("llama", make_mesh(1, 2, 2, devices=train))
    translator = Translator(build_plan(state, TargetSpec("vllm", devices=rollout), ModelInfo.from_config(cfg)))
    out, report = translator.sync(state)
    padding = 2 * (128 - 100) * 32 * 4  # zero rows of embed and lm_head are made in place
    assert report.bytes_moved == _shard_bytes(out.values()) - padding
    checks = translator.check_placement(state)
    assert len(checks) == len(out)
    for c in checks:
        if c.replicated_target:
            assert c.target.endswith("norm.weight")
        else:  # no device ever held the whole tensor
            assert c.peak_elements < c.global_elements, c
        assert {d.id for d in c.stage_sharding.device_set} == {0, 1, 2, 3}  # staged on the train devices


def test_check_placement_detects_full_copies():
    """The check is not vacuous: a replicated source puts a full copy on every device."""
    mesh = make_mesh(1, 8, 1)
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P()))
    plan = build_plan({"w": x}, TargetSpec("jax", mesh=mesh, shardings={"w": NamedSharding(mesh, P("fsdp"))}))
    (check,) = Translator(plan).check_placement({"w": x})
    assert not check.replicated_target and check.peak_elements == check.global_elements == 128


def test_vllm_rejects_bad_tp(train_mesh):
    cfg, _, state = _model("llama", train_mesh)
    with pytest.raises(ValueError, match="tensor-parallel size 3 must divide num_heads=8"):
        build_plan(state, TargetSpec("vllm", devices=jax.devices()[:3]), ModelInfo.from_config(cfg))
    with pytest.raises(ValueError, match="needs model_info"):
        build_plan(state, TargetSpec("vllm", devices=jax.devices()[:2]))
    with pytest.raises(ValueError, match="one device per tensor-parallel rank"):
        build_plan(state, TargetSpec("vllm", mesh=make_mesh(1, 2, 4)), ModelInfo.from_config(cfg))


# ----------------------------------------------------------------------------------------------- jetstream target
@pytest.mark.parametrize("model_type, maxtext_llama", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_sync_jetstream_layout(model_type, maxtext_llama, train_mesh):
    cfg, hf, state = _model(model_type, train_mesh)
    tmesh = make_mesh(1, 1, 2, devices=jax.devices()[6:])
    spec = TargetSpec("jetstream", mesh=tmesh, scale_query=maxtext_llama, interleave_rope=maxtext_llama)
    out, _ = Translator(build_plan(state, spec, ModelInfo.from_config(cfg))).sync(state)
    p = out["params"]
    e, nl, nh, nkv, d = 32, 2, 8, 2, 4
    src = {k: np.asarray(v) for k, v in _flat(state).items()}
    np.testing.assert_array_equal(np.asarray(p["token_embedder"]["embedding"]), src["embed_tokens"])
    sa = p["decoder"]["layers"]["self_attention"]
    q = np.asarray(sa["query"]["kernel"])
    assert q.shape == (e, nl, nh, d) and sa["query"]["kernel"].sharding.spec == P(None, None, "tensor", None)
    k = np.asarray(sa["key"]["kernel"])
    for li in range(nl):
        # Independent reference from the HF tensors: q_proj.weight [nH*D, E] -> [E, nH, D].
        q_hf = hf[f"model.layers.{li}.self_attn.q_proj.weight"].T.reshape(e, nh, d)
        k_hf = hf[f"model.layers.{li}.self_attn.k_proj.weight"].T.reshape(e, nkv, d)
        if maxtext_llama:  # undo: MaxText -> HF is concat(evens, odds), and x sqrt(D)
            np.testing.assert_allclose(np.concatenate([q[:, li, :, ::2], q[:, li, :, 1::2]], -1) * math.sqrt(d),
                                       q_hf, rtol=1e-6)
            np.testing.assert_array_equal(np.concatenate([k[:, li, :, ::2], k[:, li, :, 1::2]], -1), k_hf)
        else:
            np.testing.assert_array_equal(q[:, li], q_hf)
            np.testing.assert_array_equal(k[:, li], k_hf)
        np.testing.assert_array_equal(np.asarray(sa["out"]["kernel"])[:, li], src[f"layers.{li}.self_attn.o_proj"])
        np.testing.assert_array_equal(np.asarray(p["decoder"]["layers"]["mlp"]["wo"]["kernel"])[:, li],
                                      src[f"layers.{li}.mlp.down_proj"])
        np.testing.assert_array_equal(
            np.asarray(p["decoder"]["layers"]["pre_self_attention_layer_norm"]["scale"])[:, li],
            src[f"layers.{li}.input_layernorm.scale"])
    if model_type == "qwen2":
        np.testing.assert_array_equal(np.asarray(sa["value"]["bias"])[:, 1], src["layers.1.self_attn.v_bias"])
    if model_type == "qwen3":
        np.testing.assert_array_equal(np.asarray(sa["key_norm"]["scale"])[:, 0], src["layers.0.self_attn.k_norm.scale"])
    assert ("logits_dense" in p["decoder"]) == (not cfg.tie_word_embeddings)
    assert p["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].sharding.spec == P(None, None, "tensor")


# ----------------------------------------------------------------------------------------------- validation
def test_validate_plan_rejects_incomplete_tables(train_mesh):
    cfg, _, state = _model("llama", train_mesh)
    info = ModelInfo.from_config(cfg)
    plan = build_plan(state, TargetSpec("vllm", devices=jax.devices()[:2]), info)
    validate_plan(plan, state)
    dropped = Plan(plan.kind, plan.rules[1:], plan.expected, plan.source, plan.target, plan.mesh)
    with pytest.raises(ValueError, match=r"(?s)no rule uses: \['embed_tokens'\].*no rule produces: "
                                         r"\['model.embed_tokens.weight'\]"):
        validate_plan(dropped)
    with pytest.raises(ValueError, match="no rules"):
        Translator(Plan(plan.kind, (), plan.expected, plan.source, plan.target, plan.mesh))
    # A source with a tensor the plan does not know.
    extra = dict(_flat(state), extra_param=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"no rule uses: \['extra_param'\]"):
        validate_plan(plan, extra)
    # A rule whose output disagrees with the expected target shape.
    r0 = plan.rules[0]
    wrong = Plan(plan.kind, (type(r0)(r0.target, r0.sources, (), r0.sharding),) + plan.rules[1:], plan.expected,
                 plan.source, plan.target, plan.mesh)
    with pytest.raises(ValueError, match=r"makes \(100, 32\) float32, expected \(128, 32\)"):
        validate_plan(wrong)
    # A tied-model plan on an untied state leaves lm_head unused.
    tied = ModelInfo(**{**info.__dict__, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"no rule uses: \['lm_head'\]"):
        build_plan(state, TargetSpec("vllm", devices=jax.devices()[:2]), tied)
    with pytest.raises(ValueError, match="valid kinds"):
        TargetSpec("sglang", devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="source does not match the plan"):
        Translator(plan).sync({"embed_tokens": _flat(state)["embed_tokens"]})
