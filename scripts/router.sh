#!/usr/bin/env bash
# Starts N louver workers and sglang-router in front of them on this machine, prints the router's
# address, and serves until Ctrl-C. Each worker is the main command's server (the offline
# SmolLM2-135M-Instruct, fp32, YaRN 32K context, louver backend) on its own port and its share of
# the cores; the router's policy is cache_aware (a request goes to the worker holding the
# longest prefix of it, so the prefix's KV pages and index are reused there).
#   bash scripts/router.sh [N (default 2)] [--policy round_robin] [--port 30000] [-- extra launch_server args]
# The multi-host recipe (router on one host, workers on others) is in docs/serving.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${LOUVER_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1  # nothing is fetched from a model hub: the model comes from its wheel
WORKERS=2
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
  WORKERS=$1
  shift
fi
exec "$PY" -m louver_eval.router --workers "$WORKERS" "$@"
