"""The engine's own array work, apart from any update rule: the sum of squares of a shard (for
the global gradient norm and overflow) and the fp32 sum of 16-bit blocks received from every
rank; and which CPU kernel family runs (``ZERO1_MPI_KERNEL``).

``NumpyReductions``, ``CupyReductions`` and the compiled ``kernels_numba.NumbaReductions``
give ``sum_of_squares(x)`` (float64 accumulation; inf and nan propagate; a 0-d device array for
CuPy, so no host sync), ``sum_blocks(blocks, out)`` (``out`` = the rows summed in fp32, in row
order, the same bits for every kind) and ``scratch_bytes``. Scratch is allocated once, never
per step. Nothing here imports ``kernels_numba`` (which imports this module).
"""

from __future__ import annotations

import os

import numpy as np

from . import backend

#: Elements per NumPy chunk: the fp32 scratch (2 x 256 KiB) stays in cache.
NUMPY_CHUNK = 1 << 16
#: Which CPU kernel to use: "auto" (Numba where it imports, else NumPy), "numba" or "numpy".
KERNEL_ENV = "ZERO1_MPI_KERNEL"


def resolve_cpu_kernel(environ=None) -> str:
    """``"numba"`` or ``"numpy"``, as ``ZERO1_MPI_KERNEL`` asks (default: Numba if it imports)."""
    choice = (os.environ if environ is None else environ).get(KERNEL_ENV, "auto").strip().lower()
    if choice not in ("auto", "numba", "numpy"):
        raise ValueError(f"{KERNEL_ENV}={choice!r} is not understood: use auto, numba or numpy")
    if choice == "numpy":
        return "numpy"
    try:
        import numba  # noqa: F401
    except ImportError:
        if choice == "numba":
            raise ImportError(f"{KERNEL_ENV}=numba but Numba does not import: "
                              "pip install 'zero1-mpi[fast]'") from None
        return "numpy"
    return "numba"


def sum_of_squares(x, scratch) -> float:
    """Sum of ``x**2``: BLAS dot products over chunks (16-bit ones widened into the fp32
    ``scratch`` first), accumulated in float64; inf and nan propagate."""
    total = 0.0
    for start in range(0, x.size, scratch.size):
        chunk = x[start:start + scratch.size]
        if chunk.dtype != np.float32:
            chunk = scratch[:chunk.size]
            np.copyto(chunk, x[start:start + scratch.size], casting="unsafe")
        total += float(np.dot(chunk, chunk))
    return total


def add_blocks(blocks, out, xp=np) -> None:
    """``out`` (fp32) = the rows of ``blocks`` summed in fp32, in row order."""
    out[...] = blocks[0]
    for block in blocks[1:]:
        xp.add(out, block, out=out, dtype=np.float32)


class NumpyReductions:
    def __init__(self, largest: int = NUMPY_CHUNK):
        self._scratch = np.empty(max(1, min(largest, NUMPY_CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes

    def sum_of_squares(self, x) -> float:
        return sum_of_squares(x, self._scratch)

    sum_blocks = staticmethod(add_blocks)


class CupyReductions:
    scratch_bytes = 0
    _kernel = None

    def sum_of_squares(self, x):
        if CupyReductions._kernel is None:
            kernel = backend.xp_for("cupy").ReductionKernel(
                "T x", "float64 total", "(double)(float)x * (double)(float)x", "a + b",
                "total = a", "0", "zero1_sum_of_squares")
            CupyReductions._kernel = backend.ExplainedKernel(kernel)
        return CupyReductions._kernel(x)

    @staticmethod
    def sum_blocks(blocks, out) -> None:
        add_blocks(blocks, out, backend.xp_for("cupy"))
