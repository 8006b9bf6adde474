"""The summary of the GSM8K CPU-hour learning run (bench/gsm8k_cpu_hour.py) on a hand-written metrics file: the
minutes behind each record, the validation points, the training windows, the plot. No training runs here."""

from __future__ import annotations

import json

import pytest

from bench import gsm8k_cpu_hour as H


def _run_dir(tmp_path, steps=7):
    recs = [{"step": 0, "timing_s/testing": 60.0, H.VAL["format"]: 0.05, H.VAL["acc"]: 0.0,
             H.VAL["acc_flexible"]: 0.02}]
    for s in range(1, steps + 1):
        r = {"step": s, "timing_s/step": 30.0 if s > 1 else 90.0, "reward/format/mean": s / 10,
             "critic/score/mean": s / 100, "response_length/mean": 128 - s, "response_length/clip_ratio": 1 - s / 10,
             "perf/cpu_memory_used_gb": 3.0 + s / 10, "perf/cpu_memory_peak_gb": 4.5 - (s == 1),
             "perf/cpu_memory_peak_gb/update_actor": 3.5 + (s == 3), "perf/cpu_memory_peak_gb/gen": 2.0 + s / 100}
        if s == 5:  # a validation after step 5
            r.update({"timing_s/testing": 60.0, H.VAL["format"]: 0.3, H.VAL["acc"]: 0.01, H.VAL["acc_flexible"]: 0.04})
        recs.append(r)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp_path


def test_minutes_sum_steps_and_validations():
    recs = [{"step": 0, "timing_s/testing": 60.0}, {"step": 1, "timing_s/step": 30.0},
            {"step": 2, "timing_s/step": 30.0, "timing_s/testing": 60.0}]
    assert H.elapsed_minutes(recs) == pytest.approx([1.0, 1.5, 3.0])


def test_summary_has_the_validation_points_windows_and_peaks(tmp_path):
    s = H.summarize(_run_dir(tmp_path))
    assert [(v["step"], v["format"]) for v in s["val"]] == [(0, 0.05), (5, 0.3)]
    assert s["val"][1]["minutes"] == pytest.approx((60 + 90 + 4 * 30 + 60) / 60)
    assert [w["steps"] for w in s["windows"]] == ["1-5", "6-7"]
    assert s["windows"][0]["format"] == pytest.approx(0.3) and s["windows"][1]["format"] == pytest.approx(0.65)
    assert s["step_s_median"] == 30.0  # the first (compiling) step is left out
    assert s["step_end_rss_gb"] == pytest.approx(3.7) and s["steps"] == 7
    assert s["peak_rss_gb"] == pytest.approx(4.5)  # the high-water mark, not the step-end RSS
    lines = H.markdown(s, "python bench/gsm8k_cpu_hour.py")
    assert any("peak RSS of the process 4.50 GB; largest step-end RSS 3.70 GB" in line for line in lines)
    assert s["phase_peaks"] == {"update_actor": (4.5, 3), "gen": (pytest.approx(2.07), 7)}
    assert any(line.endswith("at step): update_actor 4.50 (3), gen 2.07 (7)") for line in lines)
    assert "| 5 | 5.5 | 0.300 | 0.010 | 0.040 |" in lines
    png = H.plot(s, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_validation_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing_s/step": 3.0}) + "\n")
    with pytest.raises(ValueError, match="0 validation records"):
        H.summarize(tmp_path)
