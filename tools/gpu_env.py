"""python tools/gpu_env.py   (run by tools/gpu_check.sh)

Prints what the GPU path will run on: the device, CuPy and its CUDA runtime and NVRTC, whether
NCCL is usable, the MPI library and whether it says it is CUDA-aware, and torch's CUDA. Exits
non-zero when CuPy sees no GPU, so a GPU check on a machine without one fails at once.
"""

import sys
from pathlib import Path

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import mpi4py
    from mpi4py import MPI

    from zero1_mpi.comm.capabilities import query_cuda_support, resolve_cuda_aware

    print(f"python {sys.version.split()[0]}; mpi4py {mpi4py.__version__}; "
          f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    print(f"MPIX_Query_cuda_support: {query_cuda_support()}; "
          f"zero1_mpi decides cuda_aware={resolve_cuda_aware()}")
    try:
        import torch
        print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    except ImportError:
        print("torch: not installed")
    import cupy
    runtime = cupy.cuda.runtime
    count = runtime.getDeviceCount()
    print(f"cupy {cupy.__version__}; CUDA runtime {runtime.runtimeGetVersion()}, driver "
          f"{runtime.driverGetVersion()}; NVRTC {cupy.cuda.nvrtc.getVersion()}; {count} GPU(s)")
    for index in range(count):
        props = runtime.getDeviceProperties(index)
        print(f"  GPU {index}: {props['name'].decode()}, compute capability "
              f"{props['major']}.{props['minor']}, {props['totalGlobalMem'] / 2**30:.0f} GiB")
    try:
        from cupy.cuda import nccl
        print(f"NCCL: available={getattr(nccl, 'available', '?')}, "
              f"version {nccl.get_version() if getattr(nccl, 'available', True) else None}")
    except Exception as exc:  # noqa: BLE001 - report whatever stops NCCL
        print(f"NCCL: unusable ({type(exc).__name__}: {exc})")
    return 0 if count > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
