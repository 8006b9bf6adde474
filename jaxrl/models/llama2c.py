"""Readers for karpathy/llama2.c checkpoints (legacy ``.bin``) and tokenizers (``tok*.bin``).

Format reference: llama2.c ``run.c`` (``read_checkpoint`` / ``memory_map_weights`` / ``build_tokenizer``
/ ``encode``) and ``export.py`` (``legacy_export`` writes the checkpoint, ``hf_export`` converts to
Hugging Face layout). The checkpoint is what ``karpathy/tinyllamas`` publishes (e.g. stories260K.bin).

RoPE layout: llama2.c rotates *interleaved* pairs ``(2i, 2i+1)`` of each head, Hugging Face Llama
rotates ``(i, i + head_dim/2)`` (``rotate_half``). The checkpoint's ``wq``/``wk`` rows are therefore in
the interleaved order and are permuted here exactly as llama2.c's ``export.py::hf_export`` does
(rows ``[h, j, 2] -> [h, 2, j]`` per head), so the result equals the HF conversion bit for bit.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from jaxrl.models.files import ModelFileError

__all__ = ["read_llama2c", "read_llama2c_config", "llama2c_tokenizer", "interleaved_to_half_rows"]

_HEADER = struct.Struct("<7i")  # dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
_V1_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export versions, not the legacy format


def interleaved_to_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from interleaved-pair RoPE order to HF ``rotate_half`` order.

    Args:
      w: ``[n_heads * head_dim, in_features]`` projection weight (torch ``[out, in]`` layout) whose
        rows within each head are ordered ``(re0, im0, re1, im1, ...)`` (llama2.c, llama.cpp GGUF).
      n_heads: number of heads the rows belong to (``num_key_value_heads`` for k).

    Returns:
      ``[n_heads * head_dim, in_features]`` array, same dtype, rows per head ordered
      ``(re0, re1, ..., im0, im1, ...)``. Same permutation as llama2.c ``export.py::hf_export``
      (``view(n_heads, head_dim // 2, 2, in).transpose(1, 2)``) and transformers'
      ``LlamaTensorProcessor._reverse_permute_weights`` for GGUF.

    Raises:
      ValueError: if the row count is not divisible by ``2 * n_heads``.
    """
    rows = w.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size (shape {w.shape})")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_llama2c(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a llama2.c legacy checkpoint into an HF Llama config dict and HF-named tensors.

    File layout (run.c): 7 little-endian int32 ``dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    vocab_size, seq_len`` (negative ``vocab_size`` = separate classifier), then float32 arrays in
    this order: token embedding ``[vocab, dim]``, attention RMSNorm ``[L, dim]``, ``wq [L, dim, dim]``,
    ``wk [L, kv_dim, dim]``, ``wv [L, kv_dim, dim]``, ``wo [L, dim, dim]``, FFN RMSNorm ``[L, dim]``,
    ``w1 [L, hidden, dim]``, ``w2 [L, dim, hidden]``, ``w3 [L, hidden, dim]``, final RMSNorm ``[dim]``,
    two unused RoPE tables ``[seq_len, head_dim/2]`` each, then ``wcls [vocab, dim]`` if untied.
    All matrices are ``[out, in]`` like torch ``nn.Linear``.

    Args:
      path: the ``.bin`` checkpoint.

    Returns:
      ``(hf_config, tensors)``: ``hf_config`` is a Hugging Face ``LlamaConfig``-style dict
      (``rope_theta`` 10000 and ``rms_norm_eps`` 1e-5 are llama2.c's hard-coded values;
      ``tie_word_embeddings`` is true when ``vocab_size > 0`` in the header; bos 1, eos 2).
      ``tensors`` maps HF names (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
      ..., ``lm_head.weight`` only when untied) to float32 numpy arrays in torch layout, with q/k rows
      permuted to HF ``rotate_half`` order (see :func:`interleaved_to_half_rows`).

    Raises:
      FileNotFoundError: the file does not exist.
      ModelFileError (a ValueError): the file is a newer llama2.c export version (magic ``ak42``), the header is
        implausible, or the file size does not match the header (truncated or corrupt).
    """
    path = Path(path)
    raw = _read_checkpoint_bytes(path)
    h = _header(raw[: _HEADER.size], path)
    dim, hidden, L, n_heads, n_kv = h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"]
    vocab, seq_len, shared = h["vocab_size"], h["seq_len"], h["shared_classifier"]
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim
    shapes = [
        ("embed", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)), ("wk", (L, kv_dim, dim)),
        ("wv", (L, kv_dim, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)), ("w1", (L, hidden, dim)),
        ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)), ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, head_dim // 2)), ("freq_cis_imag", (seq_len, head_dim // 2)),
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    expected = _HEADER.size + 4 * n_floats
    if len(raw) != expected:
        raise ModelFileError(
            f"{path}: size {len(raw)} bytes does not match the header (expected {expected} bytes for "
            f"dim={dim} hidden_dim={hidden} n_layers={L} n_heads={n_heads} n_kv_heads={n_kv} "
            f"vocab_size={vocab} seq_len={seq_len} shared_classifier={shared}): the file is truncated or "
            "corrupt; copy or download it again"
        )
    flat = np.frombuffer(raw, dtype="<f4", offset=_HEADER.size)
    w: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        w[name] = flat[off : off + n].reshape(shape).astype(np.float32)  # copy: own, writable memory
        off += n

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w["embed"]}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = w["rms_att"][i]
        t[p + "self_attn.q_proj.weight"] = interleaved_to_half_rows(w["wq"][i], n_heads)
        t[p + "self_attn.k_proj.weight"] = interleaved_to_half_rows(w["wk"][i], n_kv)
        t[p + "self_attn.v_proj.weight"] = w["wv"][i]
        t[p + "self_attn.o_proj.weight"] = w["wo"][i]
        t[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
        t[p + "mlp.gate_proj.weight"] = w["w1"][i]
        t[p + "mlp.down_proj.weight"] = w["w2"][i]
        t[p + "mlp.up_proj.weight"] = w["w3"][i]
    t["model.norm.weight"] = w["rms_final"]
    if not shared:
        t["lm_head.weight"] = w["wcls"]

    return _hf_config(h), t


def _read_checkpoint_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint not found: {path}")
    return path.read_bytes()


def _header(head: bytes, path: Path) -> dict:
    """The legacy header's fields (``vocab_size`` made positive, ``shared_classifier`` = its sign > 0).

    Raises:
      ModelFileError: too short, a versioned export (magic ``ak42``), or implausible values.
    """
    if len(head) < _HEADER.size:
        raise ModelFileError(
            f"{path}: {len(head)} bytes is too short for a llama2.c header ({_HEADER.size} bytes): the file is "
            "truncated or not a llama2.c checkpoint"
        )
    if struct.unpack_from("<I", head, 0)[0] == _V1_MAGIC:
        raise ModelFileError(
            f"{path} is a llama2.c versioned export (magic 'ak42'); only the legacy format "
            "(export.py --version 0, as published in karpathy/tinyllamas) is supported"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = _HEADER.unpack_from(head, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv:
        raise ModelFileError(
            f"{path}: implausible llama2.c header dim={dim} hidden_dim={hidden} n_layers={n_layers} "
            f"n_heads={n_heads} n_kv_heads={n_kv} vocab_size={vocab} seq_len={seq_len}"
        )
    return {"dim": dim, "hidden_dim": hidden, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv,
            "vocab_size": vocab, "seq_len": seq_len, "shared_classifier": shared}


def _hf_config(h: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h["dim"],
        "intermediate_size": h["hidden_dim"],
        "num_hidden_layers": h["n_layers"],
        "num_attention_heads": h["n_heads"],
        "num_key_value_heads": h["n_kv_heads"],
        "head_dim": h["dim"] // h["n_heads"],
        "vocab_size": h["vocab_size"],
        "max_position_embeddings": h["seq_len"],
        "rms_norm_eps": 1e-5,  # run.c rmsnorm: ss += 1e-5f
        "rope_theta": 10000.0,  # run.c: powf(10000.0f, head_dim / (float)head_size)
        "tie_word_embeddings": h["shared_classifier"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def read_llama2c_config(path: str | Path) -> dict:
    """The Hugging Face config dict of a llama2.c checkpoint from its 28-byte header (the same dict
    :func:`read_llama2c` returns; ``max_position_embeddings`` is the header's ``seq_len``).

    Raises:
      FileNotFoundError: the file does not exist.
      ModelFileError: the header is too short, a versioned export, or implausible.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint not found: {path}")
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    return _hf_config(_header(head, path))


def _read_tok_bin(path: Path) -> tuple[list[bytes], list[float]]:
    """Parse llama2.c ``tok*.bin``: int32 max_token_length, then per token float32 score, int32 len, bytes."""
    raw = path.read_bytes()
    if len(raw) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer file")
    off = 4
    pieces: list[bytes] = []
    scores: list[float] = []
    while off < len(raw):
        if off + 8 > len(raw):
            raise ValueError(f"{path}: truncated token record at byte {off}")
        score, n = struct.unpack_from("<fi", raw, off)
        off += 8
        if n < 0 or off + n > len(raw):
            raise ValueError(f"{path}: token {len(pieces)} has invalid length {n} at byte {off - 4}")
        pieces.append(raw[off : off + n])
        scores.append(score)
        off += n
    return pieces, scores


def _is_byte_piece(p: str) -> bool:
    return len(p) == 6 and p.startswith("<0x") and p.endswith(">")


def llama2c_tokenizer(tok_path: str | Path, model_max_length: int | None = None):
    """Build a Hugging Face fast tokenizer equivalent to llama2.c's ``encode``/``decode``.

    llama2.c (run.c ``encode``) prepends a dummy-prefix space to non-empty text, splits into UTF-8
    characters (unknown characters fall back to ``<0xXX>`` byte tokens, id = byte + 3), then
    repeatedly merges the adjacent pair whose concatenation has the highest vocabulary score. This is
    expressed as a ``tokenizers`` BPE model: pieces with ``" "`` shown as ``"▁"`` (sentencepiece
    convention), byte fallback, and one merge ``(left, right)`` for every split of a vocabulary piece
    into two non-special vocabulary pieces, ranked by the merged piece's score (highest first; ties
    between splits of the same piece: shorter left part first). Normalizer: prepend ``"▁"``, replace
    ``" "`` by ``"▁"``; decoder: ``"▁"`` -> ``" "``, byte fallback, fuse, strip one leading space.

    Args:
      tok_path: llama2.c tokenizer file (``tok512.bin``, ``tokenizer.bin``): int32
        ``max_token_length`` then per token float32 score, int32 byte length, UTF-8 bytes. Ids 0, 1,
        2 are ``<unk>``, ``<s>`` (bos), ``</s>`` (eos); ids 3..258 are the 256 byte tokens.
      model_max_length: optional ``model_max_length`` for the tokenizer (e.g. the checkpoint's seq_len).

    Returns:
      ``transformers.PreTrainedTokenizerFast`` with bos ``<s>`` (1), eos ``</s>`` (2), unk ``<unk>``
      (0), no pad token (see ``jaxrl.models.tokenizer.load_tokenizer``), adding bos on ``encode``.
      Known differences from run.c: text containing a literal ``"▁"`` or literal ``<s>``/``</s>``/
      ``<unk>`` (matched as special tokens here).

    Raises:
      FileNotFoundError: missing file. ValueError: malformed file or unexpected special/byte layout.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    tok_path = Path(tok_path)
    if not tok_path.is_file():
        raise FileNotFoundError(f"llama2.c tokenizer not found: {tok_path}")
    raw_pieces, scores = _read_tok_bin(tok_path)
    if len(raw_pieces) < 259:
        raise ValueError(f"{tok_path}: {len(raw_pieces)} tokens; expected >= 259 (3 specials + 256 bytes)")
    specials = ["<unk>", "<s>", "</s>"]
    # export.py writes bos/eos as "\n<s>\n" / "\n</s>\n" and spaces as " " (sentencepiece "▁").
    pieces = specials + [p.decode("utf-8").replace(" ", "▁") for p in raw_pieces[3:]]
    for i in range(256):
        if pieces[3 + i] != f"<0x{i:02X}>":
            raise ValueError(f"{tok_path}: token {3 + i} is {pieces[3 + i]!r}, expected byte token <0x{i:02X}>")
    vocab = {}
    for i, p in enumerate(pieces):
        if p in vocab:
            raise ValueError(f"{tok_path}: duplicate piece {p!r} at ids {vocab[p]} and {i}")
        vocab[p] = i
    mergeable = {p for i, p in enumerate(pieces) if i >= 3 and not _is_byte_piece(p)}

    ranked = []
    for i, p in enumerate(pieces):
        if p not in mergeable:
            continue
        for k in range(1, len(p)):
            left, right = p[:k], p[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], len(left), i, left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]

    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = None
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, **kwargs,
    )
    return tok
