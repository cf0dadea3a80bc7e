"""python tools/gpu_bench.py [--elements 64M]   (one GPU; run by tools/gpu_check.sh)

On the GPU, in one run: the effective bandwidth of zero1_mpi's fused CuPy Adam kernel (fp32 and
bf16 parameters) against the device's copy bandwidth (target: >= 85%), beside
``torch.optim.AdamW(fused=True)`` on CUDA when torch has CUDA; and the time of moving one
bucket through the communicator: staged through pinned host memory, directly (only if MPI is
CUDA-aware) and through NCCL. Prints a markdown table.
"""

import argparse
import sys
from pathlib import Path

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy
import numpy as np
from mpi4py import MPI

from zero1_mpi import Communicator
from zero1_mpi.backend import BFLOAT16
from zero1_mpi.kernels import AdamScalars, CupyAdam
from zero1_mpi.memory import parse_param_count


def seconds(fn, repeat=10):
    """Median device time of ``fn`` (CUDA events), after a warm-up."""
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="64M")
    args = parser.parse_args(argv)
    n = parse_param_count(args.elements)
    rows = []

    src, dst = cupy.ones(n, np.float32), cupy.empty(n, np.float32)
    copy = 2 * src.nbytes / seconds(lambda: cupy.copyto(dst, src)) / 1e9
    rows.append(("device copy (read + write)", copy, "100%"))
    s = AdamScalars.for_step(1, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                             decoupled=True)
    grad, m, v = cupy.full(n, 1e-3, np.float32), cupy.zeros(n, np.float32), \
        cupy.zeros(n, np.float32)
    master = cupy.ones(n, np.float32)
    kernel = CupyAdam()
    for name, param, nbytes in (("zero1 CuPy Adam, fp32 params", None, 28),
                                ("zero1 CuPy Adam, bf16 params", cupy.ones(n, BFLOAT16), 30)):
        t = seconds(lambda: kernel(grad, master, m, v, param, s))
        rows.append((name, nbytes * n / t / 1e9, f"{nbytes * n / t / 1e9 / copy:.0%}"))
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.nn.Parameter(torch.ones(n, device="cuda"))
            p.grad = torch.full((n,), 1e-3, device="cuda")
            opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
            t = seconds(opt.step)
            rows.append(("torch AdamW(fused=True), fp32", 28 * n / t / 1e9,
                         f"{28 * n / t / 1e9 / copy:.0%}"))
    except ImportError:
        pass

    print(f"{n:,} elements\n\n| what | GB/s | of copy |\n|---|---:|---:|")
    for name, gbs, share in rows:
        print(f"| {name} | {gbs:.0f} | {share} |")

    bucket = cupy.ones(1 << 22, np.float32)
    recv = cupy.empty_like(bucket)
    comms = [("staged through pinned host memory", Communicator(MPI.COMM_SELF,
                                                                cuda_aware=False))]
    if Communicator(MPI.COMM_SELF).cuda_aware:
        comms.append(("direct (CUDA-aware MPI)", Communicator(MPI.COMM_SELF, cuda_aware=True)))
    try:
        from zero1_mpi.nccl import NcclCommunicator
        comms.append(("NCCL", NcclCommunicator(MPI.COMM_SELF)))
    except ImportError as exc:
        print(f"(no NCCL: {exc})")
    print("\n| one 4M-element fp32 bucket, 1 rank | alltoall ms | allgather ms |\n|---|---:|---:|")
    for name, comm in comms:
        a2a = seconds(lambda: comm.alltoall(bucket, recv))
        gather = seconds(lambda: comm.allgather_inplace(bucket))
        print(f"| {name} | {a2a * 1e3:.2f} | {gather * 1e3:.2f} |")


if __name__ == "__main__":
    main()
