#!/usr/bin/env bash
# Fetch verl's own reward scorer files (verl/utils/reward_score/*.py), unchanged, into .cache/verl/<version>/
# (git-ignored; verl's code is never committed here). Tests load them as custom reward functions
# (custom_reward_function.path) to check that a verl user's scorer files run unchanged; they never download.
#
# Usage:  bash scripts/fetch_verl_reward_files.sh          # idempotent; .ci/run calls it before the tests
#         VERL_VERSION=0.6.1 bash scripts/fetch_verl_reward_files.sh
# Result: .cache/verl/<version>/verl/utils/reward_score/{gsm8k,math_reward,math_dapo,math_verify,...}.py
#         + LICENSE (verl is Apache-2.0)
set -euo pipefail
cd "$(dirname "$0")/.."
VERL_VERSION="${VERL_VERSION:-0.6.1}"  # the version tests/rewards/test_verl_scorer_files.py reads
DEST=".cache/verl/${VERL_VERSION}"
if [ -f "$DEST/verl/utils/reward_score/gsm8k.py" ]; then
  echo "verl ${VERL_VERSION} reward files already in $DEST"
  exit 0
fi
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
python -m pip download "verl==${VERL_VERSION}" --no-deps --only-binary=:all: --quiet -d "$TMP"
python - "$TMP" "$DEST" <<'PY'
import glob
import sys
import zipfile
from pathlib import Path

wheel = glob.glob(f"{sys.argv[1]}/verl-*.whl")[0]
dest = Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("verl/utils/reward_score/") and n.endswith(".py")
             and n.count("/") == 3]
    licenses = [n for n in z.namelist() if n.endswith((".dist-info/LICENSE", ".dist-info/licenses/LICENSE"))]
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(z.read(name))
    if licenses:
        (dest / "LICENSE").write_bytes(z.read(licenses[0]))
print(f"extracted {len(names)} verl reward_score files from {Path(wheel).name} into {dest}")
PY
