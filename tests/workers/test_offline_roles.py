"""The SFT and DPO roles against transformers + torch on the real stories260K (the same weights in both):

- the SFT step's loss (accumulated over micro-batches) equals transformers' causal-LM loss on the same masked batch
  (labels -100 off the targets), and its gradient equals torch's;
- the DPO step's loss (sigmoid with label smoothing) and gradient equal a torch DPO written out from the two
  models' sequence log-probabilities;
- an update lowers the loss and the role's state round-trips (what a checkpoint holds).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.config.batch_plan import RolePlan
from jaxrl.config.offline_schema import OfflineOptimConfig
from jaxrl.config.schema import PreferenceLossConfig
from jaxrl.data.examples import SequenceExample
from jaxrl.data.offline import collate, collate_pairs
from jaxrl.models.hf import to_hf_tensors
from jaxrl.offline.build import optim_view
from jaxrl.workers.microbatch import stack_micro
from jaxrl.workers.preference import PreferenceWorker
from jaxrl.workers.sft import SFTWorker

WIDTH = 24


def _plan(rows: int, micro: int) -> RolePlan:
    return RolePlan.derive("data", rollout_n=1, rows_per_step=rows, mini_batch_size=rows, micro_batch_size_per_gpu=micro,
                           forward_key="data.micro_batch_size_per_gpu", forward_per_gpu=micro,
                           mini_batch_key="data.train_batch_size", micro_batch_key="data.micro_batch_size_per_gpu")


def _examples(n: int, seed: int) -> list[SequenceExample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(2, 8)), int(rng.integers(3, WIDTH - 8))
        out.append(SequenceExample.of([1] + rng.integers(3, 512, p).tolist(), rng.integers(3, 512, r).tolist()))
    return out


@pytest.fixture(scope="module")
def models(shared):
    """``(graphdef, params, hf)``: stories260K in jaxrl (float32) and in transformers (float64 reference)."""
    import transformers

    from jaxrl.models import load_pretrained

    path = shared / "models" / "stories260K"
    pre = load_pretrained(str(path), load_tokenizer=False)
    graphdef, params = nnx.split(pre.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return graphdef, params, hf


def _torch_token_logps(hf, batch):
    """Per-token log-probs ``[B, R]`` of ``batch``'s responses under ``hf`` (right-padded rows, the same layout)."""
    ids = torch.as_tensor(batch.input_ids(), dtype=torch.long)
    attn = torch.as_tensor(batch.attention_mask())
    logits = hf(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp[:, batch.prompt_width - 1:]


def _hf_grads(worker, grads) -> dict[str, np.ndarray]:
    return to_hf_tensors(nnx.merge(worker.graphdef, grads))


def _compare_grads(worker, grads, hf, atol):
    ours = _hf_grads(worker, grads)
    named = dict(hf.named_parameters())
    checked = 0
    for name, g in ours.items():
        ref = named[name].grad.numpy()
        np.testing.assert_allclose(g, ref, atol=atol, rtol=1e-4, err_msg=name)
        checked += 1
    assert checked >= 10 and max(np.abs(g).max() for g in ours.values()) > 1e-3


def test_sft_loss_and_gradient_equal_transformers(models):
    graphdef, params, hf = models
    batch = collate(_examples(6, seed=0), WIDTH)
    worker = SFTWorker(graphdef, params, plan=_plan(6, 2), optim=optim_view(OfflineOptimConfig()), grad_clip=1.0,
                       total_training_steps=1)
    arrays = worker.minibatch_arrays(batch)
    stacked, num_tokens, num_seqs = stack_micro(arrays, np.arange(6), 6, 2)  # 3 micro-batches, accumulated
    grads, metrics = jax.jit(worker.accumulate_grads, static_argnames="prompt_width")(
        worker.params, stacked, num_tokens, num_seqs, prompt_width=batch.prompt_width)

    ids = torch.as_tensor(batch.input_ids(), dtype=torch.long)
    labels = ids.clone()
    targets = np.concatenate([np.zeros((6, 1), np.int32), batch.response_mask], axis=1)  # the token at each position
    labels[torch.as_tensor(targets) == 0] = -100
    hf.zero_grad()
    out = hf(input_ids=ids, attention_mask=torch.as_tensor(batch.attention_mask()), labels=labels)
    out.loss.backward()
    assert float(metrics["train/loss"]) == pytest.approx(float(out.loss.detach()), abs=1e-5)
    _compare_grads(worker, grads, hf, atol=1e-5)


def test_dpo_loss_and_gradient_equal_a_torch_reference(models):
    graphdef, params, hf = models
    pairs = collate_pairs(list(zip(_examples(4, seed=1), _examples(4, seed=2))), WIDTH)
    # the reference: the same model with perturbed weights (so the log-ratios are not all zero)
    rng = np.random.default_rng(3)
    ref_params = jax.tree.map(lambda x: x + 0.05 * np.std(x) * rng.standard_normal(x.shape).astype(np.float32),
                              params)
    cfg = PreferenceLossConfig(loss_type="sigmoid", beta=0.5, label_smoothing=0.1)
    worker = PreferenceWorker(graphdef, params, cfg, plan=_plan(4, 2), optim=optim_view(OfflineOptimConfig()),
                              grad_clip=1.0, temperature=1.0, total_training_steps=1)
    # online DPO's actor: the rollout build, the weight sync and the export read these (no LoRA: the model itself)
    assert worker.lora is None and worker.base_graphdef is graphdef and worker.merged_params() is worker.params
    worker.reference_logps(ref_params, pairs)
    stacked, num_tokens, num_seqs = stack_micro(worker.minibatch_arrays(pairs), np.arange(4), 4, 2)
    grads, metrics = jax.jit(worker.accumulate_grads, static_argnames="prompt_width")(
        worker.params, stacked, num_tokens, num_seqs, prompt_width=pairs.prompt_width)

    import transformers

    ref_hf = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    ref_hf.load_state_dict({k: torch.tensor(v) for k, v in to_hf_tensors(nnx.merge(graphdef, ref_params)).items()},
                           strict=False)
    if hf.config.tie_word_embeddings:
        ref_hf.tie_weights()

    def seq(model, batch):
        return (_torch_token_logps(model, batch) * torch.as_tensor(batch.response_mask)).sum(-1)

    with torch.no_grad():
        ref_c, ref_r = seq(ref_hf, pairs.chosen), seq(ref_hf, pairs.rejected)
    np.testing.assert_allclose(pairs.ref_chosen_logps, ref_c.numpy(), atol=1e-4)
    hf.zero_grad()
    pol_c, pol_r = seq(hf, pairs.chosen), seq(hf, pairs.rejected)
    z = cfg.beta * ((pol_c - ref_c) - (pol_r - ref_r))
    e = cfg.label_smoothing
    loss = (-(1 - e) * torch.nn.functional.logsigmoid(z) - e * torch.nn.functional.logsigmoid(-z)).mean()
    loss.backward()
    assert float(metrics["train/loss"]) == pytest.approx(float(loss.detach()), abs=1e-5)
    rewards_c = cfg.beta * (pol_c - ref_c).detach()
    rewards_r = cfg.beta * (pol_r - ref_r).detach()
    assert float(metrics["rewards/chosen"]) == pytest.approx(float(rewards_c.mean()), abs=1e-4)
    assert float(metrics["rewards/accuracies"]) == pytest.approx(float((rewards_c > rewards_r).float().mean()))
    assert float(metrics["logps/rejected"]) == pytest.approx(float(pol_r.detach().mean()), abs=1e-3)
    # float32 on both sides: the loss's gradient scales the summed log-probs (~100 nats) by sigmoid(z), so entries
    # of size ~0.5 agree to ~5e-5 (the loss itself, and the pure loss's gradient in tests/algorithms, to 1e-5)
    _compare_grads(worker, grads, hf, atol=1e-4)


def test_updates_lower_the_loss_and_state_round_trips(models):
    graphdef, params, _ = models
    batch = collate(_examples(4, seed=5), WIDTH)
    optim = optim_view(OfflineOptimConfig(lr=3e-3, lr_warmup_steps_ratio=0.0, lr_scheduler="constant"))
    worker = SFTWorker(graphdef, params, plan=_plan(4, 2), optim=optim, grad_clip=1.0, total_training_steps=10)
    worker.init_optimizer()
    first = worker.update(batch)["train/loss"]
    for _ in range(4):
        last = worker.update(batch)["train/loss"]
    assert last < first - 0.1, (first, last)
    # no LoRA: what the rollout sync and the HF export read (jaxrl.loop.export_final_model) is the trained model
    assert worker.lora is None and worker.base_graphdef is graphdef and worker.merged_params() is worker.params
    arrays, meta = worker.state()
    other = SFTWorker(graphdef, params, plan=_plan(4, 2), optim=optim, grad_clip=1.0, total_training_steps=10)
    other.load_state(arrays, meta)
    assert other.num_updates == 5
    nll, tokens = worker.nll(batch)
    assert other.nll(batch) == pytest.approx((nll, tokens))
    assert nll / tokens == pytest.approx(last, rel=0.2)  # the validation NLL is the same quantity


def test_on_a_mesh_the_roles_compute_what_one_device_computes():
    """data 2 x fsdp 2 (of the 8 simulated devices): the SFT update, the DPO update and the reference log-probs
    equal the single-device ones (fp32 summation order aside)."""
    import jax.numpy as jnp

    from jaxrl.models.decoder import Decoder
    from sharding import DEFAULT_RULES, make_mesh
    from tests.helpers import tiny_model_config

    cfg = tiny_model_config("llama")
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32), state)
    mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
    optim = optim_view(OfflineOptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps_ratio=0.0, lr_scheduler="constant"))

    def examples(n, seed):
        g = np.random.default_rng(seed)
        return [SequenceExample.of([1] + g.integers(3, 64, int(g.integers(1, 5))).tolist(),
                                   g.integers(3, 64, int(g.integers(2, 9))).tolist()) for _ in range(n)]

    def plan(shards):
        return RolePlan.derive("data", rollout_n=1, rows_per_step=8, mini_batch_size=8, micro_batch_size_per_gpu=2,
                               forward_key="data.micro_batch_size_per_gpu", forward_per_gpu=2, batch_shards=shards)

    batch = collate(examples(8, 1), 16)
    out = {}
    for name, kw in (("one", {}), ("mesh", {"mesh": mesh, "rules": DEFAULT_RULES})):
        shards = 1 if not kw else 4
        sft = SFTWorker(graphdef, jax.tree.map(jnp.copy, params), plan=plan(shards), optim=optim, grad_clip=1.0,
                        total_training_steps=2, **kw)
        dpo = PreferenceWorker(graphdef, jax.tree.map(jnp.copy, params), PreferenceLossConfig(beta=0.5),
                               plan=plan(shards), optim=optim, grad_clip=1.0, temperature=1.0, total_training_steps=2,
                               **kw)
        p = collate_pairs(list(zip(examples(8, 2), examples(8, 3))), 16)
        ref = jax.tree.map(lambda x: x * 0.9, params)
        dpo.reference_logps(ref, p)
        out[name] = (sft.update(batch), dpo.update(p), p.ref_chosen_logps,
                     jax.tree.leaves(sft.params)[0], jax.tree.leaves(dpo.params)[0])
    for a, b in zip(out["one"][:2], out["mesh"][:2]):
        assert set(a) == set(b)
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    for a, b in zip(out["one"][2:], out["mesh"][2:]):  # the reference log-probs, the updated params
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    assert not np.allclose(np.asarray(out["one"][3]), np.asarray(jax.tree.leaves(params)[0]))  # the params moved
