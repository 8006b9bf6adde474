"""End-to-end tests of ``python -m jaxrl.generate`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxrl.paths import REPO_ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxrl.generate", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_golden_greedy_ids_from_bos(shared):
    model_dir = shared / "models" / "stories260K"
    proc = _run("--model", str(model_dir), "--prompt", "", "--greedy", "--max-new-tokens", "255", "--output-ids")
    assert proc.returncode == 0, proc.stderr
    golden = json.loads((model_dir / "greedy_from_bos_256_ids.json").read_text())
    assert json.loads(proc.stdout) == golden


def test_bad_model_path_fails_with_path_in_stderr(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = _run("--model", str(missing), "--prompt", "hello", "--max-new-tokens", "4")
    assert proc.returncode != 0
    assert str(missing) in proc.stderr
    assert proc.stdout == ""
