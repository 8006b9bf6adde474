"""Bad inputs give one clear line, no traceback, and the right exit status (issue 12, items 6 and 7).

Each subprocess case runs ``python -m jaxrl.train`` (the quickstart config with overrides) or
``python -m jaxrl.generate`` on a corrupted copy of the real stories260K model or a tiny jsonl file in
``tmp_path`` and asserts: the exit status (1 a bad file, 2 a bad value), that the last stderr line is the
``jaxrl: error:`` / ``jaxrl: config error:`` line naming the file or key and the fix, and no ``Traceback``.
Every case fails before any compile; the unit tests below check the same errors without a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.paths import REPO_ROOT

TRAIN_BASE = [  # bounded even where old code trained instead of refusing
    "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "trainer.logger=[jsonl]",
]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True,
        timeout=600,
    )


def train(tmp_path: Path, *overrides: str, out: Path | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / "run" if out is None else out
    return _run("jaxrl.train", "--config", "configs/quickstart.yaml", *TRAIN_BASE,
                f"trainer.default_local_dir={out}", *overrides)


def generate(*args: str) -> subprocess.CompletedProcess:
    return _run("jaxrl.generate", *args)


def last_line(proc: subprocess.CompletedProcess, code: int, prefix: str = "jaxrl: error: ") -> str:
    """The one error line: exit ``code``, last stderr line starting with ``prefix``, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and lines[-1].startswith(prefix), proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture
def model_copy(shared, tmp_path) -> Path:
    """A writable copy of the real stories260K model folder (config.json, model.safetensors, tokenizer)."""
    dst = tmp_path / "stories260K"
    shutil.copytree(shared / "models" / "stories260K", dst, ignore=shutil.ignore_patterns("llama2c"))
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def prompts(n: int, text: str = "Once upon a time") -> list[dict]:
    return [{"prompt": text, "data_source": "tinystories/sentiment"} for _ in range(n)]


LONG = "Once upon a time there was a little dog who liked to run in the park. " * 8  # > 64 stories260K tokens


# ------------------------------------------------------------------------------------------ model files
def test_train_truncated_safetensors_names_the_file(model_copy, tmp_path):
    st = model_copy / "model.safetensors"
    st.write_bytes(st.read_bytes()[:50_000])
    line = last_line(train(tmp_path, f"actor_rollout_ref.model.path={model_copy}"), 1)
    assert str(st) in line and "truncated or corrupt" in line and "50000 bytes" in line


def test_generate_garbage_safetensors_names_the_file(model_copy):
    st = model_copy / "model.safetensors"
    st.write_bytes(np.random.default_rng(0).bytes(4096))
    proc = generate("--model", str(model_copy), "--prompt", "", "--max-new-tokens", "4")
    line = last_line(proc, 1)
    assert str(st) in line and "not a readable safetensors file" in line
    assert proc.stdout == ""


def test_garbage_config_json_in_train_and_generate(model_copy, tmp_path):
    (model_copy / "config.json").write_text('{"model_type": "llama", ', encoding="utf-8")
    for proc in (train(tmp_path, f"actor_rollout_ref.model.path={model_copy}"),
                 generate("--model", str(model_copy), "--prompt", "", "--max-new-tokens", "4")):
        line = last_line(proc, 1)
        assert f"{model_copy / 'config.json'}: the model config is not valid JSON" in line


def test_garbage_tokenizer_files_name_the_file(model_copy):
    from jaxrl.models import ModelFileError
    from jaxrl.models.tokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        good = (model_copy / name).read_text(encoding="utf-8")
        (model_copy / name).write_text("garbage{", encoding="utf-8")
        with pytest.raises(ModelFileError, match=re.escape(f"{model_copy / name}: the tokenizer file is not valid")):
            load_tokenizer(str(model_copy))
        (model_copy / name).write_text(good, encoding="utf-8")
    assert load_tokenizer(str(model_copy)).pad_token_id == 2


def _tiny_gguf(path: Path, *, context_length: int = 64) -> Path:
    """A tiny random llama GGUF (vocab 512 = the stories260K tokenizer's, 1 layer) written with the gguf package."""
    import gguf

    h, nh, nkv, d, ffn, v = 16, 2, 1, 8, 32, 512
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (nh * d, h), "blk.0.attn_k.weight": (nkv * d, h),
              "blk.0.attn_v.weight": (nkv * d, h), "blk.0.attn_output.weight": (h, nh * d),
              "blk.0.ffn_gate.weight": (ffn, h), "blk.0.ffn_up.weight": (ffn, h), "blk.0.ffn_down.weight": (h, ffn)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", h)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.attention.head_count", nh)
    w.add_uint32("llama.attention.head_count_kv", nkv)
    w.add_uint32("llama.feed_forward_length", ffn)
    w.add_uint32("llama.context_length", context_length)
    w.add_uint32("llama.vocab_size", v)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, shape in shapes.items():
        w.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_gguf_in_train_and_generate(tmp_path):
    good = _tiny_gguf(tmp_path / "tiny.gguf")
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for proc in (train(tmp_path, f"actor_rollout_ref.model.path={bad}"),
                 generate("--model", str(bad), "--prompt", "", "--max-new-tokens", "4")):
        line = last_line(proc, 1)
        assert f"{bad} is not a readable GGUF file" in line and "truncated" in line


