"""Hugging Face import/export: config conversion, safetensors directories, tensor mapping, save -> transformers."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file

from jaxrl.models import Pretrained, load_pretrained, parse_dtype
from jaxrl.models.config import ModelConfig
from jaxrl.models.hf import from_hf_tensors, load_hf_dir, save_hf, to_hf_tensors

_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def _tiny_hf(model_type: str, **extra) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(model_type, **dict(_TINY, **extra))
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # move norms/biases off their constant init
    tensors = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()}
    return ModelConfig.from_hf_config(hf_cfg.to_dict()), tensors


@nnx.jit
def _forward(model, ids, positions, mask):
    return model(ids, positions, mask)[0]


# ------------------------------------------------------------------------------------------- config
def test_config_unsupported_model_type_names_supported():
    with pytest.raises(ValueError, match=r"'mistral'.*llama.*qwen2.*qwen3"):
        ModelConfig.from_hf_config(dict(_TINY, model_type="mistral"))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config(dict(_TINY, model_type="llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_config(dict(_TINY, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 2}))
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig.from_hf_config(dict(_TINY, model_type="llama", num_key_value_heads=3))
    with pytest.raises(ValueError, match="missing required"):
        ModelConfig.from_hf_config({"model_type": "llama", "hidden_size": 8})


def test_config_defaults_and_rope_field_styles():
    base = dict(_TINY, model_type="llama")
    cfg = ModelConfig.from_hf_config(base)
    assert cfg.head_dim == 32 // 4 and cfg.rope_scaling is None and cfg.eos_token_id == (2,)
    assert ModelConfig.from_hf_config(dict(base, num_key_value_heads=None)).num_key_value_heads == 4
    assert ModelConfig.from_hf_config(dict(base, model_type="qwen2")).attention_bias is True
    q3 = ModelConfig.from_hf_config(dict(base, model_type="qwen3", eos_token_id=[2, 5]))
    assert q3.qk_norm and q3.head_dim == 128 and q3.eos_token_id == (2, 5)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    legacy = ModelConfig.from_hf_config(dict(base, rope_theta=5e5, rope_scaling=dict(scaling, rope_type="llama3")))
    new = ModelConfig.from_hf_config(dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5)))
    assert legacy == new and legacy.rope_theta == 5e5 and legacy.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_hf_config(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 123.0}))
    assert plain.rope_theta == 123.0 and plain.rope_scaling is None
    assert hash(legacy) == hash(new)


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", dict(tie_word_embeddings=True)),
        (
            "llama",
            dict(
                rope_theta=5e5,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=32),
            ),
        ),
        ("qwen2", dict(rope_theta=1e6)),
        ("qwen3", dict(head_dim=12, eos_token_id=[2, 3], tie_word_embeddings=True)),
    ],
)
def test_to_hf_config_roundtrips_through_autoconfig(model_type, extra):
    cfg = ModelConfig.from_hf_config(dict(_TINY, model_type=model_type, **extra))
    d = cfg.to_hf_config()
    assert d["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM"}[model_type]]
    hf_cfg = transformers.AutoConfig.for_model(**d)
    assert type(hf_cfg).__name__.lower().startswith(model_type)
    assert ModelConfig.from_hf_config(hf_cfg.to_dict()) == cfg


# ------------------------------------------------------------------------------------------- load_hf_dir
def test_load_hf_dir_stories260k(shared):
    d = shared / "models" / "stories260K"
    config, tensors = load_hf_dir(d)
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert len(tensors) == 2 + 9 * 5 and "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (512, 64)
    assert tensors["model.layers.4.self_attn.k_proj.weight"].shape == (4 * 8, 64)
    assert all(t.dtype == np.float32 for t in tensors.values())
    cfg = ModelConfig.from_hf_config(config)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.bos_token_id) == (5, 4, 8, 1)
    # exact inverse on real weights
    back = to_hf_tensors(from_hf_tensors(cfg, tensors))
    assert back.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k], err_msg=k)


def test_load_hf_dir_sharded_index(tmp_path, shared):
    config, tensors = load_hf_dir(shared / "models" / "stories260K")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(config))
    config2, tensors2 = load_hf_dir(tmp_path)
    assert config2 == config and tensors2.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(tensors2[k], tensors[k])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_dir(tmp_path)


def test_load_hf_dir_missing_things(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_dir(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(_TINY, model_type="llama")))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_dir(tmp_path)


# ------------------------------------------------------------------------------------------- tensor mapping
@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("qwen3", dict(head_dim=12))])
def test_tensor_roundtrip_exact(model_type, extra):
    cfg, tensors = _tiny_hf(model_type, **extra)
    model = from_hf_tensors(cfg, tensors)
    back = to_hf_tensors(model)
    assert back.keys() == tensors.keys()
    for k in tensors:
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], tensors[k], err_msg=k)
    # bf16 storage round-trips bit-exactly too
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    back_bf = to_hf_tensors(from_hf_tensors(cfg, bf, param_dtype=jnp.bfloat16))
    for k in bf:
        assert back_bf[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(back_bf[k].view(np.uint16), bf[k].view(np.uint16), err_msg=k)


def test_from_hf_tensors_reports_bad_checkpoints():
    cfg, tensors = _tiny_hf("qwen2")
    bad = dict(tensors)
    del bad["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing tensors: \['model\.layers\.1\.self_attn\.k_proj\.bias'\]"):
        from_hf_tensors(cfg, bad)
    bad = dict(tensors, **{"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors: \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        from_hf_tensors(cfg, bad)
    bad = dict(tensors, **{"model.norm.weight": np.zeros(31, np.float32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected \(32,\), got \(31,\)"):
        from_hf_tensors(cfg, bad)
    # a tied model accepts lm_head absent or equal to the embedding, and rejects a different one
    tcfg, ttensors = _tiny_hf("llama", tie_word_embeddings=True)
    np.testing.assert_array_equal(ttensors["lm_head.weight"], ttensors["model.embed_tokens.weight"])
    with_head = to_hf_tensors(from_hf_tensors(tcfg, ttensors))
    without = {k: v for k, v in ttensors.items() if k != "lm_head.weight"}
    assert to_hf_tensors(from_hf_tensors(tcfg, without)).keys() == with_head.keys() == without.keys()
    other = dict(ttensors, **{"lm_head.weight": ttensors["lm_head.weight"] + 1.0})
    with pytest.raises(ValueError, match="differs from model.embed_tokens.weight"):
        from_hf_tensors(tcfg, other)
    # while an untied one requires it
    ucfg, utensors = _tiny_hf("llama")
    del utensors["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        from_hf_tensors(ucfg, utensors)


# ------------------------------------------------------------------------------------------- save_hf
@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("qwen3", dict(head_dim=12, tie_word_embeddings=True)),
        (
            "llama",
            dict(
                rope_theta=5e5,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=16),
            ),
        ),
    ],
)
def test_save_hf_loads_in_transformers(tmp_path, model_type, extra):
    cfg, tensors = _tiny_hf(model_type, **extra)
    model = from_hf_tensors(cfg, tensors)
    save_hf(model, cfg, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = np.array([[0, 0, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    with torch.no_grad():
        ref = hf_model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(pos).long(),
        ).logits.numpy()
    ours = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)
    # and our loader reads the saved directory back to the same tensors
    config2, tensors2 = load_hf_dir(tmp_path)
    assert ModelConfig.from_hf_config(config2) == cfg
    expected = set(tensors) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(tensors2) == expected
    for k in expected:
        np.testing.assert_array_equal(tensors2[k], tensors[k])


def test_save_hf_with_tokenizer_and_load_pretrained(tmp_path, shared):
    src = shared / "models" / "stories260K"
    pre = load_pretrained(str(src), load_tokenizer=False)
    assert isinstance(pre, Pretrained) and pre.tokenizer is None
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    save_hf(pre.model, pre.config, tmp_path, tokenizer=tok)
    assert (tmp_path / "tokenizer.json").is_file()
    tok2 = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Once upon a time, there was a little girl."
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    again = load_pretrained(str(tmp_path), param_dtype="bf16", dtype="bfloat16", load_tokenizer=False)
    assert again.config == pre.config
    assert again.model.embed_tokens[...].dtype == jnp.bfloat16
    ids = jnp.asarray([[1, 403, 407, 261]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    mask = jnp.ones((1, 4), jnp.int32)
    a = np.asarray(_forward(pre.model, ids, pos, mask))
    b = np.asarray(_forward(again.model, ids, pos, mask))
    assert np.abs(a - b).max() / np.abs(a).max() < 0.05


def test_save_hf_rejects_mismatched_config(tmp_path):
    cfg, tensors = _tiny_hf("qwen2")
    model = from_hf_tensors(cfg, tensors)
    with pytest.raises(ValueError, match="does not match"):
        save_hf(model, cfg.replace(rms_norm_eps=1e-3), tmp_path)


def test_parse_dtype():
    assert parse_dtype("bf16") == jnp.bfloat16 and parse_dtype("float32") == jnp.float32
    assert parse_dtype("FP32") == jnp.float32 and parse_dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="float16"):
        parse_dtype("float16")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_pretrained("/nonexistent", dtype="int8")
