"""LoRA end to end (``pytest -m slow``): the quickstart with ``actor_rollout_ref.model.lora_rank=8`` learns and
exports a merged model plus a PEFT adapter; SIGKILL during step 5 of a LoRA run resumes to the same metrics as an
uninterrupted one (the helpers and tiny run of tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.checkpoint import CheckpointStore
from jaxrl.config import load_config
from tests.test_resume import assert_same_metrics, logged_steps, records, run, start_and_kill_when

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# rank 8 on every projection; LoRA takes a larger learning rate than full fine-tuning (the quickstart's 1e-4)
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-3"]


def test_quickstart_with_lora_learns_and_exports_merged_and_peft(shared, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *LORA,
         "trainer.total_training_steps=12", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.save_freq=12", "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "LoRA r=8 alpha=16 on 35 modules" in proc.stderr  # stories260K: 5 layers x 7 projections
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = np.array([r["critic/score/mean"] for r in rows if r["step"] > 0])
    first, last = scores[:5].mean(), scores[-5:].mean()
    print(f"LoRA quickstart critic/score/mean first5={first:.3f} last5={last:.3f}")
    assert len(scores) == 12 and last > first + 0.15, (first, last)
    store = CheckpointStore(tmp_path, max_to_keep=None, read_only=True)
    try:
        meta = store.read_meta(12)
    finally:
        store.close()
    assert meta["model"]["lora"]["rank"] == 8 and len(meta["model"]["lora"]["targets"]) == 35
    saved = meta["fingerprint"]["arrays"]["actor.params"]
    assert saved and all(".lora." in path for path in saved)  # adapters only: the base is the model file
    config = json.loads((tmp_path / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    base = load_config(REPO / "configs/quickstart.yaml").actor_rollout_ref.model.path
    assert config["base_model_name_or_path"] == base  # jaxrl.loop.export_final_model(c, base_model_path=...)
    assert (tmp_path / "lora_adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "hf_model" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def lora_baseline(tmp_path_factory, shared):
    out = tmp_path_factory.mktemp("lora_uninterrupted")
    run(out, LORA)
    return records(out)


def test_sigkill_during_step_5_of_a_lora_run_resumes_exactly(lora_baseline, tmp_path):
    start_and_kill_when(tmp_path, lambda: 4 in logged_steps(tmp_path) and (tmp_path / "global_step_4").is_dir(),
                        extra=LORA)
    proc = run(tmp_path, LORA)
    assert f"resumed from {tmp_path}/global_step_4 at step 4" in proc.stderr
    resumed = records(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert_same_metrics(lora_baseline, resumed, steps=[5, 6])
