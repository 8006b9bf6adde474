"""Load the tokenizer that belongs to a model path (HF folder, GGUF file, or llama2.c checkpoint).

Padding convention: every tokenizer returned by :func:`load_tokenizer` has ``pad_token_id`` set. When the
files define no pad token, the eos token is used as pad (the usual choice for decoder-only models; the
attention mask, not the pad id, keeps pad positions out of attention and losses), else unk.

Chat template: kept exactly as the files define it; ``tokenizer.chat_template`` is ``None`` when there is
none (e.g. llama2.c TinyStories models), and callers then encode raw text.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from jaxrl.models.files import ModelFileError

__all__ = ["load_tokenizer", "ensure_pad_token"]

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ensure_pad_token(tok):
    """Set ``tok.pad_token`` to its eos token (else unk) when it has none; returns ``tok``.

    Raises:
      ValueError: the tokenizer has neither pad, eos nor unk token.
    """
    if tok.pad_token_id is None:
        fallback = tok.eos_token if tok.eos_token_id is not None else tok.unk_token
        if fallback is None:
            raise ValueError(f"tokenizer {type(tok).__name__} has no pad, eos or unk token to pad with")
        tok.pad_token = fallback
    return tok


def _count_tokens(tok_bin: Path) -> int | None:
    """Number of entries in a llama2.c tokenizer file, or None when it does not parse."""
    raw = tok_bin.read_bytes()
    off, n = 4, 0
    while off + 8 <= len(raw):
        length = struct.unpack_from("<i", raw, off + 4)[0]
        if length < 0:
            return None
        off += 8 + length
        n += 1
    return n if off == len(raw) else None


def _llama2c_header(ckpt: Path) -> tuple[int, int] | None:
    """(vocab_size, seq_len) from a legacy llama2.c checkpoint header, or None."""
    with open(ckpt, "rb") as f:
        head = f.read(28)
    if len(head) < 28:
        return None
    vals = struct.unpack("<7i", head)
    return abs(vals[5]), vals[6]


def _llama2c_tokenizer_beside(ckpt: Path):
    from jaxrl.models.llama2c import llama2c_tokenizer

    candidates = [ckpt.parent / "tokenizer.bin"] + sorted(ckpt.parent.glob("tok*.bin"))
    candidates = list(dict.fromkeys(c for c in candidates if c.is_file() and c.resolve() != ckpt.resolve()))
    if not candidates:
        raise FileNotFoundError(
            f"no llama2.c tokenizer beside {ckpt}: looked for {ckpt.parent / 'tokenizer.bin'} and "
            f"{ckpt.parent / 'tok*.bin'}"
        )
    header = _llama2c_header(ckpt)
    if header is not None:
        vocab, seq_len = header
        matching = [c for c in candidates if _count_tokens(c) == vocab]
        if not matching:
            raise FileNotFoundError(
                f"no llama2.c tokenizer beside {ckpt} has the checkpoint's {vocab} tokens "
                f"(candidates: {[c.name for c in candidates]})"
            )
        return llama2c_tokenizer(matching[0], model_max_length=seq_len)
    return llama2c_tokenizer(candidates[0])


def tokenizer_class(folder: Path):
    """The transformers class ``folder/tokenizer_config.json`` names (``tokenizer_class``), looked up as
    ``AutoTokenizer`` resolves it (``<name>Fast`` first, then ``<name>``), or None: no such file or key, a remote-code
    tokenizer (``auto_map``), or a name transformers does not export.

    Why not ``AutoTokenizer``: importing it imports transformers' model configuration code and with it torch, 0.19 GB
    resident in a process that never runs torch (measured: RSS 0.21 -> 0.40 GB); the named class alone does not.
    """
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name or "auto_map" in config:
        return None
    import transformers

    for candidate in (name,) if name.endswith("Fast") else (name + "Fast", name):
        try:
            cls = getattr(transformers, candidate, None)
        except Exception:  # noqa: BLE001 - a lazily imported module that fails to import: AutoTokenizer decides
            cls = None
        if isinstance(cls, type):
            return cls
    return None


def hf_tokenizer(folder: Path):
    """``<tokenizer_config's class>.from_pretrained(folder)`` (:func:`tokenizer_class`), else
    ``AutoTokenizer.from_pretrained(folder)``: the same tokenizer either way, without importing torch when the
    folder names its class. Errors are transformers' own."""
    cls = tokenizer_class(folder)
    if cls is not None:
        return cls.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _auto_tokenizer(folder: Path):
    """:func:`hf_tokenizer` (``AutoTokenizer``'s choice); a tokenizer file it cannot parse is a
    :class:`ModelFileError`."""
    try:
        return hf_tokenizer(folder)
    except Exception as e:  # the Rust `tokenizers` parser raises a bare Exception on a garbage tokenizer.json
        bad = _first_invalid_json(folder)
        if bad is None:
            raise  # not a file-format problem: keep transformers' own error (and traceback)
        raise ModelFileError(
            f"{bad}: the tokenizer file is not valid JSON ({type(e).__name__}: {' '.join(str(e).split())}); "
            "restore the tokenizer files from the model's source or set actor_rollout_ref.model.tokenizer_path"
        ) from e


