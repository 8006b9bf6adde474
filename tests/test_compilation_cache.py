"""jaxrl.compilation_cache: trainer.jax_compilation_cache_dir turns JAX's persistent cache on; a second process loads
the programs the first compiled (no XLA compile), JAX's own env var wins, and a directory that cannot be made only
warns. Each case runs in a fresh process: JAX decides on its cache once, at a process's first compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
import jax, jax.numpy as jnp, numpy as np
from jaxrl.compilation_cache import use_compilation_cache
from jaxrl.metrics import compile_clock
arg = sys.argv[1]
used = use_compilation_cache(None if arg == "none" else arg)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # store even this small program
compile_clock.take()
out = jax.jit(lambda x: jnp.sin(x) @ x.T + jnp.cos(x).sum())(np.ones((64, 64), np.float32))
print(json.dumps({"used": used, **compile_clock.take(), "sum": float(np.asarray(out).sum())}))
"""


def _probe(arg: str, env_cache: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if env_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = env_cache
    proc = subprocess.run([sys.executable, "-c", PROBE, arg], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    cache = tmp_path / "home" / "cache"  # created on use, parents too
    first, _ = _probe(str(cache))
    assert first["used"] == str(cache) and first["perf/num_compiles"] == 1
    assert any(cache.iterdir())  # the executable was written
    second, _ = _probe(str(cache))
    assert second["used"] == str(cache)
    assert second["perf/num_compiles"] == 0 and second["sum"] == first["sum"]  # loaded, not compiled; same result


def test_without_a_directory_nothing_is_cached(tmp_path):
    got, _ = _probe("none")
    assert got["used"] is None and got["perf/num_compiles"] == 1


def test_jaxs_own_env_var_wins(tmp_path):
    mine, jaxs = tmp_path / "mine", tmp_path / "jaxs"
    got, _ = _probe(str(mine), env_cache=str(jaxs))
    assert got["used"] == str(jaxs) and any(jaxs.iterdir()) and not mine.exists()


def test_a_directory_that_cannot_be_made_warns_and_the_run_compiles(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    got, stderr = _probe(str(blocker / "cache"))
    assert got["used"] is None and got["perf/num_compiles"] == 1
    assert "trainer.jax_compilation_cache_dir=" in stderr and "cannot be created" in stderr


def test_the_trainers_default_is_a_user_cache_dir_and_null_turns_it_off():
    from jaxrl.config.loader import load_config
    from jaxrl.config.offline_loader import load_offline_config

    cfg = load_config("configs/quickstart.yaml")
    assert cfg.trainer.jax_compilation_cache_dir == "~/.cache/jaxrl/jax_compilation_cache"
    assert load_config("configs/quickstart.yaml", ["trainer.jax_compilation_cache_dir=null"]).trainer \
        .jax_compilation_cache_dir is None
    assert load_offline_config("sft", None, ["model.partial_pretrain=stories260K"]).trainer.jax_compilation_cache_dir == "~/.cache/jaxrl/jax_compilation_cache"
