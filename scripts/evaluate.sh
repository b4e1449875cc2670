#!/usr/bin/env bash
# Regenerates every evaluation result and plot of docs/results.md (CPU; hours, resumable).
#   bash scripts/evaluate.sh            # all evaluations, then the plots
#   bash scripts/evaluate.sh --small    # the CI-sized versions (minutes), into data/eval_small/
# Finished cells are cached under data/eval_cache/ (one JSON per prompt / trace layer / policy /
# server cell) and skipped on a rerun, so an interrupted run resumes; delete a cell to redo it.
# Heavy steps run under flock /tmp/louver-heavy.lock when flock exists, one at a time.
# The CPU decode benchmark (benchmarks/results/decode_cpu.json) is rerun only when missing or
# with EVAL_SPEED=1; the serving benchmark the same with serving_cpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${LOUVER_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1
LOCK=()
command -v flock >/dev/null && LOCK=(flock /tmp/louver-heavy.lock)
if [ "${1:-}" = "--small" ]; then
  RESULTS=data/eval_small/results
  mkdir -p "$RESULTS"
  for name in exactness tradeoff kl niah; do
    "${LOCK[@]}" "$PY" -m "benchmarks.quality.eval_$name" --small --cache "data/eval_small/cache/$name" \
      --out "$RESULTS/eval_$name.json"
  done
  "$PY" -m benchmarks.quality.eval_plots --results "$RESULTS" --cache data/eval_small/cache --out data/eval_small/img
  exit 0
fi
"$PY" -m louver_eval.data.texts data/texts
for text in bible paul_graham; do
  "${LOCK[@]}" "$PY" -m louver_eval.data.capture --text "$text" --lengths 2048 8192
done
"${LOCK[@]}" "$PY" -m benchmarks.quality.eval_exactness
"${LOCK[@]}" "$PY" -m benchmarks.quality.eval_tradeoff
"${LOCK[@]}" "$PY" -m benchmarks.quality.eval_kl
"${LOCK[@]}" "$PY" -m benchmarks.quality.eval_niah
if [ ! -f benchmarks/results/decode_cpu.json ] || [ "${EVAL_SPEED:-0}" = 1 ]; then
  "${LOCK[@]}" "$PY" -m louver_eval.data.capture --text bible --lengths 32768
  "${LOCK[@]}" "$PY" -m benchmarks.cpu.decode_cpu --traces data/traces/bible_2048.pt data/traces/bible_8192.pt \
    data/traces/bible_32768.pt --layers 9 21 --batches 1 8 --repeats 3 --out benchmarks/results/decode_cpu.json
fi
if [ ! -f benchmarks/results/serving_cpu.json ] || [ "${EVAL_SPEED:-0}" = 1 ]; then
  "${LOCK[@]}" "$PY" -m benchmarks.serving.serving_cpu --out benchmarks/results/serving_cpu.json
fi
"$PY" -m benchmarks.quality.eval_plots --results benchmarks/results --cache data/eval_cache --out docs/img
echo "results: benchmarks/results/eval_*.json, plots: docs/img/eval_*.png (see docs/results.md)"