def _first_invalid_json(folder: Path) -> Path | None:
    """The first of the folder's tokenizer JSON files that does not parse, or None."""
    for name in (*_HF_TOKENIZER_FILES, "special_tokens_map.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f
    return None


def load_tokenizer(path: str):
    """Load the tokenizer for a model path and make sure it has a pad token.

    Args:
      path: one of
        * a folder with ``tokenizer.json`` and/or ``tokenizer_config.json`` -> ``AutoTokenizer.from_pretrained``;
        * a ``.gguf`` file -> :func:`jaxrl.models.gguf.gguf_tokenizer` (``tokenizer.json`` beside it, else
          the GGUF metadata);
        * a llama2.c ``.bin`` checkpoint -> :func:`jaxrl.models.llama2c.llama2c_tokenizer` on the
          ``tokenizer.bin`` / ``tok*.bin`` beside it whose token count equals the checkpoint's vocab;
        * a llama2.c tokenizer file itself (``tokenizer.bin``, ``tok*.bin``);
        * a folder without HF tokenizer files that holds exactly one ``.gguf`` file, or a llama2.c
          tokenizer file.
      Callers resolve aliases/hub ids first (``jaxrl.models.resolve.resolve_model_path``).

    Returns:
      ``transformers.PreTrainedTokenizerBase`` (a fast tokenizer) with ``pad_token_id`` set (see module
      docstring for the fallback).

    Raises:
      FileNotFoundError: ``path`` does not exist or no tokenizer is found; the message lists what was
        looked for.
      ModelFileError: the folder's tokenizer files exist but cannot be parsed (names the folder).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {p}")
    if p.is_dir():
        if any((p / f).is_file() for f in _HF_TOKENIZER_FILES):
            return ensure_pad_token(_auto_tokenizer(p))
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_tokenizer(str(ggufs[0]))
        tok_bins = [c for c in [p / "tokenizer.bin", *sorted(p.glob("tok*.bin"))] if c.is_file()]
        if tok_bins:
            return load_tokenizer(str(tok_bins[0]))
        raise FileNotFoundError(
            f"no tokenizer in folder {p}: looked for {' / '.join(_HF_TOKENIZER_FILES)}, a single *.gguf "
            f"file (found {len(ggufs)}), or a llama2.c tokenizer.bin / tok*.bin"
        )
    if p.suffix == ".gguf":
        from jaxrl.models.gguf import gguf_tokenizer

        return ensure_pad_token(gguf_tokenizer(p))
    if p.suffix == ".bin":
        if p.name == "tokenizer.bin" or p.name.startswith("tok"):
            from jaxrl.models.llama2c import llama2c_tokenizer

            return ensure_pad_token(llama2c_tokenizer(p))
        return ensure_pad_token(_llama2c_tokenizer_beside(p))
    raise FileNotFoundError(
        f"cannot find a tokenizer for {p}: expected a folder with {' / '.join(_HF_TOKENIZER_FILES)}, a .gguf "
        "file, or a llama2.c .bin checkpoint with tokenizer.bin / tok*.bin beside it"
    )
