"""Collectives: the ways a ZeRO-1 step can move gradients and parameters, against Allreduce.

Times, in one run on the same buffers, the ways a ZeRO-1 step can move gradients and
parameters through ``zero1_mpi.Communicator``, against an ``Allreduce`` of the same gradients:

- fp32 gradients: ``Reduce_scatter_block`` + in-place ``Allgather`` (what ZeroAdam does).
- 16-bit gradients, summed in fp32 (``reduce_dtype="float32"``, the default): ``Alltoall`` of
  the 16-bit blocks + an fp32 sum in rank order, then ``Allgather`` of 16-bit parameters.
- 16-bit, upcast: the bucket converted to fp32, ``Reduce_scatter_block`` in fp32.
- float16 summed by MPI (``reduce_dtype="float16"``): ``Reduce_scatter_block`` on FLOAT16_T.

One row per --params count (gradient elements per buffer): the median milliseconds over
--repeat calls (the slowest rank each call, after one warm-up call) and the ratio to the fp32
Allreduce. These are the measurements behind ``reduce_dtype``'s default; 4 ranks on 2 cores are
oversubscribed. Example: mpiexec -n 2 python -m mpi4py tools/bench.py comm (or --ranks 2).
"""

from __future__ import annotations

import numpy as np

from . import common

RANKS, TIMEOUT = None, 900


def options(parser) -> None:
    parser.add_argument("--params", type=common.comma_list(common.count), default="1M,4M,16M,64M",
                        help="gradient elements per buffer, comma separated, one row each "
                        "(default 1M,4M,16M,64M)")
    parser.add_argument("--repeat", type=common.at_least(1), default=7,
                        help="timed calls of each (default 7)")


def worker(args) -> dict:
    from mpi4py import MPI

    from zero1_mpi import Communicator

    comm = Communicator(MPI.COMM_WORLD)
    return {"world_size": comm.size, "repeat": args.repeat,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "rows": [{"elements": n, "ms": measure(comm, MPI, n, args.repeat)}
                     for n in args.params]}


def measure(comm, MPI, n, repeat) -> dict:
    """Median ms of each way, on ``n`` gradient elements (rounded down to a multiple of N)."""
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

    ways = {"Allreduce fp32": allreduce, "RS+AG fp32": fp32_rs_ag,
            "16-bit: Alltoall + fp32 sum + AG": alltoall_fp32_sum,
            "16-bit: upcast + RS fp32 + AG": upcast_rs, "fp16: RS fp16 + AG": fp16_rs}
    return {name: common.median_phases(MPI.COMM_WORLD, lambda: {"ms": common.clock(fn) * 1e3},
                                       repeat, warmup=1)["ms"] for name, fn in ways.items()}


def report(args, results: list[dict]) -> list[dict]:
    for result in results:
        names = list(result["rows"][0]["ms"])
        print(f"ranks: {result['world_size']}, {result['mpi']}, median of {result['repeat']}, "
              "ms (ratio to Allreduce fp32)\n")
        print(common.row("elements", *names))
        print(common.rule("r" * (1 + len(names))))
        for found in result["rows"]:
            base = found["ms"]["Allreduce fp32"]
            print(common.row(f"{found['elements']:,}",
                             *(f"{t:.1f} ({t / base:.2f}x)" for t in found["ms"].values())))
    return results
