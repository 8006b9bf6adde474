"""Read GGUF checkpoints (llama.cpp format) into Hugging Face config dicts and HF-named fp32 tensors.

Only dense decoder architectures the Flax decoder implements are accepted: ``llama`` (incl. Mistral-
style files, which llama.cpp also labels ``llama``), ``qwen2`` and ``qwen3``. Tensors are read and
dequantized with the ``gguf`` package (``GGUFReader`` + ``gguf.quants.dequantize``), so every quant
type that package implements (F32, F16, BF16, Q4_0 ... Q8_0, K-quants, IQ-quants) works.

Layout notes (sources: llama.cpp ``convert_hf_to_gguf.py``, transformers
``modeling_gguf_pytorch_utils.py`` / ``integrations/ggml.py``):

* GGUF dims are listed fastest-first, so the numpy array ``GGUFReader`` exposes is already the torch
  ``[out, in]`` layout.
* For ``llama``, llama.cpp's converter permutes the q/k projection rows from HF ``rotate_half`` order
  to interleaved-pair order (``LlamaModel.permute``); it is undone here with
  :func:`jaxrl.models.llama2c.interleaved_to_half_rows` (k uses the kv-head count). ``qwen2``/``qwen3``
  use NeoX-style rope in llama.cpp and are stored unpermuted.
* Llama-3.x files carry ``rope_freqs.weight`` (per-frequency divisors) instead of ``rope_scaling``
  metadata; it is mapped back to HF ``rope_scaling={"rope_type": "llama3", ...}`` after checking the
  values reproduce exactly.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from jaxrl.models.files import ModelFileError
from jaxrl.models.llama2c import interleaved_to_half_rows

__all__ = ["read_gguf", "read_gguf_config", "gguf_tokenizer", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF tensor name -> HF name. "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _open(path: str | Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError/struct errors on non-GGUF or truncated input
        raise ModelFileError(
            f"{path} is not a readable GGUF file ({path.stat().st_size} bytes; {type(e).__name__}: "
            f"{' '.join(str(e).split())}): it is truncated, corrupt or not GGUF; copy or download it again"
        ) from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32(v) -> float:
    """GGUF stores floats as float32; return the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping dominates dequantize time
        w = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelFileError(
            f"{path}: tensor {tensor.name} has quant type {tensor.tensor_type.name}, which the installed "
            f"gguf package cannot dequantize ({e}); re-quantize the model to a supported type "
            "(e.g. F16, Q8_0, Q4_K_M)"
        ) from e
    out = np.asarray(w, dtype=np.float32)
    # an F32 tensor comes back as a view of the file's memory map: copy it, or the arrays made from it keep the whole
    # mapped file resident for the run (98 MB for SmolLM2-135M Q4_1)
    return out.copy() if np.may_share_memory(out, tensor.data) else out


def _llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int, orig_ctx: int | None) -> dict:
    """Recover HF llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors (convert_hf_to_gguf
    ``LlamaModel.generate_extra_tensors``: 1 above high_freq_wavelen, ``factor`` below
    low_freq_wavelen, ``1 / ((1 - s) / factor + s)`` in between). Raises NotImplementedError when no
    standard parameter set reproduces ``factors`` (ModelFileError)."""
    factor = float(factors.max())
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    candidates = [(1.0, 4.0, c) for c in dict.fromkeys([orig_ctx or 8192, 8192]) if c]
    for low, high, ctx in candidates:
        expect = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            if wavelen < ctx / high:
                expect.append(1.0)
            elif wavelen > ctx / low:
                expect.append(factor)
            else:
                s = (ctx / wavelen - low) / (high - low)
                expect.append(1.0 / ((1.0 - s) / factor + s))
        if factors.shape == (len(expect),) and np.allclose(factors, expect, rtol=1e-4, atol=0):
            return {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": int(ctx),
            }
    raise ModelFileError(
        f"rope_freqs.weight (shape {factors.shape}, max {factor}) does not match llama3 rope scaling with "
        f"low_freq_factor 1, high_freq_factor 4, original context {[c for *_, c in candidates]}; "
        "this rope scaling variant is not supported"
    )


def read_gguf_config(path: str | Path) -> dict:
    """The Hugging Face config dict of a GGUF model from its metadata (no tensor is dequantized except the small
    ``rope_freqs``). The same dict :func:`read_gguf` returns.

    Raises:
      FileNotFoundError / ModelFileError: as :func:`read_gguf`.
    """
    path = Path(path)
    return _config(_open(path), path)


