"""A missing ``trainer.resume_from_path``: one clean line, exit 1 (a missing file is a runtime error, like a missing
data or model file), within seconds (before the model loads), and no orbax/absl traceback after the message
(orbax's background threads used to outlive the run and print one at interpreter exit)."""

from __future__ import annotations

import subprocess
import time

from faultkit import REPO, command, env, error_lines


def test_missing_resume_from_path_is_one_clean_line(tmp_path):
    missing = tmp_path / "no_such_run"
    t0 = time.monotonic()
    proc = subprocess.run(command(tmp_path / "run", ["trainer.resume_mode=resume_path",
                                                     f"trainer.resume_from_path={missing}"]),
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert f"trainer.resume_from_path='{missing}' does not exist" in line and "global_step_<N>" in line
    assert "Traceback" not in proc.stderr and "absl" not in proc.stderr, proc.stderr[-3000:]
    # refused while building, before the model loaded: no run line logged, nothing written into the folder
    # (the lock taken first is released again)
    assert "jaxrl INFO run:" not in proc.stderr and list((tmp_path / "run").iterdir()) == []
    assert elapsed < 60, elapsed