# ------------------------------------------------------------------------------------------- data files
def test_empty_train_file_names_file_and_split(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    line = last_line(train(tmp_path, f"data.train_files={empty}"), 1)
    assert f"data.train_files ({empty}): no rows, the train split is empty" in line


def test_empty_val_file_is_refused_not_skipped(tmp_path):
    """Old code skipped validation silently and trained."""
    empty = tmp_path / "empty_val.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    proc = train(tmp_path, f"data.val_files={empty}")
    line = last_line(proc, 1)
    assert f"data.val_files ({empty}): no rows, the val split is empty" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_all_rows_malformed_names_file_split_and_first_reason(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", ["not json", json.dumps({"question": "no prompt key"})])
    line = last_line(train(tmp_path, f"data.train_files={bad}", "data.skip_malformed=true"), 1)
    assert f"data.train_files ({bad}): all 2 rows are malformed" in line
    assert f"first: {bad}:1: malformed line 1: invalid JSON" in line


def test_all_prompts_filtered_as_overlong(shared, tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", prompts(3, LONG))
    line = last_line(train(tmp_path, f"data.train_files={data}", "data.filter_overlong_prompts=true"), 1)
    assert f"no prompts left in data.train_files ({data}): all 3 are longer than max_prompt_length=64" in line
    longest = int(re.search(r"the longest has (\d+) tokens", line).group(1))
    assert longest > 64 and f"raise data.max_prompt_length (to {longest} keeps them all)" in line


def test_truncation_error_names_file_row_length_and_options(shared, tmp_path):
    data = write_jsonl(tmp_path / "mixed.jsonl", prompts(16) + prompts(1, LONG) + prompts(3))
    line = last_line(train(tmp_path, f"data.train_files={data}", "data.filter_overlong_prompts=false",
                           "data.truncation=error"), 1)
    assert f"data.train_files {data}:17: prompt at dataset index 16 has" in line
    n = int(re.search(r"index 16 has (\d+) tokens > max_prompt_length=64", line).group(1))
    assert n > 64
    for option in ("data.filter_overlong_prompts=true", "data.truncation=left|right", f"data.max_prompt_length>={n}"):
        assert option in line


# --------------------------------------------------------------------------------------- output folder
def test_uncreatable_output_folder_fails_before_the_model_loads(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    out = blocker / "run"
    # the model path does not exist: an error about the folder proves the check ran first
    proc = train(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'no_model'}", out=out)
    line = last_line(proc, 1)
    assert f"trainer.default_local_dir={str(out)!r} cannot be created" in line and "no_model" not in proc.stderr


@pytest.fixture
def readonly_dir(tmp_path):
    """A folder nobody may write: chmod 555 for a normal user; a read-only tmpfs for root (who ignores modes)."""
    d = tmp_path / "readonly"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_read_only_output_folder_fails_before_the_model_loads(readonly_dir, tmp_path):
    for out, what in ((readonly_dir, "is not writable"), (readonly_dir / "run", "cannot be created")):
        proc = train(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'no_model'}", out=out)
        line = last_line(proc, 1)
        assert f"trainer.default_local_dir={str(out)!r} {what}" in line and "no_model" not in proc.stderr


# ------------------------------------------------------------------------------ lengths vs the model
def test_train_lengths_beyond_model_context_refused(shared, tmp_path):
    line = last_line(train(tmp_path, "data.max_prompt_length=500"), 2, "jaxrl: config error: ")
    assert "data.max_prompt_length=500 + data.max_response_length=48 = 548 tokens exceed the model's context of " \
           "512 tokens" in line
    assert str(shared / "models" / "stories260K" / "config.json") in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_gguf_context_refused_after_load(shared, tmp_path):
    """A GGUF's context is read with the model (its metadata parse is as slow as the load), before any compile."""
    folder = tmp_path / "gguf"
    folder.mkdir()
    model = _tiny_gguf(folder / "tiny.gguf", context_length=64)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(shared / "models" / "stories260K" / f, folder / f)
    line = last_line(train(tmp_path, f"actor_rollout_ref.model.path={model}"), 2, "jaxrl: config error: ")
    assert "= 112 tokens exceed the model's context of 64 tokens" in line and str(model) in line


def test_generate_max_new_tokens_beyond_context_refused(shared):
    model = shared / "models" / "stories260K"
    line = last_line(generate("--model", str(model), "--prompt", "", "--max-new-tokens", "100000"), 2)
    assert "--max-new-tokens=100000 plus the prompt exceed the model's context of 512 tokens" in line
    assert str(model / "config.json") in line
    # fits alone, not with the encoded prompt: refused after encoding, before the sampler compiles
    line = last_line(generate("--model", str(model), "--prompt", "Once upon a time", "--max-new-tokens", "510"), 2)
    assert re.search(r"--max-new-tokens=510 \+ the prompt's (\d+) token\(s\) = \d+ exceed", line)
    k = int(re.search(r"prompt's (\d+) token", line).group(1))
    assert f"use --max-new-tokens <= {512 - k}" in line


def test_uneven_mini_batch_gets_a_note_with_the_divisors():
    proc = _run("jaxrl.train", "--config", "configs/quickstart.yaml", "--print-config",
                "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=12", "critic.ppo_micro_batch_size_per_gpu=8")
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "ppo_mini_batch_size=" in ln]
    assert notes == [
        "jaxrl: note: actor_rollout_ref.actor.ppo_mini_batch_size=6: does not divide data.train_batch_size=16: each "
        "step makes 2 update(s) of 6 prompts and a last one of 4 (as verl's FSDP workers do; its Megatron workers "
        "refuse this); for equal updates use one of [1, 2, 4, 8, 16]",
        "jaxrl: note: critic.ppo_mini_batch_size=12: does not divide data.train_batch_size=16: each step makes 1 "
        "update(s) of 12 prompts and a last one of 4 (as verl's FSDP workers do; its Megatron workers refuse this); "
        "for equal updates use one of [1, 2, 4, 8, 16]",
    ]


# ------------------------------------------------------------------------------------------ unit tests
def test_load_split_refuses_empty_and_all_malformed(tmp_path):
    from jaxrl.data.sources import DataFileError, load_split

    empty = tmp_path / "e.jsonl"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(DataFileError, match=re.escape(f"data.val_files ({empty}): no rows, the val split is empty")):
        load_split(str(empty), split="val")
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": ""}, {"prompt": 3}])
    with pytest.raises(DataFileError, match=r"all 2 rows are malformed .* first: .*b\.jsonl:1: .*empty string"):
        load_split(str(bad), split="train", skip_malformed=True)
    with pytest.raises(DataFileError, match=r"^data\.train_files: .*b\.jsonl:1: .*data\.skip_malformed=true"):
        load_split(str(bad), split="train")
    with pytest.raises(FileNotFoundError) as ei:
        load_split(str(tmp_path / "absent.jsonl"), split="train")
    assert "\n" not in str(ei.value) and "jaxrl.data.prepare" in str(ei.value)
    ok = write_jsonl(tmp_path / "ok.jsonl", ["", *[json.dumps(r) for r in prompts(3)]])
    got = load_split([str(ok)], split="train", max_samples=2)
    assert len(got.rows) == 2 and got.origins == [f"{ok}:2", f"{ok}:3"]  # line 1 blank


class _WordTokenizer:
    """Test double: one token per whitespace-separated word (PromptPipeline only calls it on strings)."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] + [7] * len(t.split()) for t in texts]}


def test_pipeline_length_errors_name_file_row_and_limits():
    from jaxrl.data.pipeline import PromptPipeline
    from jaxrl.data.sources import DataFileError

    rows = [{"prompt": "a b"}, {"prompt": "a b c d e f"}, {"prompt": "a"}]
    origins = ["/d/x.jsonl:1", "/d/x.jsonl:2", "/d/y.jsonl:4"]
    with pytest.raises(DataFileError) as ei:
        PromptPipeline(rows, _WordTokenizer(), batch_size=1, max_prompt_length=4, filter_overlong_prompts=False,
                       origins=origins, split="train")
    assert str(ei.value).startswith("data.train_files /d/x.jsonl:2: prompt at dataset index 1 has 7 tokens > "
                                    "max_prompt_length=4 and data.truncation='error'")
    with pytest.raises(DataFileError) as ei:
        PromptPipeline(rows, _WordTokenizer(), batch_size=1, max_prompt_length=1, origins=origins, split="val")
    assert str(ei.value).startswith("no prompts left in data.val_files (/d/x.jsonl, /d/y.jsonl): all 3 are longer "
                                    "than max_prompt_length=1 tokens")
    assert "the longest has 7 tokens" in str(ei.value)
    with pytest.raises(DataFileError, match=r"only 2 prompts in .* batch_size=3 .*1 filtered as overlong"):
        PromptPipeline(rows, _WordTokenizer(), batch_size=3, max_prompt_length=4, origins=origins, split="train")
    with pytest.raises(ValueError, match="origins has 2 entries for 3 rows"):
        PromptPipeline(rows, _WordTokenizer(), batch_size=1, max_prompt_length=4, origins=origins[:2])


def test_ensure_writable_dir(tmp_path):
    from jaxrl.paths import OutputDirError, ensure_writable_dir

    assert ensure_writable_dir(tmp_path / "a" / "b", "k") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []  # probe removed
    f = tmp_path / "f"
    f.write_text("", encoding="utf-8")
    with pytest.raises(OutputDirError, match=re.escape(f"k={str(f)!r} is a file, not a folder; set k to a folder")):
        ensure_writable_dir(f, "k")
    with pytest.raises(OutputDirError, match=r"cannot be created \(Not a directory"):
        ensure_writable_dir(f / "sub", "k")


def test_check_context_length():
    from jaxrl.config import ConfigError, load_config
    from jaxrl.config.loader import check_context_length

    cfg = load_config("configs/quickstart.yaml", [])  # 64 + 48 = 112
    check_context_length(cfg, 112, model="m")
    check_context_length(cfg, None, model="m")  # unknown context: no check
    with pytest.raises(ConfigError, match=r"data.max_response_length=48 = 112 tokens exceed the model's context of "
                                          r"111 tokens \(max_position_embeddings of m\)"):
        check_context_length(cfg, 111, model="m")
    cfg = load_config("configs/quickstart.yaml", ["actor_rollout_ref.rollout.max_new_tokens=16"])
    check_context_length(cfg, 80, model="m")  # generation stops at max_new_tokens
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.max_new_tokens=16 = 80 tokens"):
        check_context_length(cfg, 79, model="m")


def test_model_file_errors_name_the_file(shared, tmp_path):
    from jaxrl.models import ModelFileError, load_pretrained, read_model_config
    from jaxrl.models.hf import load_hf_dir
    from jaxrl.models.llama2c import read_llama2c

    src = shared / "models" / "stories260K"
    cfg, where = read_model_config(str(src / "llama2c" / "stories260K.bin"))  # the header only
    assert cfg["max_position_embeddings"] == 512 and where.endswith("stories260K.bin")
    assert read_model_config(str(_tiny_gguf(tmp_path / "t.gguf")), cheap_only=True) is None
    assert read_model_config(str(tmp_path / "t.gguf"))[0]["max_position_embeddings"] == 64

    short = tmp_path / "short.bin"
    short.write_bytes((src / "llama2c" / "stories260K.bin").read_bytes()[:-4])
    with pytest.raises(ModelFileError, match=re.escape(f"{short}: size")):
        read_llama2c(short)

    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    (d / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}")  # header says 8 bytes, file has 2
    with pytest.raises(ModelFileError, match=re.escape(f"{d / 'model.safetensors'}: not a readable safetensors")):
        load_hf_dir(d)
    (d / "config.json").write_text('["a list"]', encoding="utf-8")
    with pytest.raises(ModelFileError, match="holds a JSON list, expected an object"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}), encoding="utf-8")
    shutil.copy(src / "model.safetensors", d / "model.safetensors")
    with pytest.raises(ModelFileError, match=re.escape(f"{d / 'config.json'}: unsupported model_type 'gpt2'")):
        load_pretrained(str(d), load_tokenizer=False)


def test_generate_context_error_message():
    from jaxrl.generate import context_error

    assert context_error(5, 507, 512, "c") is None and context_error(None, 511, 512, "c") is None
    assert context_error(5, 508, 512, "c") == (
        "--max-new-tokens=508 + the prompt's 5 token(s) = 513 exceed the model's context of 512 tokens "
        "(max_position_embeddings of c); use --max-new-tokens <= 507")
    assert context_error(3, 10, None, "c") is None


def test_a_url_as_the_run_folder_is_refused_without_creating_a_local_folder(tmp_path, monkeypatch):
    from jaxrl.paths import OutputDirError, ensure_writable_dir

    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/run", "s3://b/r"):
        with pytest.raises(OutputDirError, match=re.escape(f"k={url!r} is a URL; the run folder must be a filesystem")):
            ensure_writable_dir(url, "k")
    assert list(tmp_path.iterdir()) == []  # no local "gs:" folder was made
