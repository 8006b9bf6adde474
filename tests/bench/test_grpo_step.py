"""The pure pieces of the GRPO step benchmark (bench/grpo_step.py, bench/workload.py, bench/peers/*): the workloads'
prompts, the per-token column, the goal lines, the peers' overrides and token counts. No framework runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import grpo_step as G
from bench import workload as W
from bench.peers import jaxrl_grpo as J
from bench.peers import trl_grpo as T
from bench.peers import tunix_grpo as X

INSTR = ' Let\'s think step by step and output the final answer after "####".'


def _write_gsm8k(path: Path, questions: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    return path


# --- prompts ---------------------------------------------------------------------------------------------------

def test_gsm8k_messages_real_file(shared):
    msgs = W.gsm8k_messages()
    assert len(msgs) == W.NUM_PROMPTS == 8
    first = json.loads((shared / "data" / "gsm8k" / "train.jsonl").open().readline())["question"]
    assert msgs[0] == [{"role": "user", "content": first + INSTR}]
    assert msgs[0][0]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert len({m[0]["content"] for m in msgs}) == 8  # the first 8 rows, not one row repeated
    assert W.GSM8K.prompts() == msgs


def test_gsm8k_messages_order_count_and_shared_env(tmp_path, monkeypatch):
    _write_gsm8k(tmp_path / "data" / "gsm8k" / "train.jsonl", [f"q{i}?" for i in range(5)])
    monkeypatch.setenv("JAXRL_SHARED", str(tmp_path))
    assert W.shared_dir() == tmp_path.resolve()
    assert [m[0]["content"] for m in W.gsm8k_messages(3)] == [f"q{i}?" + INSTR for i in range(3)]
    with pytest.raises(ValueError, match="has 5 rows; the workload needs 8"):
        W.gsm8k_messages()
    monkeypatch.setenv("JAXRL_SHARED", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="JAXRL_SHARED"):
        W.gsm8k_messages(3)


def test_gsm8k_messages_rejects_a_row_without_question(tmp_path):
    f = _write_gsm8k(tmp_path / "t.jsonl", ["ok?", None])
    with pytest.raises(ValueError, match="row 1 has no text 'question'"):
        W.gsm8k_messages(2, f)


def test_workloads():
    assert W.get("fixed") is W.FIXED and W.get("gsm8k") is W.GSM8K
    with pytest.raises(ValueError, match="unknown workload"):
        W.get("math")
    assert (W.FIXED.response_length, W.FIXED.max_prompt_length, W.FIXED.exact_length) == (32, 64, True)
    assert (W.GSM8K.response_length, W.GSM8K.max_prompt_length, W.GSM8K.exact_length) == (128, 256, False)
    assert W.FIXED.prompts() == W.prompts() and isinstance(W.FIXED.prompts()[0], str)
    assert W.FIXED.max_response_tokens() == 32 * 32 and W.GSM8K.max_response_tokens() == 32 * 128


# --- the per-token column and summaries -------------------------------------------------------------------------

def test_per_1k_tokens_is_per_step_then_median():
    steps = [{"total_s": 2.0, "response_tokens": 4000}, {"total_s": 3.0, "response_tokens": 1000},
             {"total_s": 1.0, "response_tokens": 1000}]
    s = G.per_1k_tokens(steps)  # per step: 0.5, 3.0, 1.0 (not 6 s / 6000 tokens = 1.0 as a ratio of sums)
    assert s == {"median": 1.0, "min": 0.5, "max": 3.0, "n": 3}
    assert G.per_1k_tokens(steps[:2])["median"] == pytest.approx(1.75)
    assert G.per_1k_tokens([{"total_s": 1.0, "response_tokens": None}]) is None
    assert G.per_1k_tokens([]) is None


def _result(tokens: list[int], total: list[float]) -> dict:
    return {"steps": [{"step": i, "total_s": t, "gen_s": 1.0, "logprob_s": None, "update_s": 1.0,
                       "response_tokens": n} for i, (n, t) in enumerate(zip(tokens, total))]}


def test_summarize_ragged_drops_warmup_and_adds_per_token():
    res = _result([4096, 3000, 2000, 1000], [99.0, 3.0, 3.0, 2.0])
    s = G.summarize(res, 4, W.GSM8K)
    assert s["phases"]["total_s"]["median"] == 3.0 and s["response_tokens"]["median"] == 2000
    assert s["s_per_1k_tokens"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 3}
    assert s["warnings"] == []  # ragged counts under the cap are the workload
    over = G.summarize(_result([10, 4097], [1.0, 1.0]), 2, W.GSM8K)
    assert over["warnings"] == ["response tokens/step 4097-4097, workload allows 1-4096"]


def test_summarize_fixed_unchanged():
    s = G.summarize(_result([1024, 1024, 1000], [9.0, 2.0, 4.0]), 3)
    assert "s_per_1k_tokens" not in s
    assert s["warnings"] == ["response tokens/step 1000-1024, workload is 1024"]
    assert G.summarize(_result([1024] * 3, [9.0, 2.0, 4.0]), 3)["warnings"] == []


# --- goal lines and the table ----------------------------------------------------------------------------------

def _rec(fw: str, step_s: float | None, per_1k: float | None = None) -> dict:
    rec = {"framework": fw, "label": G.FRAMEWORKS[fw].label, "error": None, "version": "v", "notes": [],
           "warnings": [], "response_tokens": {"median": 1000.0, "min": 1000.0, "max": 1000.0, "n": 1}}
    if step_s is None:
        rec["error"] = "boom\n(log: x)"
        return rec
    st = {"median": step_s, "min": step_s, "max": step_s, "n": 1}
    rec["phases"] = {k: st if k == "total_s" else None for k, _ in G.PHASES}
    if per_1k is not None:
        rec["s_per_1k_tokens"] = {"median": per_1k, "min": per_1k, "max": per_1k, "n": 1}
    return rec


def test_goal_lines_gsm8k_both_ratios():
    recs = [_rec("jaxrl", 4.0, 2.0), _rec("jaxrl-packed", 6.0, 1.0), _rec("trl", 10.0, 4.0), _rec("tunix", 5.0, 2.0)]
    lines = G.goal_lines(recs, G.GOALS["gsm8k"], per_token=True)
    assert lines == [
        "- jaxrl / TRL = 0.40 (goal <= 0.5: met); per 1k response tokens = 0.50 (goal <= 0.5: met)",
        "- jaxrl / Tunix = 0.80 (goal <= 0.7: not met); per 1k response tokens = 1.00 (goal <= 0.7: not met)",
        "- jaxrl, packed + dynamic batch / TRL = 0.60 (goal <= 0.5: not met); per 1k response tokens = 0.25 "
        "(goal <= 0.5: met)",
        "- jaxrl, packed + dynamic batch / Tunix = 1.20 (goal <= 0.7: not met); per 1k response tokens = 0.50 "
        "(goal <= 0.7: met)",
    ]


def test_goal_lines_fixed_and_failures():
    recs = [_rec("jaxrl", 3.0), _rec("trl", None), _rec("tunix", 3.5)]
    assert G.goal_lines(recs, G.GOALS["fixed"]) == [
        "- jaxrl / TRL = n/a (TRL failed) (goal <= 0.5: not measured)",
        "- jaxrl / Tunix = 0.86 (goal <= 1.0: met)",
    ]
    assert G.GOALS == {"fixed": {"trl": 0.5, "tunix": 1.0}, "gsm8k": {"trl": 0.5, "tunix": 0.7}}


def test_model_section_ragged_column(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setattr(G, "num_params", lambda d: 2_000_000)
    recs = [_rec("jaxrl", 4.0, 2.0), _rec("trl", 10.0, 4.0), _rec("tunix", None)]
    lines, notes = G.model_section("m", tmp_path, recs, W.GSM8K)
    head = [ln for ln in lines if ln.startswith("| framework")][0]
    assert head.split(" | ")[6:] == ["response tokens/step", "s per 1k response tokens", "step time / jaxrl |"]
    rows = {ln.split(" | ")[0]: ln for ln in lines if ln.startswith("| ") and not ln.startswith("| framework")}
    assert rows["| TRL"].endswith("| 1000 (1000-1000) | 4.000 (4.000-4.000) | 2.50x |")
    assert rows["| Tunix"].count("|") == head.count("|")  # a failed row has every column
    assert "- jaxrl / TRL = 0.40 (goal <= 0.5: met); per 1k response tokens = 0.50 (goal <= 0.5: met)" in lines
    fixed, _ = G.model_section("m", tmp_path, [_rec("jaxrl", 4.0), _rec("trl", 10.0)])
    assert not any("per 1k" in ln for ln in fixed)


def test_workload_lines():
    assert G.workload_lines(W.FIXED) == [  # the fixed section's header, word for word as before the gsm8k workload
        "workload: 8 prompts x group 4 = 32 rows, exactly 32 response tokens (EOS ignored), prompts <= 64 tokens, "
        "distinct-word reward, GRPO clip 0.2, no KL (no reference model), one AdamW step (lr 1e-06, weight decay 0) "
        "per GRPO step over all rows in micro-batches of 8, grad clip 1.0, temperature 1.0, float32"]
    first, note = G.workload_lines(W.GSM8K)
    assert "GSM8K" in first and "stop at EOS or after 128 new tokens" in first and "prompts <= 256" in first
    assert "<= 1024 real tokens" in first
    assert "compare different token counts" in note and "s per 1k response tokens" in note


def test_run_framework_passes_the_workload(tmp_path, monkeypatch):
    calls = []

    def fake_run(python, args, **kw):
        calls.append(list(args))
        out = Path(args[args.index("--out") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"version": "x", "notes": [], **_result([4096, 900, 1100], [9.0, 1.0, 3.0])}))

    monkeypatch.setattr(G, "WORK_DIR", tmp_path)
    monkeypatch.setattr(G, "run_in_venv", fake_run)
    fw = G.FRAMEWORKS["jaxrl-packed"]
    rec = G.run_framework(fw, "m", tmp_path, 3, 60, None, W.GSM8K)
    assert rec["error"] is None, rec["error"]
    assert calls[0][-3:] == ["--packed", "--workload", "gsm8k"]
    assert Path(calls[0][calls[0].index("--out") + 1]) == tmp_path / "grpo_step_gsm8k" / "m" / "jaxrl-packed.json"
    assert rec["s_per_1k_tokens"]["median"] == pytest.approx((1000 / 900 + 3000 / 1100) / 2)
    G.run_framework(G.FRAMEWORKS["jaxrl"], "m", tmp_path, 3, 60, None)  # fixed: the command as it always was
    assert "--workload" not in calls[1] and calls[1][-1] == str(tmp_path / "grpo_step" / "m" / "jaxrl.json")


def test_default_frameworks_and_cli_choices():
    assert G.DEFAULT_FRAMEWORKS["fixed"] == ("jaxrl", "jaxrl-onpolicy", "trl", "tunix")
    assert G.DEFAULT_FRAMEWORKS["gsm8k"] == ("jaxrl", "jaxrl-packed", "trl", "tunix")
    assert G.SECTIONS == {"fixed": "grpo_step", "gsm8k": "grpo_step_gsm8k"}
    from bench import report

    assert report.ORDER.index("grpo_step_gsm8k") == report.ORDER.index("grpo_step") + 1


# --- the peers -------------------------------------------------------------------------------------------------

def _ov(ov: list[str]) -> dict:
    return dict(x.split("=", 1) for x in ov)


def test_jaxrl_overrides_validate_and_differ_only_where_meant(tmp_path):
    from jaxrl.config.loader import load_config

    fixed = J.overrides(tmp_path / "m", tmp_path, 3, ignore_eos=True)
    padded = J.overrides(tmp_path / "m", tmp_path, 3, ignore_eos=False, workload=W.GSM8K)
    packed = J.overrides(tmp_path / "m", tmp_path, 3, ignore_eos=False, workload=W.GSM8K, packed=True)
    f, pd, pk = _ov(fixed), _ov(padded), _ov(packed)
    assert not any("remove_padding" in k or "dynamic_bsz" in k for k in f)  # fixed: as before
    assert f[J.IGNORE_EOS_KEY] == "true" and J.IGNORE_EOS_KEY not in pd and J.IGNORE_EOS_KEY not in pk
    assert (pd["data.max_response_length"], pd["data.max_prompt_length"]) == ("128", "256")
    assert pd["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert pd["actor_rollout_ref.actor.use_dynamic_bsz"] == "false"
    assert pk["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "1024"
    assert pk["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"] == "true"  # spelled out, not left to the default
    assert pk["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == "1024"
    for ov in (fixed, padded, packed):
        cfg = load_config(J.CONFIG, ov)  # every key exists in the schema and the values validate
        assert cfg.actor_rollout_ref.rollout.n == 4 and not cfg.actor_rollout_ref.actor.use_kl_loss
    cfg = load_config(J.CONFIG, packed)
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.actor_rollout_ref.actor.use_dynamic_bsz
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 1024
    assert cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 1024
    assert not load_config(J.CONFIG, padded).actor_rollout_ref.actor.use_dynamic_bsz
    grouped = J.overrides(tmp_path / "m", tmp_path, 3, ignore_eos=True, prefix_grouper=True)
    assert _ov(grouped)["actor_rollout_ref.actor.use_prefix_grouper"] == "true"
    assert load_config(J.CONFIG, grouped).actor_rollout_ref.actor.use_prefix_grouper
    assert not load_config(J.CONFIG, fixed).actor_rollout_ref.actor.use_prefix_grouper
    assert G.FRAMEWORKS["jaxrl-pg"].extra == ("--prefix-grouper",) and "jaxrl-pg" in G.JAXRL_KEYS


def test_jaxrl_dataset_holds_chat_messages(tmp_path, shared):
    n = J.write_dataset(tmp_path / "g.jsonl", W.GSM8K)
    rows = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert n == len(rows) == 8
    assert [r["prompt"] for r in rows] == W.gsm8k_messages()
    J.write_dataset(tmp_path / "f.jsonl")
    assert [json.loads(x)["prompt"] for x in (tmp_path / "f.jsonl").read_text().splitlines()] == W.prompts()


def test_trl_reward_reads_conversational_completions():
    assert T.completion_text("a b a") == "a b a"
    msgs = [{"role": "assistant", "content": "a b "}, {"role": "assistant", "content": "a c"}]
    assert T.completion_text(msgs) == "a b a c"
    assert T.reward_fn([[{"role": "assistant", "content": "x x y y"}], "p q r"]) == [0.5, 1.0]


def test_tunix_generated_tokens_count_the_stopping_eos():
    assert X.generated_tokens([5, 127, 128], 128) == 6 + 128 + 128
    assert X.generated_tokens([32] * 32, 32) == 1024  # fixed workload: no early stop, unchanged count
    assert X._dedup_bos([1, 1, 1, 5, 1], 1) == [1, 5, 1]
    assert X._dedup_bos([1, 5], None) == [1, 5]


def test_tunix_eos_ids(tmp_path):
    class Tok:
        eos_token_id = 2

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert X.eos_ids(tmp_path, Tok()) == [2, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert X.eos_ids(tmp_path, Tok()) == [2, 7, 9]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").unlink()
    Tok.eos_token_id = None
    with pytest.raises(ValueError, match="no eos_token_id"):
        X.eos_ids(tmp_path, Tok())
