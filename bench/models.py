"""The models every benchmark uses, as plain Hugging Face directories any framework can load.

* ``tiny-qwen2``: a randomly initialised ``Qwen2ForCausalLM`` (seed 0, float32): hidden 256, intermediate 768,
  4 layers, 4 heads / 2 kv heads (head_dim 64, vLLM-compatible), tied embeddings, rope_theta 1e4, vocab 49152
  with SmolLM2's tokenizer (so prompts tokenize identically for every framework).
* ``smollm2-135m``: the real SmolLM2-135M-Instruct (shared GGUF, Q4_1 dequantized to float32 by
  :func:`jaxrl.models.load_pretrained`) written as a Llama HF directory (``save_hf``), with its tokenizer.

Both land in ``outputs/bench/models/<name>/`` (``config.json``, ``model.safetensors``, tokenizer files) and are
reused when present. Run ``python bench/models.py`` to (re)build them; ``--force`` rebuilds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import WORK_DIR  # noqa: E402

MODELS_DIR = WORK_DIR / "models"
MODEL_NAMES = ("tiny-qwen2", "smollm2-135m")

TINY_QWEN2 = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
)


def _smollm2_gguf() -> Path:
    from jaxrl.paths import shared_dir

    p = shared_dir() / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise FileNotFoundError(f"SmolLM2 GGUF not found at {p}; set JAXRL_SHARED to the shared assets folder")
    return p


def complete(d: Path) -> bool:
    """True when ``d`` holds a whole benchmark model (config, weights, tokenizer)."""
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()


def build_tiny_qwen2(out: Path) -> Path:
    """Write the tiny random Qwen2 (see module docstring) to ``out``; returns ``out``."""
    return build_random_qwen2(out, TINY_QWEN2)


def build_random_qwen2(out: Path, arch: dict) -> Path:
    """A randomly initialised ``Qwen2ForCausalLM`` (seed 0, float32) with the ``Qwen2Config`` fields ``arch`` and
    SmolLM2's tokenizer and vocabulary, written to ``out`` with its tokenizer; returns ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from jaxrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_smollm2_gguf()))
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **arch)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def build_smollm2(out: Path) -> Path:
    """Dequantize the shared SmolLM2-135M-Instruct GGUF into an HF Llama directory at ``out``; returns ``out``."""
    from jaxrl.models import load_pretrained
    from jaxrl.models.hf import save_hf

    pre = load_pretrained(str(_smollm2_gguf()))
    save_hf(pre.model, pre.config, out, tokenizer=pre.tokenizer)
    return out


def ensure_models(names=MODEL_NAMES, force: bool = False) -> dict[str, Path]:
    """Build (or reuse) the named benchmark models; returns ``{name: directory}``.

    Raises:
      ValueError: an unknown name (lists the valid ones).
    """
    builders = {"tiny-qwen2": build_tiny_qwen2, "smollm2-135m": build_smollm2}
    out = {}
    for name in names:
        if name not in builders:
            raise ValueError(f"unknown benchmark model {name!r}; valid: {', '.join(MODEL_NAMES)}")
        d = MODELS_DIR / name
        if force or not complete(d):
            builders[name](d)
        out[name] = d
    return out


def num_params(model_dir: Path) -> int:
    """Parameter count of an HF directory (from ``model.safetensors``' header; tied weights counted once)."""
    from safetensors import safe_open

    n = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            size = 1
            for s in shape:
                size *= s
            n += size
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list of {MODEL_NAMES}")
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    a = ap.parse_args()
    for n, d in ensure_models([m for m in a.models.split(",") if m], force=a.force).items():
        cfg = json.loads((d / "config.json").read_text())
        print(f"{n}: {d} ({cfg.get('model_type')}, {num_params(d) / 1e6:.1f} M params)")
