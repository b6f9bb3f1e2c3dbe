#!/usr/bin/env bash
# make gpu-check: on a machine with an NVIDIA GPU, with its python3 and torch as they are (no venv, no
# downloads): builds opforge there (the CPU library and, with nvcc, the CUDA one), runs the CUDA C
# tests' emulation (a quick sanity pass), the CUDA Python tests and the CUDA benchmark table. Results
# (the table as CSV and markdown, the test log) go to $OUT when it is set, else build/gpu-check/.
# At most a few minutes: GPU_CHECK_QUICK=1 benchmarks smaller shapes without torch.compile.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-build/gpu-check}
mkdir -p "$OUT_DIR"
log() { echo "gpu-check: $*" | tee -a "$OUT_DIR/gpu_check.log"; }

log "$(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT_DIR/gpu_check.log" || true
$PY -c "import torch; print('gpu-check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee -a "$OUT_DIR/gpu_check.log"

t0=$(date +%s)
OPFORGE_CUDA=1 $PY setup.py -q build_ext --inplace 2>&1 | tail -5 | tee -a "$OUT_DIR/gpu_check.log"
log "built in $(( $(date +%s) - t0 )) s"

export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import opforge, json; s = opforge.cuda_status(); print('gpu-check: cuda_status', json.dumps(s)); assert s['loaded'], s['reason']" | tee -a "$OUT_DIR/gpu_check.log"

t0=$(date +%s)
rc=0
OPFORGE_GPU_CASES=${OPFORGE_GPU_CASES:-40} $PY -m pytest -q -p no:cacheprovider --tb=short tests/python/test_cuda.py \
    2>&1 | tee "$OUT_DIR/pytest_cuda.log" | tail -30 || rc=$?
log "CUDA tests: exit $rc in $(( $(date +%s) - t0 )) s (log: pytest_cuda.log)"

t0=$(date +%s)
$PY benchmarks/bench_cuda.py --out "$OUT_DIR" --reps ${GPU_CHECK_REPS:-15} ${GPU_CHECK_QUICK:+--quick} 2>&1 | tee "$OUT_DIR/bench_cuda.log" | tail -40
log "benchmarks in $(( $(date +%s) - t0 )) s"
exit $rc
