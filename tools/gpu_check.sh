#!/usr/bin/env bash
# GPU checks for zero1_mpi, in under 5 minutes on one GPU with CuPy installed:
#   bash tools/gpu_check.sh
# Runs tests/test_gpu.py with ZERO1_REQUIRE_GPU=1 (a missing GPU or CuPy fails instead of
# skipping), the main example on CuPy arrays and, where torch has CUDA, the torch example on
# DLPack views of CuPy buffers (beside the same run with DDP), all under mpiexec -n 2. MPI comes from the system
# or from the mpich wheel; wheels in ./.whl (if present) are installed first for offline machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/zero1-site .whl/*.whl
  export PYTHONPATH=/tmp/zero1-site:${PYTHONPATH:-}
  export PATH=/tmp/zero1-site/bin:$PATH
fi
command -v mpiexec >/dev/null || { "$PY" -m pip install -q mpich mpi4py ml_dtypes; }
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export ZERO1_REQUIRE_GPU=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
timeout 240 "$PY" -m pytest -q -rs tests/test_gpu.py
timeout 60 "$PY" tools/gpu_bench.py
for dtype in float32 bfloat16; do
  timeout 60 mpiexec -n 2 "$PY" -m mpi4py examples/train_mlp.py --backend cupy --dtype "$dtype" --steps 100
done
# A torch CUDA model whose parameters and .grad are DLPack views of CuPy buffers, against DDP.
if "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  for ref in none ddp; do
    timeout 120 mpiexec -n 2 "$PY" -m mpi4py examples/torch_autograd.py --device cuda --steps 60 \
      --reference "$ref" | grep -v '^losses'
  done
fi
echo "gpu_check: OK"
