#!/usr/bin/env bash
# Sets everything up and runs the main job: the louver core on real SmolLM2 attention traces.
#   bash scripts/run.sh [demo args, e.g. --lengths 2048 8192 32768]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m louver_sgl.demo "$@"
