#!/usr/bin/env bash
# Build (idempotently) the JetStream environment: .venv-jetstream (git-ignored), without TensorFlow.
#
# google-jetstream 0.2.2 (the last release, 2024; archived upstream) declares seqio, which pulls TensorFlow
# (~2.4 GB), plus test-only packages (pytest, coverage, parameterized, portpicker, blobfile). Its engine API and
# orchestrator import none of those except seqio.vocabularies, which jaxrl stands in for (jaxrl/rollout/
# jetstream_compat.py: that stand-in and the jax.tree_map shim, in one place). So:
#   pip install --no-deps google-jetstream==0.2.2   + the `jetstream` extra of pyproject.toml (the pure-Python /
#   wheel-only packages it really imports: grpcio, protobuf, prometheus-client, shortuuid, tiktoken).
#
# Its own venv, not the main environment: the wheel also installs top-level `benchmarks` and JetStream's tests,
# and importing its orchestrator sets the root logger to DEBUG. The venv sees the main environment's packages
# (--system-site-packages: jax, flax, ... and jaxrl are not installed twice) and adds only the few above.
#
# Usage:  bash scripts/setup_jetstream.sh          # creates/repairs .venv-jetstream, then verifies the imports
#         JETSTREAM_VENV=/some/dir bash scripts/setup_jetstream.sh
# Then:   .venv-jetstream/bin/python -m pytest -q tests/rollout/test_jetstream_orchestrator.py
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${JETSTREAM_VENV:-$ROOT/.venv-jetstream}"
PYTHON="${PYTHON:-python3}"

verify() {
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" - <<'EOF'
import importlib.util, sys
for heavy in ("tensorflow", "seqio"):
    assert importlib.util.find_spec(heavy) is None, f"{heavy} is installed: the jetstream extra must not pull it"
import jax
from jaxrl.rollout import jetstream_compat
assert jetstream_compat.AVAILABLE, jetstream_compat.IMPORT_ERROR
jetstream_compat.load_orchestrator()
from importlib.metadata import version
print(f"ok: python {sys.version.split()[0]} google-jetstream {version('google-jetstream')} jax {jax.__version__}")
EOF
}

if [ -x "$VENV/bin/python" ] && verify 2>/dev/null; then
  echo "setup_jetstream: $VENV already complete"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# The extra's packages, read from pyproject.toml (one list), installed without touching jax/jaxlib.
mapfile -t EXTRA < <("$VENV/bin/python" - <<'EOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["jetstream"]))
EOF
)
CONSTRAINTS="$VENV/constraints.txt"
"$VENV/bin/python" - > "$CONSTRAINTS" <<'EOF'
import jax, jaxlib, numpy
print(f"jax=={jax.__version__}\njaxlib=={jaxlib.__version__}\nnumpy=={numpy.__version__}")
EOF
"${PIP[@]}" -c "$CONSTRAINTS" "${EXTRA[@]}"
"${PIP[@]}" --no-deps google-jetstream==0.2.2

verify
echo "setup_jetstream: built $VENV in $(( $(date +%s) - start )) s"
