"""``python -m jaxrl.export``: a training checkpoint of the real stories260K becomes a Hugging Face model that
transformers loads and that decodes exactly like ``jaxrl.generate`` on the exported folder."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.checkpoint import CheckpointStore, model_meta
from jaxrl.export import main as export_main
from jaxrl.paths import REPO_ROOT

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

NEW_TOKENS = 20
SCALE = 0.2  # noise in units of each tensor's std: the greedy text changes; top-2 logit gaps stay >= 0.28


@pytest.fixture(scope="module")
def run_dir(shared, tmp_path_factory):
    """A run's checkpoint root holding step 4 of stories260K with perturbed ("trained") params."""
    from jaxrl.models import load_pretrained
    from jaxrl.models.hf import to_hf_tensors

    model_path = shared / "models" / "stories260K"
    pre = load_pretrained(str(model_path))
    graphdef, params = nnx.split(pre.model)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jax.numpy.asarray(
        np.asarray(x) + SCALE * np.std(x) * rng.standard_normal(x.shape).astype(np.float32)), params)
    root = tmp_path_factory.mktemp("ckpt") / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=True)
    store.save_tokenizer(pre.tokenizer)
    meta = {"step": 4, "model": model_meta(pre.config, path=str(model_path), param_dtype="float32")}
    store.save(4, arrays={"actor": {"params": params, "opt_state": optax.adamw(1e-3).init(params)}}, meta=meta)
    store.close()
    expected = to_hf_tensors(nnx.merge(graphdef, params))
    golden = json.loads((model_path / "greedy_from_bos_256_ids.json").read_text())
    return {"root": root, "expected": expected, "golden": golden, "bos": pre.config.bos_token_id,
            "eos": set(pre.config.eos_token_id), "model_path": model_path, "config": pre.config,
            "tokenizer": pre.tokenizer, "params": params}