def _config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    required = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    missing = [f"{arch}.{k}" for k in required if meta(k) is None]
    if missing:
        raise ModelFileError(f"{path}: GGUF metadata lacks required key(s) {missing}")

    tensors_by_name = {t.name: t for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv = meta("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; dense models repeat one value
        if len(set(n_kv)) != 1:
            raise ModelFileError(f"{path}: per-layer kv head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    n_kv = int(n_kv)
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads

    vocab = meta("vocab_size")
    if vocab is None:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(toks.data) if toks is not None else int(tensors_by_name["token_embd.weight"].shape[1])
    rope_theta = _f32(meta("rope.freq_base", 10000.0))
    has_bias = "blk.0.attn_q.bias" in tensors_by_name
    cfg: dict = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": int(meta("feed_forward_length")),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors_by_name,
        "attention_bias": has_bias,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        v = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            cfg[f"{'pad' if key == 'padding' else key}_token_id"] = int(v)

    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ModelFileError(f"{path}: rope scaling type {scaling!r} is not supported (linear, yarn)")
        rs = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
        orig = meta("rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    if "rope_freqs.weight" in tensors_by_name:
        factors = _dequantize(tensors_by_name["rope_freqs.weight"], path)
        if not np.all(factors == 1.0):
            cfg["rope_scaling"] = _llama3_rope_scaling(
                factors, rope_theta, head_dim, meta("rope.scaling.original_context_length")
            )
    return cfg


def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a GGUF model: HF-style config dict and dequantized float32 tensors with HF names.

    Args:
      path: ``.gguf`` file whose ``general.architecture`` is ``llama``, ``qwen2`` or ``qwen3``.

    Returns:
      ``(hf_config, tensors)``.
      ``hf_config``: ``model_type``, ``architectures``, ``hidden_size``, ``num_hidden_layers``,
      ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (``attention.key_length``, else
      ``rope.dimension_count`` for llama, else ``hidden_size // num_attention_heads``),
      ``intermediate_size``, ``rms_norm_eps``, ``rope_theta`` (default 10000 when absent),
      ``rope_scaling`` (only when the file has linear/yarn scaling metadata or llama3
      ``rope_freqs``), ``vocab_size``, ``max_position_embeddings`` (``context_length``),
      ``tie_word_embeddings`` (true when ``output.weight`` is absent), ``attention_bias`` (q/k/v
      biases present), ``bos_token_id``/``eos_token_id``/``pad_token_id`` from
      ``tokenizer.ggml.*`` when present.
      ``tensors``: HF names (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
      ``...q_norm.weight`` for qwen3, ``lm_head.weight`` only when untied) -> float32 arrays in torch
      ``[out, in]`` layout, q/k rows in HF ``rotate_half`` order.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError (a ValueError): not a GGUF file or a truncated one, unsupported ``general.architecture``, a
        quant type the ``gguf`` package cannot dequantize, a tensor this loader does not know (e.g. MoE experts),
        or a ``rope_freqs`` tensor that is not standard llama3 scaling.
    """
    path = Path(path)
    reader = _open(path)
    cfg = _config(reader, path)
    arch = cfg["model_type"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name == "rope_freqs.weight":  # read into cfg["rope_scaling"] by _config
            continue
        hf = _hf_name(name)
        if hf is None:
            raise ModelFileError(f"{path}: tensor {name!r} ({arch}) has no Hugging Face equivalent in this loader")
        w = _dequantize(t, path)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = interleaved_to_half_rows(w, n_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = interleaved_to_half_rows(w, n_kv)
        out[hf] = w
    return cfg, out


def gguf_tokenizer(path: str | Path):
    """Tokenizer for a GGUF model.

    Prefers ``tokenizer.json`` (+ ``tokenizer_config.json``) in the GGUF file's folder (faster and
    what the file's publisher ships); otherwise builds one from the GGUF's ``tokenizer.ggml.*``
    metadata with ``transformers`` (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), which
    also carries ``tokenizer.chat_template``.

    Args:
      path: ``.gguf`` file.

    Returns:
      ``transformers.PreTrainedTokenizerFast`` (pad token as in the files; see
      ``jaxrl.models.tokenizer.load_tokenizer`` for the pad fallback).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError: transformers cannot build a tokenizer from the GGUF metadata.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    folder = path.parent
    if (folder / "tokenizer.json").is_file():
        from jaxrl.models.tokenizer import hf_tokenizer

        return hf_tokenizer(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    except Exception as e:  # transformers' GGUF tokenizer conversion raises assorted types on bad metadata
        raise ModelFileError(
            f"{path}: no tokenizer.json beside the file and transformers could not build a tokenizer "
            f"from the GGUF metadata: {e}"
        ) from e
