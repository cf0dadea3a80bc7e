"""Compiled CPU kernels (Numba): what the Numba twins of the rules and reductions share.

A Numba twin is bitwise its NumPy twin: the same float32 operations in the same order (no fused
multiply-add, no fast-math). Numba has no CPU float16 type, so 16-bit values travel as
``uint16`` bit patterns (``widen``, ``narrow_bf16``, ``narrow_f16``, ``fp32_chunk``,
``round_params``). Numba is optional (``pip install zero1-mpi[fast]``) and imported only when a
twin is first built: loops are marked ``@jit`` and ``compile_marked(globals())`` turns them into
Numba dispatchers, so every module of kernels imports where Numba is missing. Numba's disk cache
keys on each loop's own file: after editing a helper here, clear ``__pycache__/*.nb[ic]``.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np

__all__ = [
    "jit",
    "compile_marked",
    "NumbaKernel",
    "encoding",
    "split_grad",
    "param_bits",
    "fp32_chunk",
    "round_params",
    "widen",
    "narrow_bf16",
    "narrow_f16",
    "CHUNK",
    "FP16_TABLE",
    "FP32",
    "BF16",
    "FP16",
]

FP32, BF16, FP16 = 0, 1, 2  # how a gradient or parameter array is encoded
FP16_TABLE = (
    np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)
NO_F32 = np.empty(0, np.float32)
NO_U16 = np.empty(0, np.uint16)
CHUNK = 4096  # elements of scratch per pass: 16 KiB, stays in L1

_OPTIONS = {"cache": True, "error_model": "numpy", "nogil": True}
_dispatchers: dict = {}  # function -> its Numba dispatcher, one per function in the process


def jit(fn=None, **options):
    """Mark a module-level function for Numba (``numba.njit`` with this package's options and
    ``options``); ``compile_marked`` compiles it. Use ``@jit`` or ``@jit(inline="never")``."""

    def mark(function):
        function.numba_options = {**_OPTIONS, **options}
        return function

    return mark if fn is None else mark(fn)


def compile_marked(namespace: dict) -> None:
    """Replace each ``@jit`` function in ``namespace`` (a module's ``globals()``), in this
    module and in the modules those functions come from, by its Numba dispatcher, so that
    marked functions calling each other by name call compiled code. Compiles lazily (Numba
    compiles on first call, or loads its disk cache).

    Raises:
        ImportError: Numba is missing, naming the extra that brings it.
    """
    try:
        import numba
    except ImportError as exc:
        raise ImportError(
            "the Numba kernels need Numba: pip install 'zero1-mpi[fast]' (or set "
            "ZERO1_MPI_KERNEL=numpy)"
        ) from exc
    pending, seen = [globals(), namespace], set()
    while pending:
        space = pending.pop()
        if id(space) in seen:
            continue
        seen.add(id(space))
        for name, value in list(space.items()):
            if inspect.isfunction(value) and hasattr(value, "numba_options"):
                if value not in _dispatchers:
                    _dispatchers[value] = numba.njit(**value.numba_options)(value)
                    pending.append(value.__globals__)  # (imported: its module's calls too)
                space[name] = _dispatchers[value]


class NumbaKernel:
    """Base of a chunked Numba twin: compiles the ``@jit`` loops of its subclass's module and
    holds one fp32 scratch chunk (for widened 16-bit gradients), allocated once."""

    def __init__(self, largest: int = CHUNK):
        compile_marked(vars(sys.modules[type(self).__module__]))
        self._scratch = np.empty(max(1, min(largest, CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes


def encoding(array) -> int:
    """``FP32``, ``BF16`` or ``FP16``: how ``array``'s values are encoded."""
    char = array.dtype.char  # (a cached one-letter string: no allocation per call)
    return FP32 if char == "f" else BF16 if char == "E" else FP16


def split_grad(array):
    """``(fp32 array, 16-bit patterns, encoding)`` of a gradient, the unused one empty."""
    kind = encoding(array)
    if kind == FP32:
        return array, NO_U16, kind
    return NO_F32, array.view(np.uint16), kind


def param_bits(param):
    """``(16-bit patterns, encoding)`` of the 16-bit parameters, or empty and ``FP32`` for None
    (fp32 parameters: the master is the parameter)."""
    if param is None:
        return NO_U16, FP32
    return param.view(np.uint16), encoding(param)


# Each pass is its own (not inlined) function over whole slices: that is what lets LLVM
# vectorize it. (The update's one pass, ``numba_generated``, is one loop that vectorizes for the
# same reason: views indexed from 0, no count or branch inside.)


@jit(inline="never")
def widen(bits16, kind, table, out):
    """``out`` = the 16-bit values ``bits16`` (bf16 or fp16 patterns) as fp32, exactly."""
    if kind == BF16:
        out32 = out.view(np.uint32)
        for i in range(bits16.size):
            out32[i] = np.uint32(bits16[i]) << np.uint32(16)
    else:
        for i in range(bits16.size):
            out[i] = table[bits16[i]]


@jit(inline="never")
def narrow_bf16(values, out):
    """``out`` = ``values`` rounded to bf16 (nearest even; NaN stays NaN), as bit patterns."""
    bits = values.view(np.uint32)
    for i in range(values.size):
        u = bits[i]
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        quiet_nan = (u >> np.uint32(16)) | np.uint32(0x40)
        is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[i] = np.uint16(quiet_nan if is_nan else rounded)


@jit(inline="never")
def narrow_f16(values, out):
    """``out`` = ``values`` rounded to IEEE half (nearest even, subnormals, inf), as bits."""
    bits = values.view(np.uint32)
    for i in range(values.size):
        u = bits[i]
        sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
        a = u & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN: keep it a quiet NaN
            h = np.uint32(0x7E00)
        elif a >= np.uint32(0x477FF000):  # >= 65520: rounds to inf
            h = np.uint32(0x7C00)
        elif a < np.uint32(0x38800000):  # below 2^-14: subnormal or 0
            h = np.uint32(np.rint(abs(values[i]) * np.float32(16777216.0)))  # x 2^24, exact
        else:  # normal: rebias, round 23->10
            r = a - np.uint32(112 << 23)
            h = r >> np.uint32(13)
            rest = r & np.uint32(0x1FFF)
            if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):
                h += np.uint32(1)
        out[i] = np.uint16(sign | h)


@jit
def fp32_chunk(grad32, grad16, grad_kind, table, scratch, start, stop):
    """The gradient over ``[start, stop)`` in fp32: a slice, or the 16-bit chunk widened into
    the scratch."""
    if grad_kind == FP32:
        return grad32[start:stop]
    grad = scratch[: stop - start]
    widen(grad16[start:stop], grad_kind, table, grad)
    return grad


@jit
def round_params(master, param16, param_kind):
    """The 16-bit parameters (bit patterns) = the fp32 masters rounded; nothing for fp32."""
    if param_kind == BF16:
        narrow_bf16(master, param16)
    elif param_kind == FP16:
        narrow_f16(master, param16)