def _hf_greedy(out_dir, bos: int, eos: set[int]) -> list[int]:
    """BOS + transformers' greedy continuation, cut before the first eos (the jaxrl.generate --output-ids format)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[bos]])
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=model.config.pad_token_id or 0)[0].tolist()
    response = seq[1:]
    for i, t in enumerate(response):
        if t in eos:
            response = response[:i]
            break
    return [bos] + response


def test_export_matches_transformers_and_generate(run_dir, tmp_path, capsys):
    from safetensors.numpy import load_file

    out = tmp_path / "hf"
    assert export_main([str(run_dir["root"] / "global_step_4"), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    # the exported weights are exactly the checkpoint's (not the pretrained ones)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors.keys() == run_dir["expected"].keys()
    for name, arr in run_dir["expected"].items():
        np.testing.assert_array_equal(tensors[name], arr, err_msg=name)

    hf_ids = _hf_greedy(out, run_dir["bos"], run_dir["eos"])
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.generate", "--model", str(out), "--prompt", "", "--greedy",
         "--max-new-tokens", str(NEW_TOKENS), "--output-ids"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jax_ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert jax_ids == hf_ids
    assert len(hf_ids) > 1 and hf_ids[0] == run_dir["bos"]
    # the perturbation shows: the pretrained model's greedy continuation is different
    assert hf_ids != run_dir["golden"][: len(hf_ids)]
    # jaxrl.generate also samples straight from the checkpoint folder, with the same tokens
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.generate", "--model", str(run_dir["root"] / "global_step_4"), "--prompt", "",
         "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--output-ids"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == hf_ids


def test_a_scan_layout_checkpoint_exports_the_same_weights(run_dir, tmp_path):
    """A trained role saves its layers stacked (jaxrl.models.scan_layout; meta["model"]["scan_layout"]): the export
    unstacks them into the same Hugging Face tensors as the per-layer checkpoint of the same weights."""
    from safetensors.numpy import load_file

    from jaxrl.models.decoder import Decoder
    from jaxrl.models.scan_layout import is_scan_layout, stack_layers

    per_layer = run_dir["params"]
    cfg = run_dir["config"]
    training = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), remat=True)))[0]
    _, stacked = stack_layers(training, per_layer)
    assert is_scan_layout(stacked)
    root = tmp_path / "scan_run"
    store = CheckpointStore(root, max_to_keep=None)
    store.save_tokenizer(run_dir["tokenizer"])
    meta = {"step": 4, "model": model_meta(cfg, path=str(run_dir["model_path"]), param_dtype="float32",
                                           scan_layout=True)}
    store.save(4, arrays={"actor": {"params": stacked, "opt_state": optax.adamw(1e-3).init(stacked)}}, meta=meta)
    store.close()
    out = tmp_path / "hf_scan"
    assert export_main([str(root), "--output", str(out)]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors.keys() == run_dir["expected"].keys()
    for name, arr in run_dir["expected"].items():
        np.testing.assert_array_equal(tensors[name], arr, err_msg=name)


def test_export_from_run_dir_uses_newest_step(run_dir, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "empty_ok"
    out.mkdir()  # an existing empty folder is fine
    assert export_main([str(run_dir["root"]), "--output", str(out), "--step", "4"]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(tensors["model.norm.weight"], run_dir["expected"]["model.norm.weight"])


def test_export_bad_input_exits_2(run_dir, tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert export_main([str(missing), "--output", str(tmp_path / "o1")]) == 2
    assert str(missing) in capsys.readouterr().err

    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert export_main([str(empty), "--output", str(tmp_path / "o2")]) == 2
    assert str(empty) in capsys.readouterr().err

    assert export_main([str(run_dir["root"]), "--output", str(tmp_path / "o3"), "--step", "9"]) == 2
    err = capsys.readouterr().err
    assert "step 9" in err and str(run_dir["root"]) in err

    assert export_main([str(run_dir["root"] / "global_step_4"), "--output", str(tmp_path / "o4"),
                        "--step", "3"]) == 2
    assert "contradicts" in capsys.readouterr().err

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x.txt").write_text("keep me")
    assert export_main([str(run_dir["root"]), "--output", str(busy)]) == 2
    assert str(busy) in capsys.readouterr().err and (busy / "x.txt").read_text() == "keep me"

    # a checkpoint written without the model description export needs
    bare = tmp_path / "bare_run"
    store = CheckpointStore(bare, max_to_keep=None, async_save=False)
    store.save(1, arrays={"actor": {"params": {"w": np.zeros(3, np.float32)}}}, meta={"step": 1})
    store.close()
    assert export_main([str(bare), "--output", str(tmp_path / "o5")]) == 2
    err = capsys.readouterr().err
    assert "model description" in err and str(bare) in err
    assert not (tmp_path / "o5").exists()


def test_lora_checkpoint_exports_merged_and_peft(shared, tmp_path, capsys):
    """A LoRA run's checkpoint holds the adapters only: ``--format merged`` loads the base from the run's model path
    and writes ``W + (alpha / r) A B`` (computed here in numpy on the HF tensors), ``--format peft`` the adapter;
    a full fine-tuning checkpoint has no adapter to export."""
    from safetensors.numpy import load_file

    from jaxrl.models import load_pretrained
    from jaxrl.models.hf import to_hf_tensors
    from jaxrl.models.lora import LoraSpec, apply_lora

    model_path = shared / "models" / "stories260K"
    pre = load_pretrained(str(model_path))
    graphdef, base = nnx.split(pre.model)
    hf_base = to_hf_tensors(nnx.merge(graphdef, base))
    spec = LoraSpec(rank=2, alpha=6.0, target_modules=["q_proj", "down_proj"])
    adapters, info = apply_lora(pre.model, spec, seed=1)
    rng = np.random.default_rng(2)
    adapters = jax.tree.map(lambda x: jax.numpy.asarray(np.asarray(x) + 0.05 * rng.standard_normal(x.shape),
                                                        np.float32), adapters)
    root = tmp_path / "run"
    store = CheckpointStore(root, max_to_keep=None, async_save=False)
    store.save_tokenizer(pre.tokenizer)
    lora = {"rank": spec.rank, "alpha": spec.alpha, "targets": list(info.targets)}
    meta = {"step": 3, "model": model_meta(pre.config, path=str(model_path), param_dtype="float32", lora=lora)}
    store.save(3, arrays={"actor": {"params": adapters, "opt_state": optax.adamw(1e-3).init(adapters)}}, meta=meta)
    store.close()

    assert export_main([str(root), "--output", str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == hf_base.keys()
    changed = 0
    for name, w in hf_base.items():
        expected = w.astype(np.float64)
        module = name[: -len(".weight")]
        if module in info.targets:
            layer, sub, proj = module.split(".")[2], module.split(".")[3], module.split(".")[4]
            pair = adapters["layers"][int(layer)][sub]["lora"][proj]
            a, b = (np.asarray(pair[k].get_value(), np.float64) for k in ("lora_a", "lora_b"))
            expected = expected + (spec.alpha / spec.rank) * (a @ b).T  # HF [out, in]
            changed += 1
        np.testing.assert_allclose(merged[name], expected, rtol=0, atol=1e-6, err_msg=name)
    assert changed == len(info.targets) == 2 * pre.config.num_hidden_layers

    assert export_main([str(root), "--output", str(tmp_path / "peft"), "--format", "peft"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 6.0, ["q_proj", "down_proj"])
    assert config["base_model_name_or_path"] == str(model_path)
    assert len(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == 2 * len(info.targets)
    capsys.readouterr()


def test_peft_export_of_a_full_checkpoint_is_refused(run_dir, tmp_path, capsys):
    assert export_main([str(run_dir["root"]), "--output", str(tmp_path / "peft"), "--format", "peft"]) == 2
    assert "was not trained with LoRA" in capsys.readouterr().err
    assert not (tmp_path / "peft").exists()
