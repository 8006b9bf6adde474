#!/usr/bin/env bash
# Build (idempotently) the Tunix peer environment of the GRPO step benchmark: <repo>/.venv-bench-tunix
# (git-ignored via /.venv*/). bench/grpo_step.py runs bench/peers/tunix_grpo.py with its python.
#
# Pins: google-tunix 0.1.7 (the newest release on PyPI) on CPU jax/jaxlib 0.10.2 + flax 0.12.8 + optax 0.2.8.
# The 0.1.7 wheel declares no jax bound of its own (only flax>=0.11.1); Tunix's own repository pins
# jax>=0.6.0,!=0.7.2,<0.11.1, so 0.10.2 (also the version of the project's main environment) is inside the range
# it supports. Plain CPU jax: no jax[tpu]/[cuda] extra (tunix's `prod` extra would pull jax[tpu]), no TensorFlow
# (only the `cli` extra needs it; tensorflow_datasets installs without it), no torch.
# A stamp file holding the pins makes a second run a fast no-op; a changed pin list rebuilds the venv's packages.
#
# Usage:  bash scripts/setup_bench_tunix.sh          # prints the venv's python path last
#         TUNIX_VENV=/some/dir bash scripts/setup_bench_tunix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${TUNIX_VENV:-$ROOT/.venv-bench-tunix}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.bench-tunix-stamp"

# Exact pins of the packages that matter for the benchmark (pip constraints: everything else resolves freely,
# but these cannot move).
PINS="google-tunix==0.1.7
jax==0.10.2
jaxlib==0.10.2
flax==0.12.8
optax==0.2.8
numpy==2.4.6
transformers==5.12.1
tokenizers==0.22.2
huggingface_hub==1.33.0
safetensors==0.7.0
qwix==0.1.8
orbax-checkpoint==0.12.8"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ]; then
  echo "setup_bench_tunix: $VENV already complete (stamp matches the pins)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
CONSTRAINTS="$VENV/constraints.txt"
printf '%s\n' "$PINS" > "$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
# pip's progress goes to stderr: stdout carries only the interpreter path (the last line).
"${PIP[@]}" -q -U pip >&2
"${PIP[@]}" -c "$CONSTRAINTS" google-tunix==0.1.7 >&2

# Verify: the exact versions, a CPU-only jax, no TensorFlow/torch dragged in, and the modules the peer uses.
"$VENV/bin/python" - >&2 <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

want = {"google-tunix": "0.1.7", "jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "optax": "0.2.8"}
got = {k: md.version(k) for k in want}
bad = {k: (v, want[k]) for k, v in got.items() if v != want[k]}
if bad:
    sys.exit(f"setup_bench_tunix: wrong versions (got, want): {bad}")
for heavy in ("tensorflow", "torch"):
    if importlib.util.find_spec(heavy) is not None:
        sys.exit(f"setup_bench_tunix: {heavy} got installed; the Tunix peer must not need it")
import jax
import optax  # noqa: F401
import transformers  # noqa: F401
from tunix.models.llama3 import model as _l, params as _lp  # noqa: F401
from tunix.models.qwen2 import model as _q, params as _qp  # noqa: F401
from tunix.rl import rl_cluster  # noqa: F401
from tunix.rl.grpo import grpo_learner  # noqa: F401
from tunix.rl.rollout import base_rollout  # noqa: F401

if jax.default_backend() != "cpu":
    sys.exit(f"setup_bench_tunix: expected the CPU backend, got {jax.default_backend()}")
print("setup_bench_tunix: ok: " + ", ".join(f"{k} {v}" for k, v in got.items()), file=sys.stderr)
EOF

printf '%s' "$PINS" > "$STAMP"
echo "setup_bench_tunix: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV/bin/python"
