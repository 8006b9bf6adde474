"""GGUF reader: real SmolLM2-135M-Instruct Q4_1 file vs transformers' own GGUF loader, plus synthetic files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrl.models.files import ModelFileError
from jaxrl.models.gguf import gguf_tokenizer, read_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Facts from shared/README.md (independent of any parser).
SMOL = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
)


@pytest.fixture(scope="module")
def smol_path(shared):
    return shared / "models" / "smollm2-135m-instruct" / GGUF_NAME


@pytest.fixture(scope="module")
def ours(smol_path):
    return read_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_ref(smol_path):
    """transformers' GGUF path (its own dequantize + q/k un-permute) into a torch fp32 LlamaForCausalLM.

    (``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` would do the same but needs ``accelerate``.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hc = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(hc).float().eval()
    parsed = load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    tensors = {k: v.numpy() for k, v in parsed["tensors"].items()}
    return model, tensors, parsed["config"]


def test_config_matches_readme_facts(ours, hf_ref):
    cfg, tensors = ours
    for key, want in SMOL.items():
        assert cfg[key] == want, key
    assert cfg["intermediate_size"] == 1536 and cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == 1e-5 and "rope_scaling" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "lm_head.weight" not in tensors
    _, _, hf_cfg = hf_ref  # transformers' reading of the same metadata agrees
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[key] == hf_cfg[key], key


def test_tensors_equal_transformers_dequantization(ours, hf_ref):
    _, tensors = ours
    _, ref, _ = hf_ref
    assert sorted(tensors) == sorted(ref)
    for name, want in ref.items():
        assert tensors[name].dtype == np.float32
        assert np.array_equal(tensors[name], want), name  # same fp32 dequantization and q/k un-permutation


@pytest.fixture(scope="module")
def flax_model(ours):
    import jax.numpy as jnp

    from jaxrl.models.config import ModelConfig
    from jaxrl.models.hf import from_hf_tensors

    cfg, tensors = ours
    return from_hf_tensors(ModelConfig.from_hf_config(cfg), tensors, param_dtype=jnp.float32, dtype=jnp.float32)


@pytest.fixture(scope="module")
def tok(smol_path):
    return gguf_tokenizer(smol_path)


def test_flax_logits_match_transformers(flax_model, hf_ref, tok):
    import jax.numpy as jnp
    import torch

    model, _, _ = hf_ref
    ids = tok("The quick brown fox jumps over the lazy dog. Paris is the capital of")["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    x = jnp.asarray([ids], jnp.int32)
    got, _ = flax_model(x, jnp.arange(len(ids), dtype=jnp.int32)[None], jnp.ones_like(x))
    got = np.asarray(got[0])
    # Both sides hold identical fp32 weights (asserted above), so only fp32 summation order differs over
    # 30 layers: measured max |diff| 1.4e-4 at logit scale 31 (4e-6 relative). 1e-4 x scale (~3e-3) leaves
    # ~20x margin, while a real bug (wrong rope layout, eps, tie) moves logits by O(1).
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_answers_paris(flax_model, tok):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt)["input_ids"]
    n_new, total = 12, len(ids) + 12
    graphdef, state = nnx.split(flax_model)

    @jax.jit
    def next_token(state, buf, cur):  # full recompute over a fixed [1, total] buffer; causal => right pad inert
        logits, _ = nnx.merge(graphdef, state)(buf, jnp.arange(total, dtype=jnp.int32)[None], jnp.ones_like(buf))
        return jnp.argmax(logits[0, cur - 1])

    buf = jnp.zeros((1, total), jnp.int32).at[0, : len(ids)].set(jnp.asarray(ids))
    for cur in range(len(ids), total):
        buf = buf.at[0, cur].set(next_token(state, buf, cur))
    answer = tok.decode(np.asarray(buf[0, len(ids) :]).tolist(), skip_special_tokens=True)
    assert "Paris" in answer, answer


# ------------------------------------------------------------------------------ synthetic GGUF files
def _write(path, arch: str, tensors: dict[str, np.ndarray], meta: dict):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in meta.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotate_half rows -> interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny(arch: str, rng, qk_norm=False, bias=False, untied=False):
    h, nh, nkv, d, ffn, v = 16, 4, 2, 8, 24, 32
    hf, gg = {}, {}

    def put(hf_name, gguf_name, shape, permute_heads=None):
        a = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = a
        gg[gguf_name] = _hf_to_gguf_permute(a, permute_heads) if permute_heads else a

    put("model.embed_tokens.weight", "token_embd.weight", (v, h))
    put("model.norm.weight", "output_norm.weight", (h,))
    if untied:
        put("lm_head.weight", "output.weight", (v, h))
    perm = arch == "llama"
    for i in range(2):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(p + "input_layernorm.weight", b + "attn_norm.weight", (h,))
        put(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", (h,))
        put(p + "self_attn.q_proj.weight", b + "attn_q.weight", (nh * d, h), nh if perm else None)
        put(p + "self_attn.k_proj.weight", b + "attn_k.weight", (nkv * d, h), nkv if perm else None)
        put(p + "self_attn.v_proj.weight", b + "attn_v.weight", (nkv * d, h))
        put(p + "self_attn.o_proj.weight", b + "attn_output.weight", (h, nh * d))
        if bias:
            put(p + "self_attn.q_proj.bias", b + "attn_q.bias", (nh * d,))
            put(p + "self_attn.k_proj.bias", b + "attn_k.bias", (nkv * d,))
            put(p + "self_attn.v_proj.bias", b + "attn_v.bias", (nkv * d,))
        if qk_norm:
            put(p + "self_attn.q_norm.weight", b + "attn_q_norm.weight", (d,))
            put(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight", (d,))
        put(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", (ffn, h))
        put(p + "mlp.up_proj.weight", b + "ffn_up.weight", (ffn, h))
        put(p + "mlp.down_proj.weight", b + "ffn_down.weight", (h, ffn))
    meta = {
        f"{arch}.embedding_length": ("uint32", h), f"{arch}.block_count": ("uint32", 2),
        f"{arch}.attention.head_count": ("uint32", nh), f"{arch}.attention.head_count_kv": ("uint32", nkv),
        f"{arch}.feed_forward_length": ("uint32", ffn), f"{arch}.context_length": ("uint32", 128),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-6), f"{arch}.rope.freq_base": ("float32", 5e5),
        f"{arch}.attention.key_length": ("uint32", d), "tokenizer.ggml.eos_token_id": ("uint32", 7),
    }
    return hf, gg, meta


@pytest.mark.parametrize(
    "arch,kw", [("llama", {}), ("llama", {"untied": True}), ("qwen2", {"bias": True}), ("qwen3", {"qk_norm": True})]
)
def test_synthetic_roundtrip(tmp_path, arch, kw):
    """HF tensors -> GGUF (with llama.cpp's q/k permutation for llama) -> read_gguf == original tensors."""
    hf, gg, meta = _tiny(arch, np.random.default_rng(0), **kw)
    path = tmp_path / f"{arch}.gguf"
    _write(path, arch, gg, meta)
    cfg, tensors = read_gguf(path)
    assert sorted(tensors) == sorted(hf)
    for name, want in hf.items():
        assert np.array_equal(tensors[name], want), name
    # no tensor is a view of the file's memory map (F32 ones came back as views): the file is not kept mapped
    assert not any(isinstance(t, np.memmap) or isinstance(t.base, np.memmap) for t in tensors.values())
    import gc

    gc.collect()
    maps = Path("/proc/self/maps")
    assert not maps.exists() or str(path) not in maps.read_text()
    assert cfg["model_type"] == arch and cfg["head_dim"] == 8 and cfg["num_key_value_heads"] == 2
    assert cfg["rope_theta"] == 5e5 and cfg["rms_norm_eps"] == 1e-6 and cfg["eos_token_id"] == 7
    assert cfg["vocab_size"] == 32 and cfg["max_position_embeddings"] == 128
    assert cfg["tie_word_embeddings"] is (not kw.get("untied", False))
    assert cfg["attention_bias"] is kw.get("bias", False)
    from jaxrl.models.config import ModelConfig

    ModelConfig.from_hf_config(cfg)  # accepted by the decoder's config


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    import math

    hf, gg, meta = _tiny("llama", np.random.default_rng(1))
    factor, low, high, ctx, d, theta = 32.0, 1.0, 4.0, 8192, 8, 5e5
    freqs = []  # llama.cpp convert_hf_to_gguf rope_factors for rope_type llama3
    for f in 1.0 / theta ** (np.arange(0, d, 2) / d):
        wl = 2 * math.pi / f
        if wl < ctx / high:
            freqs.append(1.0)
        elif wl > ctx / low:
            freqs.append(factor)
        else:
            s = (ctx / wl - low) / (high - low)
            freqs.append(1 / ((1 - s) / factor + s))
    gg["rope_freqs.weight"] = np.asarray(freqs, np.float32)
    _write(tmp_path / "l3.gguf", "llama", gg, meta)
    cfg, tensors = read_gguf(tmp_path / "l3.gguf")
    rs = cfg["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["factor"] == pytest.approx(factor)
    assert (rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]) == (1, 4, 8192)
    assert "rope_freqs.weight" not in tensors

    gg["rope_freqs.weight"] = np.linspace(1, 3, d // 2).astype(np.float32)  # not llama3-shaped
    _write(tmp_path / "odd.gguf", "llama", gg, meta)
    with pytest.raises(ModelFileError, match="rope_freqs"):
        read_gguf(tmp_path / "odd.gguf")


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        read_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf(tmp_path / "junk.gguf")

    hf, gg, meta = _tiny("llama", np.random.default_rng(2))
    gpt = {k.replace("llama.", "gpt2."): v for k, v in meta.items()}
    _write(tmp_path / "gpt2.gguf", "gpt2", gg, gpt)
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        read_gguf(tmp_path / "gpt2.gguf")

    no_ffn = {k: v for k, v in meta.items() if k != "llama.feed_forward_length"}
    _write(tmp_path / "noffn.gguf", "llama", gg, no_ffn)
    with pytest.raises(ValueError, match=r"lacks required key\(s\) \['llama.feed_forward_length'\]"):
        read_gguf(tmp_path / "noffn.gguf")

    gg["blk.0.ffn_up.weight"] = np.zeros((24, 16), np.int8)  # I8: the gguf package cannot dequantize it
    _write(tmp_path / "i8.gguf", "llama", gg, meta)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has quant type I8"):
        read_gguf(tmp_path / "i8.gguf")
