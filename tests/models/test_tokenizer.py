"""load_tokenizer dispatch (HF folder, GGUF, llama2.c) and resolve_model_path (local, alias, hub id; offline)."""

from __future__ import annotations

import os

import pytest

from jaxrl.models.resolve import resolve_model_path
from jaxrl.models.tokenizer import load_tokenizer

TEXT = "Once upon a time, there was a little girl named Lily. She said: \"héllo 🤗\"\n\nThe end."


def test_stories260k_folder_and_llama2c_bin_agree(shared):
    s260 = shared / "models" / "stories260K"
    folder = load_tokenizer(str(s260))
    from_bin = load_tokenizer(str(s260 / "llama2c" / "stories260K.bin"))  # finds tok512.bin beside it
    for tok in (folder, from_bin):
        # tokenizer_config.json has pad_token null -> falls back to eos
        assert (tok.pad_token, tok.pad_token_id) == ("</s>", 2)
        assert tok.bos_token_id == 1 and tok.chat_template is None
    assert from_bin.model_max_length == 512  # the checkpoint header's seq_len
    ids = folder.encode(TEXT)
    assert ids[0] == 1 and from_bin.encode(TEXT) == ids
    assert folder.decode(ids, skip_special_tokens=True) == TEXT
    tok_file = load_tokenizer(str(s260 / "llama2c" / "tok512.bin"))  # the tokenizer file itself
    assert tok_file.encode(TEXT) == ids


def test_qwen3_folder_chat_template(shared):
    tok = load_tokenizer(str(shared / "tokenizers" / "qwen3"))
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643  # defined by the files, kept
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode(text)) == text


def test_gguf_file_and_metadata_fallback(shared, tmp_path):
    gguf_path = shared / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(str(gguf_path))  # uses tokenizer.json beside the file
    assert tok.pad_token_id == 2 and tok.eos_token == "<|im_end|>"
    # Without tokenizer.json beside it, the tokenizer is rebuilt from the GGUF metadata and must agree.
    (tmp_path / gguf_path.name).symlink_to(gguf_path)
    meta = load_tokenizer(str(tmp_path / gguf_path.name))
    assert meta.pad_token_id == 2 and meta.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for text in (TEXT, "  spaces\tand\ttabs  ", "def f(x):\n    return x**2  # 日本"):
        assert meta.encode(text) == tok.encode(text)
    assert meta.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    # A folder holding just the GGUF file resolves to it too.
    assert load_tokenizer(str(tmp_path)).encode(TEXT) == tok.encode(TEXT)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json / tokenizer_config\.json"):
        load_tokenizer(str(tmp_path))
    ckpt = tmp_path / "model.bin"
    ckpt.write_bytes(b"\0" * 28)
    with pytest.raises(FileNotFoundError, match=r"tok\*\.bin"):
        load_tokenizer(str(ckpt))


# ------------------------------------------------------------------------------------------- resolve
@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """No network: HF_HUB_OFFLINE=1 and an empty hub cache."""
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def test_resolve_local_paths(shared, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_SHARED", str(shared))
    s260 = str(shared / "models" / "stories260K")
    assert resolve_model_path(s260) == s260
    assert resolve_model_path("${JAXRL_SHARED}/models/stories260K") == s260
    assert resolve_model_path("$JAXRL_SHARED/models/stories260K") == s260
    for alias in ("stories260K", "STORIES260k"):
        assert resolve_model_path(alias) == s260
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert resolve_model_path("~/m") == str(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir" / "x.gguf"))


def test_resolve_alias_offline_names_both_options(monkeypatch, tmp_path, offline_hub):
    empty = tmp_path / "empty-shared"
    empty.mkdir()
    monkeypatch.setenv("JAXRL_SHARED", str(empty))
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model_path("stories260K")
    msg = str(ei.value)
    assert "JAXRL_SHARED" in msg and "models/stories260K" in msg
    assert "karpathy/tinyllamas" in msg and "Hub error: LocalEntryNotFoundError" in msg


def test_resolve_alias_downloads_from_hub(monkeypatch, tmp_path):
    """Without the shared folder the alias fetches the two llama2.c files and returns the .bin path."""
    import huggingface_hub

    monkeypatch.setenv("JAXRL_SHARED", str(tmp_path / "nothing-here"))
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename))
        p = tmp_path / "snap" / filename
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        return str(p)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    got = resolve_model_path("stories260k")
    assert calls == [("karpathy/tinyllamas", "stories260K/stories260K.bin"),
                     ("karpathy/tinyllamas", "stories260K/tok512.bin")]
    assert got == str(tmp_path / "snap" / "stories260K" / "stories260K.bin")


def test_resolve_hub_id_offline(offline_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "Qwen/Qwen3-0.6B" is not an existing relative path
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model_path("Qwen/Qwen3-0.6B")
    msg = str(ei.value)
    assert "'Qwen/Qwen3-0.6B'" in msg and "hub" in msg and "local" in msg
    # An existing relative folder with the same shape wins over the hub.
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert os.path.isdir(resolve_model_path("Qwen/Qwen3-0.6B"))


_NO_TORCH_PROBE = """
import json, sys
from jaxrl.models.tokenizer import load_tokenizer
toks = {name: load_tokenizer(path) for name, path in json.loads(sys.argv[1]).items()}
print(json.dumps({"torch": "torch" in sys.modules,
                  "types": {n: type(t).__name__ for n, t in toks.items()},
                  "ids": {n: t("Natalia sold 48 clips in April; #### 72")["input_ids"] for n, t in toks.items()}}))
"""


def test_folders_naming_their_class_load_the_autotokenizer_class_without_torch(shared):
    """A tokenizer folder whose tokenizer_config.json names its class loads that class directly: the same class and
    ids as AutoTokenizer, and torch (which AutoTokenizer's import pulls in, 0.19 GB resident) stays unimported."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    paths = {"qwen3": str(shared / "tokenizers" / "qwen3"),
             "smollm2_gguf": str(shared / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")}
    out = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, json.dumps(paths)], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    for name, folder in (("qwen3", paths["qwen3"]), ("smollm2_gguf", str(shared / "models" / "smollm2-135m-instruct"))):
        auto = AutoTokenizer.from_pretrained(folder)
        assert got["types"][name] == type(auto).__name__
        assert got["ids"][name] == auto("Natalia sold 48 clips in April; #### 72")["input_ids"]
