#!/usr/bin/env bash
# Sets everything up and runs the main job: an SGLang server with the louver attention backend on
# the offline SmolLM2-135M-Instruct model, then sends it one request and keeps serving.
#   bash scripts/run.sh [extra sglang.launch_server args]
# Options of the backend come from LOUVER_* environment variables (README, "Configuration").
# On a machine without a GPU the server runs on the CPU; with a GPU it uses the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
MODEL=$("$PY" -c "from louver_sgl.data.fetch_model import ensure_model; print(ensure_model())" | tail -n 1)
PORT=${PORT:-30000}
DEVICE_ARGS=()
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEVICE_ARGS=(--device cpu)
fi
"$PY" -m sglang.launch_server --model-path "$MODEL" --attention-backend louver \
  --max-total-tokens 65536 --host 127.0.0.1 --port "$PORT" "${DEVICE_ARGS[@]}" "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT INT TERM
"$PY" - "$PORT" <<'PYEOF'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=5)
        break
    except OSError:
        time.sleep(2)
else:
    sys.exit("server did not become ready")
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}
print(f"\n$ curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
print(reply["choices"][0]["message"]["content"])
print(f"\nlouver server ready at {url} (Ctrl-C to stop)")
PYEOF
wait $SERVER
