"""Reward-model role: scores equal the model run on each unpadded sequence, micro-batching equals one call, the
8-device mesh equals one device, and the re-tokenized path builds the inputs verl builds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.batch import RLBatch
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.reward_model import RewardModel
from jaxrl.workers.reward_model import RewardModelWorker, check_same_tokenizer, retokenize_for_reward_model
from sharding import make_mesh
from tests.helpers import tiny_batch, tiny_model_config

CFG = tiny_model_config("qwen2", pad_token_id=2, max_position_embeddings=2048)
P, R = 6, 5


def tiny_rm(cfg: ModelConfig = CFG, num_labels: int = 1, seed: int = 0) -> RewardModel:
    body = Decoder(cfg, rngs=nnx.Rngs(seed))
    body.lm_head = None
    # O(1) weights so scores differ clearly between rows (the default std-0.02 init scores everything ~0)
    state = nnx.state(body, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(state))))
    nnx.update(body, jax.tree.map(lambda x: x * 25.0 if x.ndim > 1 else x, state))
    head = jax.random.normal(next(keys), (cfg.hidden_size, num_labels))
    return RewardModel(body, head)


def make_batch(n=8, seed=0) -> RLBatch:
    return tiny_batch(n, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size, group_size=1)[0]


@pytest.fixture(scope="module")
def split_rm():
    return nnx.split(tiny_rm())


def unpadded_reference(graphdef, params, batch: RLBatch) -> np.ndarray:
    """Each row alone: its real prompt + response tokens, no padding at all, positions 0..L-1, last token read."""
    model = nnx.merge(graphdef, params)
    out = []
    for i in range(batch.size):
        ids = np.concatenate([batch.prompt_ids[i][batch.prompt_mask[i] == 1],
                              batch.response_ids[i][batch.response_mask[i] == 1]])[None]
        logits = model.token_logits(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], jnp.ones_like(ids))
        out.append(float(logits[0, -1, 0]))
    return np.asarray(out, np.float32)


def test_scores_equal_each_sequence_scored_alone(split_rm):
    graphdef, params = split_rm
    batch = make_batch()
    got = RewardModelWorker(graphdef, params, micro_batch_size=4).score(batch).scores
    ref = unpadded_reference(graphdef, params, batch)
    assert got.shape == (batch.size,) and got.dtype == np.float32
    assert ref.std() > 0.1, ref
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("micro", [1, 3, 8])
def test_micro_batching_equals_one_call(split_rm, micro):
    graphdef, params = split_rm
    batch = make_batch(n=8, seed=1)
    whole = RewardModelWorker(graphdef, params).score(batch).scores
    chunked = RewardModelWorker(graphdef, params, micro_batch_size=micro).score(batch).scores
    # other batch shapes change XLA's float32 reduction order: on an AVX-512 CPU the scores (magnitude up to ~14)
    # moved by up to 2.5e-5; a wrong row or mask moves them by O(1)
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=1e-4)


def test_eight_device_mesh_equals_single_device(split_rm):
    assert jax.device_count() == 8, "tests/conftest.py sets XLA_FLAGS to 8 host devices"
    graphdef, params = split_rm
    batch = make_batch(n=16, seed=2)
    single = RewardModelWorker(graphdef, params, micro_batch_size=8).score(batch).scores
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = RewardModelWorker(graphdef, params, micro_batch_size=8, mesh=mesh)
    got = sharded.score(batch).scores
    np.testing.assert_allclose(got, single, atol=1e-5, rtol=1e-5)
    # the frozen params live on the mesh by the rules (the MLP is tensor-parallel, the head FSDP over embed)
    state = nnx.State(sharded.params) if not isinstance(sharded.params, nnx.State) else sharded.params
    gate = state["backbone"]["layers"][0]["mlp"]["gate_proj"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert state["score"][...].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    # the whole batch in one call (micro=None) is rounded up to the 4 row shards
    np.testing.assert_allclose(RewardModelWorker(graphdef, params, mesh=mesh).score(make_batch(n=6)).scores,
                               unpadded_reference(graphdef, params, make_batch(n=6)), atol=1e-4, rtol=1e-4)


def test_bad_settings_are_refused(split_rm):
    graphdef, params = split_rm
    with pytest.raises(ValueError, match=r"the reward model's micro-batch: 6 rows per call must be a positive multiple "
                                         r"of the 4 batch shards"):
        RewardModelWorker(graphdef, params, micro_batch_size=6, mesh=make_mesh(data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match="micro-batch must be >= 1 rows, got 0"):
        RewardModelWorker(graphdef, params, micro_batch_size=0)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelWorker(*nnx.split(tiny_rm(num_labels=2)))


def test_same_tokens_path_needs_the_policy_vocabulary():
    with pytest.raises(ValueError, match=r"vocab_size=32 < the policy's 64 .* set reward_model.model.input_tokenizer"):
        check_same_tokenizer(32, 64, None, None, "rm")

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(64, 64, Tok({"a": 0}), Tok({"b": 0}), "rm")
    check_same_tokenizer(64, 64, Tok({"a": 0}), Tok({"a": 0}), "rm")  # same vocabulary: fine


# ------------------------------------------------------------------------------------------ re-tokenized path
@pytest.fixture(scope="module")
def stories_tok(shared):
    from jaxrl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(shared / "models" / "stories260K"))


def _stories_batch(tok, texts, split_at):
    """Prompt = the first ``split_at`` ids of each text (BOS included), response = the rest + EOS."""
    n = len(texts)
    full = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    p = max(split_at)
    r = max(len(f) - k for f, k in zip(full, split_at)) + 1
    batch = RLBatch(np.full((n, p), tok.pad_token_id, np.int32), np.zeros((n, p), np.int32),
                    np.full((n, r), tok.pad_token_id, np.int32), np.zeros((n, r), np.int32), np.arange(n))
    for i, (f, k) in enumerate(zip(full, split_at)):
        batch.prompt_ids[i, p - k:] = f[:k]
        batch.prompt_mask[i, p - k:] = 1
        resp = f[k:] + [tok.eos_token_id]
        batch.response_ids[i, : len(resp)] = resp
        batch.response_mask[i, : len(resp)] = 1
    return batch, full


def test_retokenized_without_chat_template_reads_prompt_and_response_text(stories_tok):
    tok = stories_tok
    texts = ["Once upon a time, there was a little dog named Max.", "Tom had a red ball. He was happy."]
    batch, full = _stories_batch(tok, texts, split_at=[6, 4])
    ids, mask, truncated = retokenize_for_reward_model(["p0", "p1"], batch, input_tokenizer=tok, rm_tokenizer=tok,
                                                       max_length=None)
    assert ids.shape == (2, batch.prompt_width + batch.response_width) and truncated == 0
    for i in range(2):  # BOS + text, EOS dropped (special tokens are not text), right-padded
        n = len(full[i])
        assert ids[i, :n].tolist() == full[i] and mask[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
    # the same tokenizer and an RM whose pad id is EOS: re-tokenized scores equal the same-tokens scores
    cfg = CFG.replace(model_type="llama", attention_bias=False, vocab_size=tok.vocab_size,
                      pad_token_id=tok.eos_token_id)
    graphdef, params = nnx.split(tiny_rm(cfg))
    direct = RewardModelWorker(graphdef, params).score(batch).scores
    re = RewardModelWorker(graphdef, params, input_tokenizer=tok, rm_tokenizer=tok).score(batch, ["p0", "p1"])
    np.testing.assert_allclose(re.scores, direct, atol=1e-4, rtol=1e-4)
    assert abs(direct[0] - direct[1]) > 1e-3


def test_retokenized_with_chat_template_as_verl(stories_tok, shared):
    """Response decoded, EOS text removed, appended as the assistant turn after the raw chat prompt, rendered by the
    RM's (ChatML) template without a generation prompt, encoded without extra special tokens, cut at max_length."""
    from jaxrl.models.tokenizer import load_tokenizer

    rm_tok = load_tokenizer(str(shared / "models" / "smollm2-135m-instruct"))
    assert rm_tok.chat_template
    batch, _ = _stories_batch(stories_tok, ["Lily went to the park to play.", "The sun was big."], split_at=[5, 3])
    prompts = [[{"role": "system", "content": "Rate it."}, {"role": "user", "content": "Write a story."}],
               "Tell me about the sun."]
    ids, mask, truncated = retokenize_for_reward_model(prompts, batch, input_tokenizer=stories_tok,
                                                       rm_tokenizer=rm_tok, max_length=64)
    assert ids.shape == (2, 64) and truncated == 0
    first = rm_tok.decode(ids[0][mask[0] == 1])
    response0 = stories_tok.decode(batch.response_ids[0][batch.response_mask[0] == 1], skip_special_tokens=True)
    assert first.startswith("<|im_start|>system\nRate it.<|im_end|>\n<|im_start|>user\nWrite a story.<|im_end|>\n")
    assert first.endswith(f"<|im_start|>assistant\n{response0}<|im_end|>\n") and "</s>" not in first
    second = rm_tok.decode(ids[1][mask[1] == 1])
    assert "<|im_start|>user\nTell me about the sun.<|im_end|>" in second  # a string prompt is one user turn
    assert rm_tok.encode(first, add_special_tokens=False) == ids[0][mask[0] == 1].tolist()
    short, short_mask, truncated = retokenize_for_reward_model(prompts, batch, input_tokenizer=stories_tok,
                                                               rm_tokenizer=rm_tok, max_length=8)
    assert truncated == 2 and short_mask.all() and (short == ids[:, :8]).all()  # verl: cut on the right
    with pytest.raises(ValueError, match="needs each response's raw prompt"):
        graphdef, params = nnx.split(tiny_rm(CFG.replace(vocab_size=rm_tok.vocab_size + 100)))
        RewardModelWorker(graphdef, params, input_tokenizer=stories_tok, rm_tokenizer=rm_tok).score(batch)
