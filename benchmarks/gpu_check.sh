#!/usr/bin/env bash
# The GPU check, in one call on a CUDA machine: first the stage table (every kernel of every
# implementation timed alone, with its bytes and its floor at FlashInfer's bandwidth, and the
# speed-of-light rows: benchmarks/gpu_stages.py), then the Triton kernel tests natively (bf16
# included), exactness on a captured trace, CUDA-graph replay of the louver step, and latency
# against FlashInfer, SGLang's Triton decode and torch SDPA. GPU_STAGES_ONLY=1: the stage table
# alone. Prepare `.gpu_carry/` first where pip works:
#     python -m benchmarks.gpu_prepare
# Then, on the GPU machine, from the repository root:
#     bash benchmarks/gpu_check.sh [extra gpu_bench.py options]
# Results: $OUT/gpu_bench.json (+ logs); the table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/louver_gpu_check}
mkdir -p "$OUT"
CARRY=.gpu_carry
export PYTHONUNBUFFERED=1
# The repository's kernels/ folder is the `louver_kernels` package when installed; without an
# install, a link provides the import name.
mkdir -p /tmp/louver_pkgs && ln -sfn "$PWD/kernels" /tmp/louver_pkgs/louver_kernels
export PYTHONPATH="$PWD:/tmp/louver_pkgs:$PWD/$CARRY/shim${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if ls $CARRY/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/louver_site $CARRY/whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/louver_site"
  export MAX_JOBS=12
  # FlashInfer's JIT build before the stage table, whose floors are at FlashInfer's bandwidth
  timeout 420 python3 -m benchmarks.gpu_flashinfer_warm "$CARRY/trace.pt" > "$OUT/flashinfer_build.log" 2>&1
  tail -3 "$OUT/flashinfer_build.log"
fi
python3 -m benchmarks.gpu_bench --trace "$CARRY/trace.pt" --out "$OUT/gpu_stages.json" --stages-only "$@" 2>&1 \
  | tee "$OUT/gpu_stages.log"
stages_rc=${PIPESTATUS[0]}
if [ "${GPU_STAGES_ONLY:-0}" = 1 ]; then
  exit "$stages_rc"
fi
tests_rc=0
if [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then  # GPU_SKIP_TESTS=1: timings only, for a rerun
  timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  tests_rc=${PIPESTATUS[0]}
fi
python3 -m benchmarks.gpu_bench --trace "$CARRY/trace.pt" --out "$OUT/gpu_bench.json" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "stage table rc=$stages_rc kernel tests rc=$tests_rc benchmark rc=$bench_rc"
grep -A200 "^stage table" "$OUT/gpu_stages.log" | head -80  # the table once more, last
exit $(( stages_rc != 0 || tests_rc != 0 || bench_rc != 0 ))
