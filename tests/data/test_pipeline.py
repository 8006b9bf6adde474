"""PromptPipeline + row sources on real data: prepared GSM8K parquet with the SmolLM2 tokenizer, and the
packaged story prompts with the stories260K tokenizer."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from jaxrl.data import (
    LoadedRows,
    PromptPipeline,
    load_rows,
    load_rows_report,
    prepare,
    resolve_data_path,
)


@pytest.fixture(scope="module")
def smol(shared):
    return AutoTokenizer.from_pretrained(str(shared / "models/smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def stories_tok(shared):
    return AutoTokenizer.from_pretrained(str(shared / "models/stories260K"))


@pytest.fixture(scope="module")
def gsm8k_dir(shared, tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    prepare.main(["gsm8k", "--input", str(shared / "data/gsm8k"), "--output", str(out)])
    return out


@pytest.fixture(scope="module")
def rows(gsm8k_dir):
    return load_rows(str(gsm8k_dir / "test.parquet"))[:101]


def _template_ids(tok, row):
    return tok.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _drain(p, k):
    return [p.next_batch() for _ in range(k)]


def test_full_gsm8k_construction_time_and_ids(gsm8k_dir, smol):
    rows = load_rows(str(gsm8k_dir / "train.parquet"))
    t0 = time.perf_counter()
    p = PromptPipeline(rows, smol, batch_size=32, max_prompt_length=512)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0, f"construction took {elapsed:.1f} s for {len(rows)} rows"
    assert p.num_rows == 7473 and p.num_filtered == 0 and p.steps_per_epoch == 7473 // 32
    b = p.next_batch()
    assert len(b) == 32 and len(set(b.indices)) == 32
    for ids, row, i in zip(b.prompt_ids, b.rows, b.indices):
        assert row == rows[i]
        assert ids == _template_ids(smol, rows[i])
        assert ids[0] == smol.convert_tokens_to_ids("<|im_start|>")
    assert (
        b.rows[0]["reward_model"]["ground_truth"] == rows[b.indices[0]]["reward_model"]["ground_truth"]
    )


def test_filter_overlong(rows, smol):
    lengths = [len(_template_ids(smol, r)) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    p = PromptPipeline(rows, smol, batch_size=4, max_prompt_length=limit, shuffle=False, drop_last=False)
    expected = [i for i, n in enumerate(lengths) if n <= limit]
    assert p.num_filtered == len(rows) - len(expected) > 0
    seen = [i for b in p.iter_batches_once() for i in b.indices]
    assert seen == expected


def test_truncation_modes(rows, smol):
    lengths = [len(_template_ids(smol, r)) for r in rows]
    limit = min(lengths) + 5
    first_long = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(
        ValueError,
        match=rf"dataset index {first_long} has {lengths[first_long]} tokens > max_prompt_length={limit}",
    ):
        PromptPipeline(rows, smol, batch_size=4, max_prompt_length=limit, filter_overlong_prompts=False)
    full = _template_ids(smol, rows[first_long])
    for mode, want in (("left", full[-limit:]), ("right", full[:limit])):
        p = PromptPipeline(
            rows,
            smol,
            batch_size=len(rows),
            max_prompt_length=limit,
            filter_overlong_prompts=False,
            truncation=mode,
            shuffle=False,
        )
        b = p.next_batch()
        assert p.num_filtered == 0
        assert b.prompt_ids[b.indices.index(first_long)] == want
        assert all(len(x) <= limit for x in b.prompt_ids)


def test_bad_arguments(rows, smol):
    with pytest.raises(ValueError, match=r"truncation='middle'.*\('error', 'left', 'right'\)"):
        PromptPipeline(rows, smol, batch_size=4, max_prompt_length=64, truncation="middle")
    with pytest.raises(ValueError, match="no prompts left"):
        PromptPipeline(rows, smol, batch_size=4, max_prompt_length=3)
    with pytest.raises(ValueError, match="batch_size=500"):
        PromptPipeline(rows, smol, batch_size=500, max_prompt_length=1024)
    with pytest.raises(ValueError, match="no prompt_key='question'"):
        PromptPipeline(rows, smol, batch_size=4, max_prompt_length=1024, prompt_key="question")


def test_shuffle_order(rows, smol):
    def make(seed, **kw):
        return PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024, seed=seed, **kw)

    a, b, c = make(1), make(1), make(2)
    assert a.steps_per_epoch == 10  # 101 rows, drop_last
    ea = [_drain(a, 10) for _ in range(3)]
    eb = [_drain(b, 10) for _ in range(3)]
    idx = [[i for batch in ep for i in batch.indices] for ep in ea]
    assert idx == [[i for batch in ep for i in batch.indices] for ep in eb]  # same seed, same order
    assert idx[0] != idx[1] and idx[1] != idx[2]  # reshuffled each epoch
    assert all(len(set(e)) == 100 for e in idx)  # no repeats within an epoch
    assert [bt.epoch for bt in ea[2]] == [2] * 10 and a.epoch == 2
    assert [i for bt in _drain(c, 10) for i in bt.indices] != idx[0]  # other seed, other order
    assert idx[0] != sorted(idx[0])

    full = make(1, drop_last=False)
    assert full.steps_per_epoch == 11
    for _ in range(2):
        ep = _drain(full, 11)
        assert [len(bt) for bt in ep] == [10] * 10 + [1]
        assert sorted(i for bt in ep for i in bt.indices) == list(range(101))  # every row once

    fixed = make(1, shuffle=False)
    assert [i for bt in _drain(fixed, 10) for i in bt.indices] == list(range(100))


@pytest.mark.parametrize("consumed", [3, 10, 14, 20])  # mid-epoch, at / past epoch boundaries
def test_state_resume(rows, smol, consumed):
    def make():
        return PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024, seed=7)

    ref = make()
    expected = [bt.indices for bt in _drain(ref, consumed + 15)][consumed:]
    a = make()
    _drain(a, consumed)
    state = json.loads(json.dumps(a.get_state()))
    b = make()
    b.set_state(state)
    got = _drain(b, 15)
    assert [bt.indices for bt in got] == expected
    assert got[0].prompt_ids == [ref._kept.ids[i] for i in expected[0]]  # index == kept position here
    assert b.global_step == consumed + 15


def test_state_mismatch_rejected(rows, smol):
    p = PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024, seed=7)
    q = PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024, seed=8)
    with pytest.raises(ValueError, match="seed: saved 7, now 8"):
        q.set_state(p.get_state())
    with pytest.raises(ValueError, match="step_in_epoch"):
        p.set_state({**p.get_state(), "step_in_epoch": 99})


def test_iter_batches_once_leaves_training_position(rows, smol):
    p = PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024)
    first = p.next_batch()
    val = list(p.iter_batches_once(batch_size=32))
    assert [len(b) for b in val] == [32, 32, 32, 5]
    assert [i for b in val for i in b.indices] == list(range(101))
    p2 = PromptPipeline(rows, smol, batch_size=10, max_prompt_length=1024)
    assert p2.next_batch().indices == first.indices
    assert p.next_batch().indices == p2.next_batch().indices
    with pytest.raises(ValueError, match="batch_size"):
        p.iter_batches_once(0)


def test_story_prompts_with_stories260k(stories_tok):
    tok = stories_tok
    rows = load_rows("jaxrl://story_prompts.jsonl")
    assert len(rows) >= 100
    assert {r["data_source"] for r in rows} == {"tinystories/sentiment"}
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    p = PromptPipeline(rows, tok, batch_size=16, max_prompt_length=128)
    assert p.num_filtered == 0
    b = p.next_batch()
    for ids, i in zip(b.prompt_ids, b.indices):
        assert ids[0] == 1  # BOS
        assert ids == tok(rows[i]["prompt"]).input_ids
        assert tok.decode(ids[1:]) == rows[i]["prompt"]


def test_messages_without_chat_template_are_joined(stories_tok):
    tok = stories_tok
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Lily is happy."},
                {"role": "user", "content": "Tom is sad."},
            ]
        }
    ]
    p = PromptPipeline(rows, tok, batch_size=1, max_prompt_length=64)
    assert p.next_batch().prompt_ids == [tok("Lily is happy.\nTom is sad.").input_ids]
    with pytest.raises(ValueError, match="no chat_template"):
        PromptPipeline(rows, tok, batch_size=1, max_prompt_length=64, apply_chat_template=True)


def test_malformed_rows(tmp_path):
    f = tmp_path / "d.jsonl"
    good = {"prompt": "Once upon a time", "data_source": "tinystories/sentiment"}
    lines = [
        json.dumps(good),
        json.dumps(good),
        "{not json",
        "",
        json.dumps({"text": "no prompt"}),
        json.dumps(good),
    ]
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:3: malformed line 3: invalid JSON"):
        load_rows(str(f))
    f2 = tmp_path / "e.jsonl"
    f2.write_text("\n".join([json.dumps(good), json.dumps({"text": "x"})]) + "\n")
    with pytest.raises(ValueError, match=r"e\.jsonl:2: .*missing 'prompt'"):
        load_rows(str(f2))
    rep = load_rows_report(str(f), skip_malformed=True)
    assert isinstance(rep, LoadedRows)
    assert rep.num_skipped == 2 and len(rep.rows) == 3
    assert rep.skipped[0].endswith(
        "invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    )
    assert ":5:" in rep.skipped[1]
    assert load_rows([str(f), str(f)], skip_malformed=True) == [good] * 6


def test_resolve_data_path(tmp_path, monkeypatch):
    (tmp_path / "present.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"absent\.parquet.*contains: \[present\.jsonl\]"):
        resolve_data_path(str(tmp_path / "absent.parquet"))
    with pytest.raises(FileNotFoundError, match=r"jaxrl://nope\.jsonl.*story_prompts\.jsonl"):
        resolve_data_path("jaxrl://nope.jsonl")
    monkeypatch.setenv("JAXRL_SHARED", str(tmp_path))
    assert resolve_data_path("${JAXRL_SHARED}/present.jsonl") == (tmp_path / "present.jsonl").resolve()
    assert resolve_data_path("jaxrl://story_prompts.jsonl").name == "story_prompts.jsonl"
