#!/usr/bin/env bash
# GPU checks for zero1_mpi, one command on one GPU with CuPy installed (a few minutes):
#   bash tools/gpu_check.sh            # results in bench-out/gpu-check/ (or $GPU_CHECK_OUT)
# Each check runs under its own timeout and the script goes on after a failure, so one run
# reports everything; it exits non-zero if any check failed. The checks: the environment (GPU,
# CuPy, NCCL, MPI and whether it is CUDA-aware), tests/test_gpu.py with ZERO1_REQUIRE_GPU=1
# (a missing GPU or CuPy fails instead of skipping), tools/gpu_compile_check.py against the
# kernel sources CuPy compiled in those tests, `tools/bench.py gpu`, the main example on
# CuPy arrays and, where torch has CUDA, the torch example on DLPack views of CuPy buffers
# beside the same run with DDP and the GPT example on one rank beside torch's fused AdamW in
# one process (tokens/s), all multi-rank runs on 2 ranks (they may share a GPU), launched
# through zero1_mpi.launcher. Then Intel MPI with device buffers (CUDA-aware; its slim runtime
# from .whl/impi-rt-slim.tar.xz, made by tools/pack_mpi.py): tools/mpi_probe.py --device, the
# staged and CUDA-aware paths against each other with their step times on 2 and 4 ranks
# sharing the GPU (tests/cases/transport.py), the example on that path with its final losses
# compared to the staged runs'; `tools/bench.py offload` (a 1B-parameter bf16 model) and
# `tools/bench.py state --backend cupy` (each way of keeping the state: step time and bytes).
# Output: gpu_check.log (everything printed), summary.md and summary.json (one line per check,
# the benchmarks' tables, the offload figures and the GPT tokens/s ratio).
#
# MPI: wheels in ./.whl (mpi4py and mpich, for machines with no registry: tools/pack_mpi.py puts
# them there) are used first, unpacked under /tmp; else the system's mpiexec; else
# `pip install mpich mpi4py`.
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
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
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
check "bench gpu" 180 "$PY" tools/bench.py gpu --params 256M --markdown "$OUT_DIR/bench.md" \
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
  # The GPT example on the GPU, one rank: zero1_mpi against torch.optim.AdamW(fused=True).
  GPT=(examples/gpt_torch.py --device cuda --steps 80 --layers 6 --dim 384 --heads 6
       --context 256 --batch 32 --sample 0 --log-every 20)
  for ref in none fused; do
    check "gpt_torch cuda $ref" 180 "$PY" -m zero1_mpi.launcher -n 1 -- "$PY" -m mpi4py \
      "${GPT[@]}" --reference "$ref"
  done
fi

# Intel MPI with device buffers handed to MPI (I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda).
if [ -f .whl/impi-rt-slim.tar.xz ]; then
  impi=/tmp/zero1-gpu-check-impi
  rm -rf "$impi" && mkdir -p "$impi"
  "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    .whl/impi-rt-slim.tar.xz "$impi"
  IMPI=(env I_MPI_ROOT="$impi/impi" PATH="$impi/impi/bin:$PATH" FI_PROVIDER_PATH="$impi/impi/lib"
        LD_LIBRARY_PATH="$impi/impi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        MPI4PY_LIBMPI="$impi/impi/lib/libmpi.so.12" I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda)
  LAUNCH=("$PY" -m zero1_mpi.launcher)
  # What zero1_mpi uses there (nonblocking): the persistent in-place allgather on device
  # buffers gave wrong blocks on the 2026-12-04 run (docs/gpus.md), so it is not probed here.
  check "impi mpi_probe --device" 150 "${IMPI[@]}" "${LAUNCH[@]}" -n 2 -- "$PY" -m mpi4py \
    tools/mpi_probe.py --device --mode default --iterations 4
  for n in 2 4; do
    check "impi transport cupy $n ranks" 180 "${IMPI[@]}" "${LAUNCH[@]}" -n "$n" -- \
      "$PY" -m mpi4py tests/cases/transport.py cupy --elements 32M
  done
  for dtype in float32 bfloat16; do
    check "impi train_mlp cupy $dtype" 120 "${IMPI[@]}" "${LAUNCH[@]}" -n 2 -- "$PY" -m mpi4py \
      examples/train_mlp.py --backend cupy --dtype "$dtype" --steps 100
  done
  # bf16: digit for digit (16-bit gradients are summed here, in rank order); fp32: MPI sums
  # in its own order on each path.
  check "train_mlp bf16 loss: staged == cuda-aware" 30 "$PY" tools/same_losses.py "$LOG" \
    "train_mlp cupy bfloat16=impi train_mlp cupy bfloat16"
  check "train_mlp fp32 loss: staged ~ cuda-aware" 30 "$PY" tools/same_losses.py "$LOG" \
    --rtol 1e-5 "train_mlp cupy float32=impi train_mlp cupy float32"
else
  echo "=== intel mpi: FAIL: no .whl/impi-rt-slim.tar.xz (python tools/pack_mpi.py)" | tee -a "$LOG"
  results+=("impi (cuda-aware)|FAIL (no .whl/impi-rt-slim.tar.xz)|0")
  failed=$((failed + 1))
fi
check "bench offload" 300 "$PY" tools/bench.py offload --params 1B --steps 2 \
  --json "$OUT_DIR/offload.json"
check "bench state" 120 "$PY" tools/bench.py state --backend cupy --params 64M --steps 5 \
  --json "$OUT_DIR/state.json"

{
  echo "| check | result | seconds |"
  echo "|---|---|---:|"
  for row in "${results[@]}"; do IFS='|' read -r n v t <<<"$row"; echo "| $n | $v | $t |"; done
  [ -f "$OUT_DIR/bench.md" ] && { echo; cat "$OUT_DIR/bench.md"; }
} >"$OUT_DIR/summary.md"
"$PY" - "$OUT_DIR" "${results[@]}" <<'EOF'
import json, os, re, sys
out, rows = sys.argv[1], sys.argv[2:]
checks = [dict(zip(("check", "result", "seconds"), r.split("|"))) for r in rows]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
log = open(os.path.join(out, "gpu_check.log")).read()
gpt = {ref: float(m.group(1)) for ref in ("none", "fused") for m in [re.search(
    rf"^=== gpt_torch cuda {ref}: .*?; (\d+) tokens/s \(median.*?^=== gpt_torch cuda {ref}: ",
    log, re.S | re.M)] if m}
if len(gpt) == 2:
    gpt["zero1_over_fused"] = gpt["none"] / gpt["fused"]
transport = [dict(zip(("ranks", "staged_ms", "cuda_aware_ms"), map(float, found))) for found
             in re.findall(r"^TIME cupy (\d+) ranks, .*? staged ([\d.]+) ms/step .*? direct "
                           r"([\d.]+) ms/step", log, re.M)]
summary = {"checks": checks, "bench": load("bench.json"), "offload": load("offload.json"),
           "state": load("state.json"),
           "gpt_tokens_per_s": gpt or None, "staged_vs_cuda_aware": transport or None}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF
cat "$OUT_DIR/summary.md"
echo "gpu_check: ${SECONDS}s in all (the device script must fit in 8 minutes)"
if [ "$failed" -ne 0 ]; then
  echo "gpu_check: $failed check(s) FAILED (see $LOG)"
  exit 1
fi
echo "gpu_check: OK"
