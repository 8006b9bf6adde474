"""jaxrl's LoRA export read by the Hugging Face stack (the ``test`` extra: torch, transformers, peft): the PEFT adapter
directory loads with ``peft.PeftModel.from_pretrained`` onto the transformers base model and gives the logits of
jaxrl's merged model; the merged export loads with ``AutoModelForCausalLM`` and gives them too."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import load_pretrained
from jaxrl.models.hf import save_hf
from jaxrl.models.lora import LoraSpec, apply_lora, merge_lora, save_peft_adapter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = np.array([[0, 0, 5, 9, 17, 3, 60], [4, 8, 15, 16, 23, 42, 7]], np.int32)
MASK = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], np.int32)
POS = np.maximum(np.cumsum(MASK, 1) - 1, 0).astype(np.int32)
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_base(tmp_path, model_type, **extra):
    """A random transformers model saved to ``tmp_path/base`` (norms / biases moved off their constant init)."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **dict(TINY, **extra))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path / "base"
    model.save_pretrained(str(path))
    return path


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long(),
                    position_ids=torch.from_numpy(POS).long())
    return out.logits.numpy()


@pytest.mark.parametrize("model_type, extra, targets", [
    ("llama", {}, "all-linear"),
    ("qwen2", {}, ["q_proj", "v_proj", "down_proj"]),
    ("qwen3", {"head_dim": 16}, r".*layers\.1\..*_proj"),
])
def test_peft_loads_the_adapter_onto_the_transformers_base(tmp_path, model_type, extra, targets):
    base_dir = hf_base(tmp_path, model_type, **extra)
    pre = load_pretrained(str(base_dir), load_tokenizer=False)
    graphdef, base = nnx.split(pre.model)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=targets)
    adapters, info = apply_lora(pre.model, spec, seed=3)
    rng = np.random.default_rng(5)  # a trained adapter: B off zero
    adapters = jax.tree.map(lambda x: jnp.asarray(x + 0.2 * rng.normal(size=x.shape), x.dtype), adapters)
    merged = nnx.merge(graphdef, merge_lora(adapters, base, spec.scale))
    ours, _ = merged(jnp.asarray(IDS), jnp.asarray(POS), jnp.asarray(MASK))
    ours = np.asarray(ours)

    adapter_dir = save_peft_adapter(adapters, info, tmp_path / "adapter", num_layers=2,
                                    base_model_name_or_path=str(base_dir))
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    base_logits = torch_logits(hf)
    with_adapter = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    got = torch_logits(with_adapter)
    valid = MASK.astype(bool)
    assert np.abs(got[valid] - base_logits[valid]).max() > 0.05  # the adapter is not a no-op
    n_lora = sum(1 for n, _ in with_adapter.named_parameters() if "lora_" in n)
    assert n_lora == 2 * len(info.targets)  # every adapted module got its A and B, no more
    np.testing.assert_allclose(got[valid], ours[valid], rtol=0, atol=1e-4)

    # the merged export is the same model for transformers alone
    save_hf(merged, pre.config, tmp_path / "merged")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    np.testing.assert_allclose(torch_logits(plain)[valid], ours[valid], rtol=0, atol=1e-4)
