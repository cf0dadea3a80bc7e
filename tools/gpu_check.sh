#!/usr/bin/env bash
# GPU checks for zero1_mpi, one command on one GPU with CuPy installed (a few minutes):
#   bash tools/gpu_check.sh            # results in bench-out/gpu-check/ (or $GPU_CHECK_OUT)
# Each check runs under its own timeout and the script goes on after a failure, so one run
# reports everything; it exits non-zero if any check failed. The checks: the environment (GPU,
# CuPy, NCCL, MPI and whether it is CUDA-aware), tests/test_gpu.py with ZERO1_REQUIRE_GPU=1
# (a missing GPU or CuPy fails instead of skipping), tools/gpu_compile_check.py against the
# kernel sources CuPy compiled in those tests, tools/gpu_bench.py, the main example on
# CuPy arrays and, where torch has CUDA, the torch example on DLPack views of CuPy buffers
# beside the same run with DDP, all multi-rank runs on 2 ranks (they may share a GPU), launched
# through zero1_mpi.launcher.
# Output: gpu_check.log (everything printed), summary.md and summary.json (one line per check,
# and the benchmark's table).
#
# MPI: wheels in ./.whl (mpi4py and mpich, for machines with no registry) are used first,
# unpacked under /tmp; else the system's mpiexec; else `pip install mpich mpi4py`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-bench-out/gpu-check}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"

if ls .whl/mpi4py-*.whl .whl/mpich-*.whl >/dev/null 2>&1; then
  site=/tmp/zero1-gpu-check
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site/site" .whl/*.whl
  # pip --target drops a wheel's data files (MPICH's lib/ and bin/): unpack those ourselves.
  "$PY" -m zipfile -e .whl/mpich-*.whl "$site/mpich"
  mpich=$(echo "$site"/mpich/mpich-*.data/data)
  chmod +x "$mpich"/bin/*
  export PYTHONPATH=$site/site${PYTHONPATH:+:$PYTHONPATH} PATH=$mpich/bin:$PATH
  export LD_LIBRARY_PATH=$mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
elif ! command -v mpiexec >/dev/null; then
  "$PY" -m pip install -q mpich mpi4py ml_dtypes
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export ZERO1_REQUIRE_GPU=1
export PYTHONUNBUFFERED=1

results=()
failed=0
check() {  # check NAME TIMEOUT_S COMMAND...: run it, log its output, record pass/fail and time
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local took
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  local verdict=PASS
  if [ "$rc" -ne 0 ]; then
    verdict=FAIL
    failed=$((failed + 1))
    [ "$rc" -eq 124 ] && verdict="FAIL (timeout ${limit}s)"
  fi
  echo "=== $name: $verdict in ${took}s" | tee -a "$LOG"
  results+=("$name|$verdict|$took")
}

check environment 120 "$PY" tools/gpu_env.py
# CuPy keeps the CUDA source of every kernel it compiles in this cache, so that afterwards the
# compile check can prove its sources (what CI compiles without a GPU) are the ones that ran.
export CUPY_CACHE_DIR=/tmp/zero1-gpu-check-cupy-cache CUPY_CACHE_SAVE_CUDA_SOURCE=1
rm -rf "$CUPY_CACHE_DIR"
check test_gpu 420 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py
check gpu_compile_check 180 "$PY" tools/gpu_compile_check.py --against "$CUPY_CACHE_DIR"
check gpu_bench 180 "$PY" tools/gpu_bench.py --elements 256M --markdown "$OUT_DIR/bench.md" \
  --json "$OUT_DIR/bench.json"
for dtype in float32 bfloat16; do
  check "train_mlp cupy $dtype" 120 "$PY" -m zero1_mpi.launcher -n 2 -- "$PY" -m mpi4py \
    examples/train_mlp.py --backend cupy --dtype "$dtype" --steps 100
done
# A torch CUDA model whose parameters and .grad are DLPack views of CuPy buffers, against DDP.
if "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  for ref in none ddp; do
    check "torch_autograd cuda $ref" 180 "$PY" -m zero1_mpi.launcher -n 2 -- "$PY" -m mpi4py \
      examples/torch_autograd.py --device cuda --steps 60 --reference "$ref"
  done
fi

{
  echo "| check | result | seconds |"
  echo "|---|---|---:|"
  for row in "${results[@]}"; do IFS='|' read -r n v t <<<"$row"; echo "| $n | $v | $t |"; done
  [ -f "$OUT_DIR/bench.md" ] && { echo; cat "$OUT_DIR/bench.md"; }
} >"$OUT_DIR/summary.md"
"$PY" - "$OUT_DIR" "${results[@]}" <<'EOF'
import json, os, sys
out, rows = sys.argv[1], sys.argv[2:]
checks = [dict(zip(("check", "result", "seconds"), r.split("|"))) for r in rows]
bench = os.path.join(out, "bench.json")
summary = {"checks": checks,
           "bench": json.load(open(bench)) if os.path.exists(bench) else None}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF
cat "$OUT_DIR/summary.md"
if [ "$failed" -ne 0 ]; then
  echo "gpu_check: $failed check(s) FAILED (see $LOG)"
  exit 1
fi
echo "gpu_check: OK"
