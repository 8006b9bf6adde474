"""The sequence-classification reward model against transformers' ``AutoModelForSequenceClassification``.

Tiny random Llama / Qwen2 / Qwen3 classifiers are built by transformers from a config (weights rescaled to O(1) so
a 1e-4 tolerance means something), saved with ``save_pretrained`` and loaded back through
:func:`jaxrl.models.reward_model.load_reward_model`; pooled logits must equal transformers' on left- and
right-padded batches (torch CPU, float32).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl.models.reward_model import RewardModel, last_token_index, load_reward_model

TOL = 1e-4
PAD = 0

_BASE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=PAD,
)
CONFIGS = {
    "llama": ("llama", dict(_BASE, tie_word_embeddings=False), 1),
    "qwen2": ("qwen2", dict(_BASE, tie_word_embeddings=False, rope_theta=1000000.0), 1),
    "qwen3": ("qwen3", dict(_BASE, tie_word_embeddings=True, head_dim=16, rope_theta=1000000.0), 3),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale weights (HF's std-0.02 init makes every score ~0): matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1),
    biases ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[1]))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, transformers model, saved dir, our RewardModel) for one architecture."""
    model_type, kw, num_labels = CONFIGS[request.param]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, num_labels=num_labels, **kw)
    hf = transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager").eval()
    _randomise(hf, seed=1)
    d = tmp_path_factory.mktemp(f"rm_{request.param}")
    hf.save_pretrained(d)
    return request.param, hf, d, load_reward_model(str(d))


def _batch(vocab: int, lengths: list[int], total: int, *, left: bool, seed: int = 0):
    """ids / mask / positions ``[B, total]``; padding slots hold the pad id (as a tokenizer pads)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(len(lengths), total)).astype(np.int64)
    mask = np.zeros((len(lengths), total), np.int64)
    for b, n in enumerate(lengths):
        if left:
            mask[b, total - n:] = 1
        else:
            mask[b, :n] = 1
    ids = np.where(mask == 1, ids, PAD)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def _hf_logits(hf, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 position_ids=torch.from_numpy(positions), use_cache=False)
    return out.logits.float().numpy()


@nnx.jit
def _ours(model, ids, positions, mask):
    return model(ids, positions, mask)


@pytest.mark.parametrize("left", [True, False], ids=["left_padded", "right_padded"])
def test_pooled_logits_equal_transformers(pair, left):
    name, hf, _, model = pair
    ids, mask, pos = _batch(hf.config.vocab_size, [12, 5, 9, 1], 12, left=left, seed=3)
    ref = _hf_logits(hf, ids, mask, pos)
    got = np.asarray(_ours(model, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32),
                           jnp.asarray(mask, jnp.int32)))
    assert got.shape == ref.shape == (4, CONFIGS[name][2])
    assert ref.std() > 0.1, f"reference scores have no spread ({ref.ravel()}); the comparison would be weak"
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=TOL)


def test_token_logits_equal_transformers_score_of_hidden(pair):
    """Every position's head output (not just the pooled one) matches ``hf.score(hidden)``."""
    _, hf, _, model = pair
    ids, mask, pos = _batch(hf.config.vocab_size, [10, 10], 10, left=True, seed=5)
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                          position_ids=torch.from_numpy(pos)).last_hidden_state
        ref = hf.score(hidden).numpy()
    got = np.asarray(model.token_logits(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=TOL)


def test_score_is_read_at_the_last_non_pad_token_like_transformers(pair):
    """A trailing pad-id token inside the mask (pad == eos, the response's EOS) is skipped, as transformers does;
    filler ids in masked slots other than the pad id do not change the score (the mask decides)."""
    _, hf, _, model = pair
    ids, mask, pos = _batch(hf.config.vocab_size, [8, 6], 8, left=False, seed=7)
    ids[0, 7] = PAD  # a real (unmasked) token equal to the pad id at the end of row 0
    ref = _hf_logits(hf, ids, mask, pos)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=TOL)
    assert int(last_token_index(jnp.asarray(ids), jnp.asarray(mask), PAD)[0]) == 6
    filled = np.where(mask == 1, ids, 77)  # masked slots hold a non-pad id
    got_filled = np.asarray(model(jnp.asarray(filled), jnp.asarray(pos), jnp.asarray(mask)))
    np.testing.assert_allclose(got_filled, ref, atol=TOL, rtol=TOL)


def test_last_token_index_without_pad_id_uses_the_mask():
    ids = jnp.asarray([[5, 6, 7, 0], [0, 0, 3, 4]])
    mask = jnp.asarray([[1, 1, 1, 0], [0, 0, 1, 1]])
    assert last_token_index(ids, mask, None).tolist() == [2, 3]
    assert last_token_index(ids, mask, 4).tolist() == [2, 2]


def test_head_and_config_read_from_the_checkpoint(pair):
    name, hf, d, model = pair
    assert model.num_labels == CONFIGS[name][2] and model.pad_token_id == PAD
    assert model.backbone.lm_head is None
    np.testing.assert_array_equal(np.asarray(model.score[...]), hf.score.weight.detach().numpy().T)


def test_causal_lm_checkpoint_is_refused_naming_the_architecture(tmp_path):
    cfg = transformers.AutoConfig.for_model("llama", **dict(_BASE, tie_word_embeddings=True))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*no 'score.weight'.*LlamaForSequenceClassification"):
        load_reward_model(str(tmp_path))


def test_num_labels_mismatch_and_score_bias_are_refused(pair, tmp_path):
    _, _, d, _ = pair
    tensors = load_file(str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    config["id2label"] = {str(i): f"L{i}" for i in range(tensors["score.weight"].shape[0] + 1)}
    config.pop("num_labels", None)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="num_labels"):
        load_reward_model(str(tmp_path / "a"))
    config = json.loads((d / "config.json").read_text())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    tensors["score.bias"] = np.zeros(tensors["score.weight"].shape[0], np.float32)
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['score.bias'\]"):
        load_reward_model(str(tmp_path / "b"))


def test_backbone_with_lm_head_is_refused():
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.decoder import Decoder

    cfg = ModelConfig.from_hf_config(dict(_BASE, model_type="llama", tie_word_embeddings=False))
    with pytest.raises(ValueError, match="no LM head"):
        RewardModel(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), jnp.zeros((cfg.hidden_size, 1)))
