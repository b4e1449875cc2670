#!/usr/bin/env bash
# Creates the environment ($LOUVER_VENV, default .venv) with torch, SGLang 0.5.23 (lean,
# CPU-capable install), the dev tools and louver-sgl.
# Checks first, before any download, that Python is >= 3.11 and that g++ builds an OpenMP program
# against the Python headers (the CPU kernels need all three); fails naming what is missing.
# Idempotent: a second run only checks that everything is installed. It reinstalls when the
# contents of requirements/ or pyproject.toml changed since the last install (a hash, not mtimes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LOUVER_VENV:-.venv}

fail() {
  echo "setup: $*" >&2
  exit 1
}

command -v "$PY" >/dev/null || fail "no '$PY' on PATH (set PYTHON to a Python >= 3.11)"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' ||
  fail "Python >= 3.11 is required, '$PY' is $("$PY" -c 'import platform; print(platform.python_version())')"
"$PY" -c 'import venv, ensurepip' 2>/dev/null || fail "'$PY' lacks venv/ensurepip (Debian: apt install python3-venv)"

# The compiled CPU kernels: g++ with OpenMP and the Python headers (torch's extension build).
CXX_BIN=${CXX:-g++}
command -v "$CXX_BIN" >/dev/null || fail "no C++ compiler '$CXX_BIN' (Debian: apt install g++)"
PY_INCLUDE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$PY_INCLUDE/Python.h" ] || fail "no Python headers in $PY_INCLUDE (Debian: apt install python3-dev)"
PROBE=$(mktemp -d)
trap 'rm -rf "$PROBE"' EXIT
printf '#include <Python.h>\n#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n' \
  > "$PROBE/probe.cpp"
if ! "$CXX_BIN" -fopenmp -I"$PY_INCLUDE" "$PROBE/probe.cpp" -o "$PROBE/probe" 2> "$PROBE/err" || ! "$PROBE/probe"; then
  cat "$PROBE/err" >&2
  fail "'$CXX_BIN' cannot build an OpenMP program against the Python headers (Debian: apt install g++ libgomp1)"
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
STAMP="$VENV/.louver-setup-done"
# what the environment was installed from: the requirement files' and the project file's contents
WANT=$(cat requirements/* pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  # torch 2.14.1 is a CUDA build: with its nvidia-* libraries a fresh environment takes ~7.5 GB.
  # Say so before pip fails half-way with "No space left on device".
  FREE_KB=$(df -Pk "$VENV" | awk 'NR == 2 {print $4}')
  if [ -n "$FREE_KB" ] && [ "$FREE_KB" -lt $((8 * 1024 * 1024)) ]; then
    echo "setup: warning: $((FREE_KB / 1024)) MiB free where $VENV lies; a fresh environment needs about 7.5 GiB" >&2
  fi
  "$PIP" install -q --upgrade pip
  # torch first, exactly the version SGLang 0.5.23 pins.
  "$PIP" install -q -c requirements/constraints-cpu.txt torch torchvision
  # SGLang without its CUDA-only dependencies (they do not install or import on a CPU-only host);
  # on a GPU machine `pip install sglang==0.5.23` brings them.
  "$PIP" install -q --no-deps sglang==0.5.23
  "$PIP" install -q -c requirements/constraints-cpu.txt -r requirements/sglang-cpu.txt -r requirements/dev.txt
  "$PIP" install -q --no-deps --no-build-isolation -e .
  echo "$WANT" > "$STAMP"
fi
echo "louver-sgl environment ready in $VENV"
