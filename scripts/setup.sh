#!/usr/bin/env bash
# Creates .venv with torch, SGLang 0.5.23 (lean, CPU-capable install), the dev tools and louver-sgl.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LOUVER_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
STAMP="$VENV/.louver-setup-done"
if [ ! -f "$STAMP" ] || [ requirements -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$PIP" install -q --upgrade pip
  # torch first, exactly the version SGLang 0.5.23 pins.
  "$PIP" install -q -c requirements/constraints-cpu.txt torch torchvision
  # SGLang without its CUDA-only dependencies (they do not install or import on a CPU-only host);
  # on a GPU machine `pip install sglang==0.5.23` brings them.
  "$PIP" install -q --no-deps sglang==0.5.23
  "$PIP" install -q -c requirements/constraints-cpu.txt -r requirements/sglang-cpu.txt -r requirements/dev.txt
  "$PIP" install -q --no-deps --no-build-isolation -e .
  touch "$STAMP"
fi
echo "louver-sgl environment ready in $VENV"
