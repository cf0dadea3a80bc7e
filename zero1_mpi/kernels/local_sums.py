"""The engine's own array work, apart from any update rule, in three twins; and which CPU kernel
family runs (``ZERO1_MPI_KERNEL``).

``reductions_for(kind, largest)`` gives ``sum_of_squares(x)`` (of a shard, for the global
gradient norm and overflow: float64 accumulation, inf and nan propagate; a 0-d device array
for CuPy, so no host sync), ``sum_blocks(blocks, out)`` (``out`` = the rows of 16-bit blocks
received from every rank summed in fp32, in row order, the same bits for every kind) and
``scratch_bytes``. Scratch is allocated once, never per step.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import backend
from .numba_shared import CHUNK, FP16_TABLE, compile_marked, encoding, jit, widen

__all__ = [
    "reductions_for",
    "KernelFamilies",
    "resolve_cpu_kernel",
    "sum_of_squares",
    "add_blocks",
    "NumpyReductions",
    "NumbaReductions",
    "CupyReductions",
    "NUMPY_CHUNK",
    "KERNEL_ENV",
]

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
            raise ImportError(
                f"{KERNEL_ENV}=numba but Numba does not import: pip install 'zero1-mpi[fast]'"
            ) from None
        return "numpy"
    return "numba"


def reductions_for(kind: str, largest: int):
    """The engine's reductions for the kernel family ``kind`` (``"cupy"``, ``"numba"`` or
    ``"numpy"``); ``largest``: the most elements one call sees (it caps the scratch)."""
    if kind == "cupy":
        return CupyReductions()
    if kind == "numba":
        return NumbaReductions(largest)
    return NumpyReductions(largest)


class KernelFamilies:
    """Which kernel family runs where, decided once per optimizer and handed to its parts:
    ``device`` where the parameters live (``"cupy"`` for CuPy parameters, else the CPU family)
    and ``host`` for the host's share of an offloaded state (the CPU family, resolved at its
    first use: CuPy parameters without offload never import Numba for it)."""

    def __init__(self, backend: str, environ=None):
        self._environ = environ
        self.device = "cupy" if backend == "cupy" else self.host

    @functools.cached_property
    def host(self) -> str:
        return resolve_cpu_kernel(self._environ)


def sum_of_squares(x, scratch) -> float:
    """Sum of ``x**2``: BLAS dot products over chunks (16-bit ones widened into the fp32
    ``scratch`` first), accumulated in float64; inf and nan propagate."""
    total = 0.0
    for start in range(0, x.size, scratch.size):
        chunk = x[start : start + scratch.size]
        if chunk.dtype != np.float32:
            chunk = scratch[: chunk.size]
            np.copyto(chunk, x[start : start + scratch.size], casting="unsafe")
        total += float(np.dot(chunk, chunk))
    return total


def add_blocks(blocks, out, xp=np) -> None:
    """``out`` (fp32) = the rows of ``blocks`` summed in fp32, in row order."""
    out[...] = blocks[0]
    for block in blocks[1:]:
        xp.add(out, block, out=out, dtype=np.float32)


class NumpyReductions:
    """The NumPy twin."""

    def __init__(self, largest: int = NUMPY_CHUNK):
        self._scratch = np.empty(max(1, min(largest, NUMPY_CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes

    def sum_of_squares(self, x) -> float:
        return sum_of_squares(x, self._scratch)

    sum_blocks = staticmethod(add_blocks)


@jit
def _sum_blocks(blocks, kind, table, scratch, out):
    """``out`` = the rows of ``blocks`` (16-bit patterns) widened and summed in fp32, in row
    order (as the NumPy twin: row 0, plus row 1, plus row 2, ...)."""
    rows, count = blocks.shape
    for start in range(0, count, scratch.size):
        stop = min(count, start + scratch.size)
        widen(blocks[0, start:stop], kind, table, out[start:stop])
        for r in range(1, rows):
            widened = scratch[: stop - start]
            widen(blocks[r, start:stop], kind, table, widened)
            _accumulate(out[start:stop], widened)


@jit(inline="never")
def _accumulate(total, values):
    for i in range(total.size):
        total[i] = total[i] + values[i]


class NumbaReductions:
    """The compiled twin: the same interface and bits as ``NumpyReductions``."""

    def __init__(self, largest: int = NUMPY_CHUNK):
        compile_marked(globals())
        self._scratch = np.empty(max(1, min(largest, CHUNK)), np.float32)
        # The sum of squares goes through BLAS (a compiled loop cannot reorder float sums).
        self._sum_scratch = np.empty(max(1, min(largest, NUMPY_CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes + self._sum_scratch.nbytes

    def sum_of_squares(self, x) -> float:
        return sum_of_squares(x, self._sum_scratch)

    def sum_blocks(self, blocks, out) -> None:
        """``out`` (fp32) = the rows of ``blocks`` summed in row order (compiled for bf16 and
        fp16 rows, which it reads as 16-bit patterns; fp32 rows go through NumPy)."""
        if blocks.dtype.itemsize != 2:
            add_blocks(blocks, out)
            return
        _sum_blocks(blocks.view(np.uint16), encoding(blocks), FP16_TABLE, self._scratch, out)


class CupyReductions:
    """The CuPy twin: a ``ReductionKernel`` for the sum of squares, CuPy adds for the blocks."""

    scratch_bytes = 0
    _kernel: backend.ExplainedKernel | None = None

    def sum_of_squares(self, x):
        if CupyReductions._kernel is None:
            kernel = backend.xp_for("cupy").ReductionKernel(
                "T x",
                "float64 total",
                "(double)(float)x * (double)(float)x",
                "a + b",
                "total = a",
                "0",
                "zero1_sum_of_squares",
            )
            CupyReductions._kernel = backend.ExplainedKernel(kernel)
        return CupyReductions._kernel(x)

    @staticmethod
    def sum_blocks(blocks, out) -> None:
        add_blocks(blocks, out, backend.xp_for("cupy"))
