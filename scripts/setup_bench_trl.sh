#!/usr/bin/env bash
# Build (idempotently) the TRL peer environment of bench/grpo_step.py: <repo>/.venv-bench-trl (git-ignored).
#
# Holds torch 2.13.0+cpu (from /opt/wheels, pip's find-links on these machines; never a CUDA build) and
# TRL 1.16.0 with the exact versions it was benchmarked with (transformers, accelerate, datasets, safetensors).
# All pins go into a pip constraints file so no later resolution can move torch off 2.13.0.
# A stamp file (.venv-bench-trl/.bench-trl-stamp) records the pins: when it matches, the script is a fast no-op.
#
# Usage:  bash scripts/setup_bench_trl.sh        # creates/repairs .venv-bench-trl; prints its python path last
#         BENCH_TRL_VENV=/some/dir bash scripts/setup_bench_trl.sh
#         BENCH_TRL_FORCE=1 bash scripts/setup_bench_trl.sh   # ignore the stamp, re-check and re-verify
# Then:   .venv-bench-trl/bin/python bench/peers/trl_grpo.py --model-dir DIR --model-name NAME --steps N --out F.json
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${BENCH_TRL_VENV:-$ROOT/.venv-bench-trl}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.bench-trl-stamp"

TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0
TRANSFORMERS_VERSION=5.23.0
ACCELERATE_VERSION=1.15.0
DATASETS_VERSION=5.2.0
SAFETENSORS_VERSION=0.8.0
PINS="torch==$TORCH_VERSION trl==$TRL_VERSION transformers==$TRANSFORMERS_VERSION accelerate==$ACCELERATE_VERSION datasets==$DATASETS_VERSION safetensors==$SAFETENSORS_VERSION"

if [ -z "${BENCH_TRL_FORCE:-}" ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ]; then
  echo "setup_bench_trl: $VENV already complete ($PINS)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

verify() {
  "$VENV/bin/python" - "$TRL_VERSION" <<'EOF'
import importlib.metadata as md, sys
import torch
assert torch.__version__.startswith("2.13.0") and not torch.version.cuda, \
    f"need torch 2.13.0 CPU, got {torch.__version__} (cuda={torch.version.cuda})"
nvidia = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not nvidia, f"CUDA packages installed: {nvidia}"
import accelerate, datasets, safetensors, transformers, trl  # noqa: F401
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
assert trl.__version__ == sys.argv[1], f"need trl {sys.argv[1]}, got {trl.__version__}"
print(f"setup_bench_trl: ok: python {sys.version.split()[0]} torch {torch.__version__} trl {trl.__version__} "
      f"transformers {transformers.__version__} accelerate {accelerate.__version__} datasets {datasets.__version__}",
      file=sys.stderr)
EOF
}

start=$(date +%s)
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_bench_trl: creating $VENV with $PYTHON" >&2
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# Pins that every install below must respect (pip constraints, not requirements).
CONSTRAINTS="$VENV/constraints.txt"
printf '%s\n' $PINS > "$CONSTRAINTS"

echo "setup_bench_trl: installing torch==$TORCH_VERSION (CPU wheel from find-links)" >&2
# /opt/wheels (pip's find-links here) holds torch-2.13.0+cpu, which pip prefers over the PyPI build (the local
# version +cpu sorts higher). Checked right after: never a CUDA torch.
"${PIP[@]}" -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
"$VENV/bin/python" -W ignore -c "import torch,sys; sys.exit(0 if not torch.version.cuda else f'CUDA torch {torch.__version__} installed: abort')"

echo "setup_bench_trl: installing trl==$TRL_VERSION and its dependencies" >&2
"${PIP[@]}" -c "$CONSTRAINTS" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" \
  "accelerate==$ACCELERATE_VERSION" "datasets==$DATASETS_VERSION" "safetensors==$SAFETENSORS_VERSION"

# Anything that dragged in CUDA runtime packages is undone here (none expected with the constraints above).
nvidia_pkgs=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -i '^nvidia' | cut -d= -f1 || true)
if [ -n "$nvidia_pkgs" ]; then
  echo "setup_bench_trl: removing CUDA packages: $nvidia_pkgs" >&2
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip uninstall -y $nvidia_pkgs >&2
fi

verify
echo "$PINS" > "$STAMP"
echo "setup_bench_trl: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV/bin/python"
