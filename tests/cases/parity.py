"""N ranks == one process: ZeroAdam/ZeroAdamW against the float64 reference on averaged grads.

Run on any number of ranks: ``mpiexec -n N python -m mpi4py tests/cases/parity.py [cupy]``
(``cupy``: parameters on the GPU, picked by node-local rank). Every rank
draws every rank's gradients from seeded generators, so each rank can run the reference itself
and check its own (full) parameters. Any mismatch raises, which aborts the job.
"""

import hashlib
import sys

import numpy as np
from mpi4py import MPI

from reference import ReferenceAdam, close_to_reference
from zero1_mpi import ZeroAdam, ZeroAdamW
from zero1_mpi.backend import resolve_dtype, to_numpy, xp_for
from expect import check

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "numpy"
USE_NCCL = sys.argv[2:3] == ["nccl"]  # CuPy buffers through zero1_mpi.nccl instead of MPI
xp = xp_for(BACKEND)

STEPS = 20
AWKWARD = {"scalar": (), "empty": (0, 3), "one": (1,), "vec": (7,), "mat": (5, 13),
           "cube": (3, 1, 7), "wide": (2, 129)}
LAYOUTS = {
    "awkward": (AWKWARD, {}),
    # Buckets of one quantum (64 x ranks): tensors straddle shards and buckets.
    "awkward-buckets": ({**AWKWARD, "long": (700,)}, {"bucket_elements": 1}),
    "fewer-than-ranks": ({"s": ()}, {}),
    "thousands": ({f"t{i}": (1 + i % 5,) for i in range(2000)}, {"bucket_elements": 1500}),
    # Shards of over 65,536 elements (NUMPY_CHUNK) on up to 4 ranks: the CPU kernels' chunks.
    "chunks": ({"big": (270_001,)}, {}),
}
ONE_COMBINATION = ("thousands", "chunks")  # slow layouts: one optimizer per dtype is enough


def grads_of(rank, step, shapes, dtype):
    """Ranks' gradients differ in size (x1, x2, x4, ...), so the sum's rounding is exercised."""
    rng = np.random.default_rng([7, step, rank])
    return {k: (rng.standard_normal(s).astype(np.float32) * 2.0 ** rank).astype(dtype)
            for k, s in shapes.items()}


def is_view_of(view, flat) -> bool:
    """``view``'s bytes lie inside ``flat``'s, by address: one test for NumPy and CuPy arrays
    (CuPy's exact ``shares_memory`` said False for the 0-d views here on CuPy 14.2)."""
    if view.size == 0:
        return True
    face = "__cuda_array_interface__" if BACKEND == "cupy" else "__array_interface__"
    start = getattr(flat, face)["data"][0]
    at = getattr(view, face)["data"][0]
    return start <= at and at + view.nbytes <= start + flat.nbytes


def check_case(comm, layout_name, dtype_name, cls, weight_decay):
    shapes, options = LAYOUTS[layout_name]
    dtype = resolve_dtype(dtype_name)
    rank, size = comm.Get_rank(), comm.Get_size()
    # Ranks start from different values: rank 0's must win the broadcast.
    init = {k: xp.asarray(np.random.default_rng([3, rank]).standard_normal(s).astype(np.float32))
            for k, s in shapes.items()}
    hyper = {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6} if "buckets" in layout_name else \
        {"lr": 1e-2}  # torch's default betas and eps elsewhere
    if USE_NCCL:
        from zero1_mpi.nccl import NcclCommunicator
        comm = NcclCommunicator(comm)
    opt = cls(init, comm, weight_decay=weight_decay, param_dtype=dtype_name, **hyper, **options)
    rank0_init = {k: np.random.default_rng([3, 0]).standard_normal(s).astype(np.float32)
                  for k, s in shapes.items()}
    ref = ReferenceAdam(rank0_init, weight_decay=weight_decay, decoupled=cls is ZeroAdamW,
                        **hyper)
    for name in shapes:
        check(is_view_of(opt.params[name], opt.state.flat), name)
        check(is_view_of(opt.grads[name], opt.gradients.buffer), name)
        check(opt.params[name].shape == shapes[name] and opt.params[name].dtype == dtype)

    for step in range(1, STEPS + 1):
        opt.zero_grad()
        for k, g in grads_of(rank, step, shapes, dtype).items():
            opt.grads[k][...] = xp.asarray(g)
        opt.step()
        every = [grads_of(r, step, shapes, dtype) for r in range(size)]
        ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
                  for k in shapes})

        for k in shapes:
            ok, err = close_to_reference(to_numpy(opt.params[k]), ref.params[k], dtype)
            if not ok:
                raise AssertionError(f"{layout_name}/{dtype_name}/{cls.__name__}/wd="
                                     f"{weight_decay}: step {step}, {k!r} off by {err} on rank "
                                     f"{rank} of {size}")
    digest = hashlib.sha256(to_numpy(opt.state.flat).tobytes()).hexdigest()
    if len(set(MPI.COMM_WORLD.allgather(digest))) != 1:
        raise AssertionError(f"{layout_name}/{dtype_name}: parameters differ between ranks")
    return opt.kernel


def main():
    comm = MPI.COMM_WORLD
    if BACKEND == "cupy":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        xp.cuda.Device(local % xp.cuda.runtime.getDeviceCount()).use()
    cases, kernels = 0, set()
    for layout_name in LAYOUTS:
        for dtype_name in ("float32", "float16", "bfloat16"):
            for cls, wd in ((ZeroAdam, 0.0), (ZeroAdam, 0.1), (ZeroAdamW, 0.1)):
                if layout_name in ONE_COMBINATION and (cls, wd) != (ZeroAdamW, 0.1):
                    continue
                kernels.add(check_case(comm, layout_name, dtype_name, cls, wd))
                cases += 1
    if comm.Get_rank() == 0:
        via = " via NCCL" if USE_NCCL else ""
        print(f"OK parity: {cases} cases x {STEPS} steps on {comm.Get_size()} ranks "
              f"({BACKEND}{via}, kernel {'+'.join(sorted(kernels))})")


if __name__ == "__main__":
    main()
