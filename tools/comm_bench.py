"""mpiexec -n 2 python -m mpi4py tools/comm_bench.py [--sizes 1M,4M,16M,64M] [--repeat 7]

Times, in one run on the same buffers, the ways a ZeRO-1 step can move gradients and
parameters through ``zero1_mpi.Communicator``, against an ``Allreduce`` of the same gradients:

- fp32 gradients: ``Reduce_scatter_block`` + in-place ``Allgather`` (what ZeroAdam does).
- 16-bit gradients, summed in fp32 (``reduce_dtype="float32"``, the default): ``Alltoall`` of
  the 16-bit blocks + an fp32 sum in rank order, then ``Allgather`` of 16-bit parameters.
- 16-bit, upcast: the bucket converted to fp32, ``Reduce_scatter_block`` in fp32.
- float16 summed by MPI (``reduce_dtype="float16"``): ``Reduce_scatter_block`` on FLOAT16_T.

Rank 0 prints a markdown table: median milliseconds and the ratio to the fp32 Allreduce. These
are the measurements behind ``reduce_dtype``'s default; 4 ranks on 2 cores are oversubscribed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero1_mpi import Communicator
from zero1_mpi.memory import parse_param_count


def timed(comm, fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # the slowest rank decides each collective's time
    return MPI.COMM_WORLD.allreduce(statistics.median(times), op=MPI.MAX) * 1e3


def bench_size(comm, n, repeat):
    size, rank = comm.size, comm.rank
    n -= n % size
    shard = n // size
    grads32 = np.random.default_rng(rank).standard_normal(n).astype(np.float32) / 16
    grads16 = grads32.astype(np.float16)
    params16 = np.zeros(n, np.float16)
    allreduced = np.empty_like(grads32)
    reduced32 = np.empty(shard, np.float32)
    received = np.empty(n, np.float16)
    upcast = np.empty(n, np.float32)
    params32 = np.zeros(n, np.float32)

    def allreduce():
        MPI.COMM_WORLD.Allreduce(grads32, allreduced, op=MPI.SUM)

    # Reductions run in place, as in the optimizer; the contents they overwrite (one block,
    # growing x size per call) do not change the timing.
    def fp32_rs_ag():
        comm.reduce_scatter_sum(grads32)
        comm.allgather_inplace(params32)

    def alltoall_fp32_sum():
        comm.alltoall(grads16, received)
        blocks = received.reshape(size, shard)
        reduced32[...] = blocks[0]
        for block in blocks[1:]:
            np.add(reduced32, block, out=reduced32, dtype=np.float32)
        comm.allgather_inplace(params16)

    def upcast_rs():
        upcast[...] = grads16
        comm.reduce_scatter_sum(upcast)
        comm.allgather_inplace(params16)

    def fp16_rs():
        comm.reduce_scatter_sum(grads16)
        comm.allgather_inplace(params16)

    return {name: timed(comm, fn, repeat) for name, fn in [
        ("Allreduce fp32", allreduce), ("RS+AG fp32", fp32_rs_ag),
        ("16-bit: Alltoall + fp32 sum + AG", alltoall_fp32_sum),
        ("16-bit: upcast + RS fp32 + AG", upcast_rs), ("fp16: RS fp16 + AG", fp16_rs)]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M",
                        help="gradient elements per buffer, comma separated")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    sizes = [parse_param_count(s) for s in args.sizes.split(",")]
    rows = [(n, bench_size(comm, n, args.repeat)) for n in sizes]
    if comm.rank == 0:
        names = list(rows[0][1])
        print(f"ranks: {comm.size}, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"median of {args.repeat}, ms (ratio to Allreduce fp32)\n")
        print("| elements | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for n, times in rows:
            base = times["Allreduce fp32"]
            cells = [f"{t:.1f} ({t / base:.2f}x)" for t in times.values()]
            print(f"| {n:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
