"""Bytes each rank allocates, measured with tracemalloc (NumPy's buffers are traced), not derived.

    mpiexec -n N python -m mpi4py tests/cases/memory.py DIR

For fp32 and bf16 parameters and two model sizes Ψ, on every rank:
- what the optimizer holds after a step equals ``memory_report().total`` (within the few KB of
  Python objects around the arrays);
- what it holds grows with Ψ exactly as the formula does (2Ψ + 2Ψ + 12Ψ/N, or 4Ψ + 4Ψ + 8Ψ/N
  for fp32), up to the padding of the last bucket: state that is not sharded (an exp_avg of
  full length, say) grows by Ψ-proportional bytes more and fails;
- the excess over the formula (padding and scratch) does not grow with Ψ.
And saving and loading a checkpoint, and exporting and importing the consolidated file, never
allocate more than ``LIMIT`` on any rank, for a model whose whole state is several times that
(a save that gathers the state on one rank would exceed it).
"""

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from zero1_mpi import ZeroAdamW
from zero1_mpi.checkpoint import CHUNK

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SIZES = (300_000, 900_000)      # Ψ: the second adds 600k elements
PYTHON_OBJECTS = 64 * 1024      # views, layout, dicts around the arrays
LIMIT = 4 * CHUNK * 4           # 16 MiB: a few chunk buffers, whatever the model size


def shapes(psi):
    return {"w": (psi // 1000 - 1, 1000), "b": (1000,), "odd": (psi % 1000 or 1,)}


def held_after_a_step(psi, dtype_name):
    """(bytes the optimizer holds, measured; its memory_report) after one step."""
    init = {k: np.ones(s, np.float32) for k, s in shapes(psi).items()}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    opt = ZeroAdamW(init, comm, param_dtype=dtype_name, bucket_elements=1 << 18)
    for g in opt.grads.values():
        g[...] = 1e-3
    opt.step()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, opt.memory_report()


def check_held_memory():
    for dtype_name in ("float32", "bfloat16"):
        (small, small_report), (large, large_report) = (held_after_a_step(psi, dtype_name)
                                                        for psi in SIZES)
        for held, report in ((small, small_report), (large, large_report)):
            check(abs(held - report.total) <= PYTHON_OBJECTS,
                  f"{dtype_name}: memory_report().total={report.total}, measured {held}")
        grown = large - small
        formula_grown = large_report.formula_bytes - small_report.formula_bytes
        padding = 64 * size * 4 * 4  # one bucket's alignment, in every buffer
        check(abs(grown - formula_grown) <= padding + PYTHON_OBJECTS,
              f"{dtype_name}: {SIZES[1] - SIZES[0]} more parameters took {grown} bytes more on "
              f"rank {rank}; the formula says {formula_grown:.0f}")
        excess = [held - r.formula_bytes for held, r in ((small, small_report),
                                                          (large, large_report))]
        check(excess[1] - excess[0] <= padding + PYTHON_OBJECTS,
              f"{dtype_name}: the excess over the formula grew from {excess[0]:.0f} to "
              f"{excess[1]:.0f} bytes")


def peak(fn):
    gc.collect()
    tracemalloc.start()
    fn()
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top


def check_checkpoint_peaks(directory: Path):
    psi = 3 * 1024 * 1024  # fp32 state: 36 MiB in all, 12 MiB per rank on 3 ranks
    init = {k: np.ones(s, np.float32) for k, s in shapes(psi).items()}
    opt = ZeroAdamW(init, comm)
    for g in opt.grads.values():
        g[...] = 1e-3
    opt.step()
    check(12 * psi > 2 * LIMIT, "the model is too small to tell a gathering save")
    for what, fn in (("save", lambda: opt.save(directory / "root")),
                     ("load", lambda: opt.load(directory / "root")),
                     ("save_consolidated", lambda: opt.save_consolidated(directory / "all.st")),
                     ("load_consolidated", lambda: opt.load_consolidated(directory / "all.st"))):
        top = peak(fn)
        check(top < LIMIT, f"{what} allocated {top} bytes on rank {rank} (limit {LIMIT})")


if __name__ == "__main__":
    check_held_memory()
    check_checkpoint_peaks(Path(sys.argv[1]))
    if rank == 0:
        print(f"OK measured memory on {size} ranks")
