"""The two ways MPI carries the buckets give the same training: staged through host buffers,
and the buffers handed to MPI directly (device pointers to a CUDA-aware MPI, e.g. Intel MPI
with I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda). Every rule of the registry, fp32 and bf16,
a few steps: 16-bit parameters bitwise (their gradients are exchanged and summed here in rank
order), fp32 within the rounding of MPI's own summation order. Then the step time of each path
on one larger bf16 model. On NumPy arrays "direct" is the host path and "staged" is
``stage_host=True``, so CI runs the same comparison.

    mpiexec -n N python -m mpi4py tests/cases/transport.py numpy|cupy [--elements 16M]
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from casekit import check
from zero1_mpi import Communicator
from zero1_mpi.kernels.backend import to_numpy, use_device, xp_for
from zero1_mpi.memory import parse_param_count
from zero1_mpi.rules.registry import builtin_rules

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
SHAPES = {"mat": (37, 29), "vec": (301,), "one": (1,)}


def communicator(xp, path):
    if xp is np:
        return Communicator(world, stage_host=path == "staged")
    return Communicator(world, cuda_aware=path == "direct")


def train(xp, entry, dtype, path, steps=4):
    comm = communicator(xp, path)
    params = {k: xp.asarray(np.random.default_rng([1, len(k)]).standard_normal(s)
                            .astype(np.float32)) for k, s in SHAPES.items()}
    opt = entry.optimizer(params, comm, param_dtype=dtype, bucket_elements=256,
                          max_grad_norm=1.0)
    for step in range(steps):
        rng = np.random.default_rng([7, step, rank])
        for k, s in SHAPES.items():
            opt.grads[k][...] = xp.asarray(rng.standard_normal(s).astype(np.float32))
        opt.step()
    result = [to_numpy(opt.params[k]).reshape(-1).copy() for k in SHAPES]
    return result, comm


def step_ms(xp, path, elements, steps=10):
    comm = communicator(xp, path)
    params = {"w": xp.asarray(np.random.default_rng(3).standard_normal(elements)
                              .astype(np.float32))}
    opt = builtin_rules()["adam"].optimizer(params, comm, param_dtype="bfloat16")
    times = []
    for _ in range(steps + 2):
        opt.grads["w"][...] = 1e-3
        world.Barrier()
        start = time.perf_counter()
        opt.step()
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[2:])), opt.memory_report().comm_scratch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["numpy", "cupy"])
    parser.add_argument("--elements", default="4M")
    args = parser.parse_args()
    xp = xp_for(args.backend)
    if xp is not np:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        use_device(node.Get_rank())
        node.Free()
    source = None
    for name, entry in builtin_rules().items():
        for dtype in ("float32", "bfloat16"):
            staged, _ = train(xp, entry, dtype, "staged")
            direct, comm = train(xp, entry, dtype, "direct")
            source = comm.cuda_aware_source if xp is not np else "host buffers"
            for a, b in zip(staged, direct):
                if dtype == "bfloat16":
                    check(np.array_equal(a.view(np.uint16), b.view(np.uint16)),
                          f"{name} {dtype}: the paths differ on rank {rank}")
                else:
                    check(np.allclose(a, b, rtol=1e-5, atol=1e-6),
                          f"{name} {dtype}: off by {np.max(np.abs(a - b))} on rank {rank}")
    elements = int(parse_param_count(args.elements))
    staged_ms, staged_scratch = step_ms(xp, "staged", elements)
    direct_ms, direct_scratch = step_ms(xp, "direct", elements)
    if rank == 0:
        print(f"TIME {args.backend} {size} ranks, bf16 Adam, {elements} parameters: staged "
              f"{staged_ms:.2f} ms/step ({staged_scratch} B scratch), direct {direct_ms:.2f} "
              f"ms/step ({direct_scratch} B scratch), staged/direct {staged_ms / direct_ms:.2f}")
        print(f"OK transport: {len(builtin_rules())} rules x fp32, bf16 on {size} ranks "
              f"({args.backend}; direct path: {source})")


if __name__ == "__main__":
    main()
