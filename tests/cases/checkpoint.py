"""Checkpoints saved on N ranks load on M ranks, for any N and M.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint.py save DIR/N<N>
    mpiexec -n M python -m mpi4py tests/cases/checkpoint.py load DIR

``save`` trains 6 steps, writes a sharded checkpoint and a consolidated export, trains 6 more
steps and exports again. ``load`` takes every ``DIR/N*`` and checks, on M ranks:
- the loaded optimizer state is bitwise the saved one (its consolidated export is identical);
- ``load_consolidated`` of the export gives the same state, bit for bit;
- training on after the load matches the float64 reference (the parity bound) and, when
  M == N, is bitwise the run that was never interrupted;
- no rank allocates more than a bounded buffer while saving or loading (tracemalloc).
"""

import sys
import tracemalloc
from pathlib import Path

import numpy as np
from mpi4py import MPI

from reference import ReferenceAdam, close_to_reference
from zero1_mpi import ZeroAdamW
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.checkpoint import CHUNK
from expect import check

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"scalar": (), "w": (17, 9), "empty": (0, 4), "v": (5,), "long": (2000,)}
DTYPES = ("float32", "bfloat16")
HALF = 6
MEMORY_LIMIT = 4 * CHUNK * 4  # a few chunk buffers, whatever the model size


def init_values():
    return {k: np.random.default_rng([9, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def make(dtype_name):
    return ZeroAdamW(init_values(), comm, lr=2e-2, weight_decay=0.05, param_dtype=dtype_name,
                     bucket_elements=500)


def grads_of(r, step, dtype):
    rng = np.random.default_rng([step, r])
    return {k: rng.standard_normal(s).astype(np.float32).astype(dtype) for k, s in SHAPES.items()}


def train(opt, steps):
    for step in steps:
        for k, g in grads_of(rank, step, opt.param_dtype).items():
            opt.grads[k][...] = g
        opt.step()


def peak_bytes(fn):
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, peak


def save(directory: Path):
    for dtype_name in DTYPES:
        out = directory / dtype_name
        opt = make(dtype_name)
        train(opt, range(1, HALF + 1))
        _, peak = peak_bytes(lambda: opt.save(out / "root"))
        check(peak < MEMORY_LIMIT, f"save allocated {peak} bytes")
        opt.save_consolidated(out / "half.safetensors")
        train(opt, range(HALF + 1, 2 * HALF + 1))
        opt.save_consolidated(out / "end.safetensors")
    if rank == 0:
        (directory / "world_size").write_text(str(size))


def same_file(a: Path, b: Path) -> bool:
    return comm.bcast(a.read_bytes() == b.read_bytes() if rank == 0 else None)


def load(directory: Path):
    checked = 0
    for saved in sorted(directory.glob("N*")):
        n_saved = int((saved / "world_size").read_text())
        for dtype_name in DTYPES:
            where = f"saved on {n_saved}, loaded on {size} ranks, {dtype_name}"
            out = saved / dtype_name
            scratch = directory / f"scratch-{size}-{n_saved}-{dtype_name}"

            opt = make(dtype_name)
            _, peak = peak_bytes(lambda: opt.load(out / "root"))
            check(peak < MEMORY_LIMIT, f"{where}: load allocated {peak} bytes")
            check(opt.step_count == HALF, where)
            opt.save_consolidated(scratch / "loaded.safetensors")
            check(same_file(scratch / "loaded.safetensors", out / "half.safetensors"), where)

            other = make(dtype_name)
            other.load_consolidated(out / "half.safetensors")
            check(np.array_equal(other.state.flat.view(np.uint8), opt.state.flat.view(np.uint8)))
            other.save_consolidated(scratch / "imported.safetensors")
            check(same_file(scratch / "imported.safetensors", out / "half.safetensors"), where)

            train(opt, range(HALF + 1, 2 * HALF + 1))
            check_against_reference(opt, n_saved, where)
            if n_saved == size:  # the same reductions as the uninterrupted run: bitwise
                opt.save_consolidated(scratch / "end.safetensors")
                check(same_file(scratch / "end.safetensors", out / "end.safetensors"), where)
            checked += 1
    if rank == 0:
        print(f"OK checkpoints: {checked} loads on {size} ranks")


def check_against_reference(opt, n_saved, where):
    dtype = resolve_dtype(opt.param_dtype)
    ref = ReferenceAdam(init_values(), lr=2e-2, weight_decay=0.05, decoupled=True)
    for step in range(1, 2 * HALF + 1):
        ranks = n_saved if step <= HALF else size
        every = [grads_of(r, step, dtype) for r in range(ranks)]
        ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
                  for k in SHAPES})
    for k in SHAPES:
        ok, err = close_to_reference(opt.params[k], ref.params[k], dtype)
        check(ok, f"{where}: {k!r} off by {err} after training on")


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
