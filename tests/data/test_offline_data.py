"""SFT and preference rows -> training sequences (verl's SFT datasets, TRL's preference formats) with the real
SmolLM2 (ChatML template) and stories260K (no template) tokenizers; the batches' layout, order and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.config.offline_schema import DPODataConfig, MultiturnConfig, SFTDataConfig
from jaxrl.data.examples import SequenceExample, fit_length
from jaxrl.data.offline import ExampleBatches, collate, iter_batches, sequence_width
from jaxrl.data.preference import build_preference_examples, preference_row_check
from jaxrl.data.sft import build_sft_examples, sft_row_check
from jaxrl.data.sources import DataFileError, LoadedRows, load_split


@pytest.fixture(scope="module")
def smol(shared):
    from jaxrl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(shared / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def stories(shared):
    from jaxrl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(shared / "models/stories260K"))


def _rows(*rows) -> LoadedRows:
    return LoadedRows(list(rows), 0, [], [f"f.jsonl:{i + 1}" for i in range(len(rows))])


def _targets(tok, ex: SequenceExample) -> str:
    return tok.decode(ex.ids[ex.loss_mask == 1].tolist())


def test_sft_prompt_through_the_chat_template_loss_on_the_response(smol):
    d = SFTDataConfig(prompt_key="extra_info", prompt_dict_keys=["question"], response_key="extra_info",
                      response_dict_keys=["answer"], max_length=256)
    row = {"extra_info": {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}}
    (ex,) = build_sft_examples(_rows(row), smol, d, "train")
    head = smol.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                    tokenize=True)["input_ids"]
    assert ex.ids[: len(head)].tolist() == head and ex.loss_mask[: len(head)].sum() == 0
    assert _targets(smol, ex) == "2+3=5\n#### 5<|im_end|>"  # the response and the EOS the model must learn
    assert ex.loss_mask[len(head):].all()


def test_sft_without_a_chat_template_encodes_plain_text(stories):
    d = SFTDataConfig(prompt_key="q", response_key="a", max_length=64)
    (ex,) = build_sft_examples(_rows({"q": "Once upon a time", "a": " there was a dog."}), stories, d, "train")
    assert ex.ids[0] == stories.bos_token_id and ex.ids[-1] == stories.eos_token_id
    assert _targets(stories, ex) == " there was a dog.</s>"


def test_multiturn_loss_on_every_assistant_turn_only(smol):
    d = SFTDataConfig(multiturn=MultiturnConfig(enable=True), max_length=512)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    (ex,) = build_sft_examples(_rows({"messages": messages}), smol, d, "train")
    full = smol.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ex.ids.tolist() == full
    spans = np.flatnonzero(np.diff(np.concatenate([[0], ex.loss_mask, [0]])))  # starts and ends of the target runs
    turns = [smol.decode(ex.ids[a:b].tolist()) for a, b in zip(spans[::2], spans[1::2])]
    assert turns == ["Hello!<|im_end|>\n", "4<|im_end|>\n"]


def test_a_template_that_is_not_prefix_consistent_is_refused(smol):
    d = SFTDataConfig(multiturn=MultiturnConfig(enable=True), max_length=512)
    reverse = "{% for m in messages|reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    saved = smol.chat_template
    smol.chat_template = reverse
    try:
        with pytest.raises(DataFileError, match="f.jsonl:1: the chat template does not render this conversation "
                                                "prefix-consistently"):
            build_sft_examples(_rows({"messages": [{"role": "user", "content": "a"},
                                                   {"role": "assistant", "content": "b"}]}), smol, d, "train")
    finally:
        smol.chat_template = saved


def test_lengths_error_left_right_and_filter(stories):
    ex = SequenceExample.of([1, 5, 6, 7], [8, 9, 10])
    with pytest.raises(DataFileError, match="a sequence of 7 tokens > data.max_length=5 and data.truncation='error'"):
        fit_length(ex, 5, "error", "x")
    left, right = fit_length(ex, 5, "left", "x"), fit_length(ex, 5, "right", "x")
    assert left.ids.tolist() == [6, 7, 8, 9, 10] and left.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert right.ids.tolist() == [1, 5, 6, 7, 8] and right.loss_mask.tolist() == [0, 0, 0, 0, 1]
    d = SFTDataConfig(prompt_key="q", response_key="a", max_length=8, filter_overlong=True)
    rows = _rows({"q": "Once", "a": " upon"}, {"q": "Once upon a time there was", "a": " a big dog in a park."})
    assert len(build_sft_examples(rows, stories, d, "train")) == 1


def test_row_checks_name_what_is_missing(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"extra_info": {"question": "q"}}) + "\n")
    d = SFTDataConfig(prompt_key="extra_info", prompt_dict_keys=["question"], response_key="extra_info",
                      response_dict_keys=["answer"])
    with pytest.raises(DataFileError, match=r"rows.jsonl:1: malformed line 1: missing 'extra_info.answer' \(has "
                                            r"\['question'\]\)"):
        load_split(str(path), split="train", row_check=sft_row_check(d))
    p = DPODataConfig()
    path.write_text(json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    with pytest.raises(DataFileError, match="missing 'rejected'"):
        load_split(str(path), split="train", row_check=preference_row_check(p))


def test_preference_formats(smol, stories):
    d = DPODataConfig(max_length=256)
    # standard: text prompt (+ BOS), text responses + EOS, loss on the responses
    (c, r), = build_preference_examples(_rows({"prompt": "Once upon", "chosen": " a smile.", "rejected": " a tear."}),
                                        stories, d, "train")
    assert c.ids[0] == stories.bos_token_id and c.ids[-1] == stories.eos_token_id
    n = int(np.argmax(c.loss_mask))
    assert c.ids[:n].tolist() == r.ids[:n].tolist()  # the shared prompt
    # conversational and implicit prompt give the same sequences
    prompt = [{"role": "user", "content": "Say hi"}]
    conv = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Hi!"}],
            "rejected": [{"role": "assistant", "content": "No."}]}
    implicit = {"chosen": prompt + conv["chosen"], "rejected": prompt + conv["rejected"]}
    as_text = {"prompt": prompt, "chosen": "Hi!", "rejected": "No."}
    out = build_preference_examples(_rows(conv, implicit, as_text), smol, d, "train")
    for pair in out[1:]:
        for a, b in zip(pair, out[0]):
            assert a.ids.tolist() == b.ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert _targets(smol, out[0][0]) == "Hi!<|im_end|>\n" and _targets(smol, out[0][1]) == "No.<|im_end|>\n"
    check = preference_row_check(d)
    assert "share no leading messages" in check({"chosen": [{"role": "assistant", "content": "a"}],
                                                 "rejected": [{"role": "assistant", "content": "b"}]})


def test_collate_layout_and_batches_resume():
    items = [SequenceExample.of([1, 4], list(range(10, 10 + k))) for k in range(1, 13)]
    width = sequence_width([len(x) for x in items], max_length=64, multiple=8)
    assert width == 16
    batch = collate(items[:2], width)
    assert batch.prompt_ids.tolist() == [[1], [1]] and batch.response_ids.shape == (2, 15)
    assert batch.response_ids[1, :3].tolist() == [4, 10, 11] and batch.response_mask[1, :4].tolist() == [0, 1, 1, 0]
    assert batch.attention_mask()[1].sum() == len(items[1])

    def run(resume_at=None):
        b = ExampleBatches(items, batch_size=5, width=width, shuffle=True, seed=3)
        out = []
        for step in range(6):
            if step == resume_at:
                state = b.get_state()
                b = ExampleBatches(items, batch_size=5, width=width, shuffle=True, seed=3)
                b.set_state(state)
            out.append(b.next_batch().response_ids.tolist())
        return out, b.epoch

    straight, epoch = run()
    assert run(resume_at=3)[0] == straight and epoch == 2  # 12 items / 5 = 2 batches per epoch (drop_last)
    assert straight[0] != straight[2]  # a new order in the next epoch
    assert [b.size for b in iter_batches(items, 5, width)] == [5, 5, 2]
