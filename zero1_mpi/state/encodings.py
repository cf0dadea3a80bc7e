"""How the rule's state arrays of a shard are kept: ``Fp32State`` (the kernels' own fp32) or
``Bf16State`` (bf16 bit patterns, rounded stochastically); 8 bits: ``int8_blocks.py``.

Each gives the kernel fp32 values: ``load(st, at)`` (a view, or decoded into scratch at ``at``),
``store(st, values, flat, step)`` after the kernel wrote them, ``read(st)`` and ``write(st,
values)`` (to nearest) for checkpoints; ``held``/``nbytes``: what it keeps. Stochastic rounding
adds 16 random bits below the kept half: a value rounds up with the probability of its distance
from the one below; the bits hash (the parameter's flat index, ``step``, the array's place in
the rule's state), the same for every twin, world size and replica. ``state_for`` builds any of
the three. Twins: NumPy, Numba, CuPy (the same bits).
"""

from __future__ import annotations

import numpy as np

from ..kernels import backend, numba_forms
from ..kernels.numba_forms import round_stochastic
from ..kernels.numba_shared import compile_marked
from .int8_blocks import Int8State

__all__ = [
    "Fp32State",
    "Bf16State",
    "state_for",
    "STATE_DTYPES",
    "FUSED_STATE_DTYPES",
    "sr_bits",
    "check_state_dtype",
]

FP32 = np.dtype(np.float32)
STATE_DTYPES = ("float32", "bfloat16", "int8")
#: Odd multipliers that spread (flat index, step, array) over 32 bits before the hash.
_INDEX, _STEP, _ARRAY = numba_forms.INDEX, 0x85EBCA77, 0xC2B2AE3D
_M = numba_forms.M32


class Fp32State:
    """An fp32 array (``held``), updated in place by the kernel."""

    dtype = "float32"
    scratch_bytes = 0
    chunk = 1 << 62

    def __init__(self, array):
        self.held = array

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    def real_bytes(self, owned: int) -> int:
        return owned * FP32.itemsize

    def load(self, st: slice, at: int):
        return self.held[st]

    def store(self, st: slice, values, flat: int, step: int) -> None:
        """Nothing: the kernel wrote ``load``'s view."""

    def form(self, st: slice, flat: int, step: int) -> tuple:
        """The array over ``st`` for a Numba or CuPy twin's one pass (``numba_forms``)."""
        return numba_forms.state_form(fp32=self.held[st])

    def read(self, st: slice):
        return self.held[st]

    def write(self, st: slice, values) -> None:
        self.held[st] = backend.like(self.held, values)


class Bf16State:
    """A state array as bf16 bit patterns (``held``: uint16), rounded stochastically.

    Args:
        n: elements of the shard; ``largest``: the most one kernel call (or calls used
            together) takes: the decoded values' scratch; ``xp``; ``kind``: the twin
            (``"numpy"``, ``"numba"``, ``"cupy"``); ``array``: the array's place in the rule's
            ``state_names`` (its stream of random bits); ``fused``: a Numba or CuPy twin takes
            the bits as they are (``form``) and widens and rounds each element in its one pass.
    """

    dtype = "bfloat16"
    CHUNK = 1 << 18

    def __init__(self, n: int, largest: int, xp, kind: str, array: int, fused: bool = False):
        self._xp, self._kind, self._array, self._largest = xp, kind, array, largest
        self.held = xp.zeros(n, np.uint16)
        self._decoded = xp.empty(0 if fused else largest, FP32)  # (fused: none)
        self.chunk = 1 << 62 if fused else largest
        if kind == "numpy":
            self._bits = np.empty(min(largest, self.CHUNK), np.uint32)
            self._ramp = np.arange(self._bits.size, dtype=np.uint32) * np.uint32(_INDEX)
        elif kind == "numba":
            compile_marked(globals())

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    @property
    def scratch_bytes(self) -> int:
        extra = self._bits.nbytes + self._ramp.nbytes if self._kind == "numpy" else 0
        return self._decoded.nbytes + extra

    def real_bytes(self, owned: int) -> int:
        return owned * 2

    def load(self, st: slice, at: int):
        if self._decoded.size == 0:  # (made with ``fused``)
            self._decoded = self._xp.empty(self._largest, FP32)
        out = self._decoded[at : at + st.stop - st.start]
        self._widen(self.held[st], out)
        return out

    def store(self, st: slice, values, flat: int, step: int) -> None:
        """Round ``values`` (fp32, the kernel's over ``st``, whose first element is the
        parameter at flat index ``flat``) stochastically into the array, with ``step``'s bits."""
        seed = self._seed(flat, step)
        out = self.held[st]
        if self._kind == "numpy":
            for start in range(0, values.size, self._bits.size):
                stop = min(values.size, start + self._bits.size)
                base = (seed + start * _INDEX) & _M
                bits = self._bits[: stop - start]
                np.add(self._ramp[: stop - start], np.uint32(base), out=bits)
                _numpy_round(values[start:stop], bits, out[start:stop])
        elif self._kind == "numba":
            round_stochastic(values.view(np.uint32), np.uint32(seed), out)
        else:
            _cuda_kernel("round")(values.view(np.uint32), np.uint32(seed), out)

    def form(self, st: slice, flat: int, step: int) -> tuple:
        """The bits over ``st`` (first element: flat index ``flat``) for a Numba or CuPy twin's one
        pass at ``step`` (``numba_forms``), which widens and rounds each element."""
        return numba_forms.state_form(bits=self.held[st], seed=self._seed(flat, step))

    def _seed(self, flat: int, step: int) -> int:
        """The stream's seed at flat index ``flat`` in ``step`` (element ``i`` after it:
        ``seed + i * _INDEX``)."""
        return (flat * _INDEX + step * _STEP + self._array * _ARRAY) & _M

    def read(self, st: slice):
        out = self._xp.empty(st.stop - st.start, FP32)
        self._widen(self.held[st], out)
        return out

    def write(self, st: slice, values) -> None:
        """Round ``values`` to nearest (a load: no step to draw bits for)."""
        values = backend.like(self.held, values).astype(FP32, copy=False)
        self.held[st] = values.astype(backend.BFLOAT16).view(np.uint16)

    def _widen(self, bits16, out) -> None:
        if self._kind == "cupy":
            _cuda_kernel("widen")(bits16, out.view(np.uint32))
        else:
            np.left_shift(bits16, 16, out=out.view(np.uint32), dtype=np.uint32)


def state_for(
    dtype: str,
    n: int,
    largest: int,
    xp,
    compute: str,
    array: int,
    whole: bool,
    segments=(),
    fused: bool = False,
):
    """The state array kept as ``dtype`` (``STATE_DTYPES``) for a shard of ``n`` elements;
    ``array``: its place in the rule's state; ``whole``: a kernel call may need a whole
    bucket's shard decoded at once (a two-phase rule), else a cache-sized chunk on the host;
    ``segments``: the 8-bit state's (``Int8State``); ``fused``: the kernel takes its ``form``
    (a Numba or CuPy twin's one pass)."""
    if dtype == "float32":
        return Fp32State(xp.zeros(n, FP32))
    kept = Bf16State if dtype == "bfloat16" else Int8State
    chunk = largest if whole or compute == "cupy" else min(largest, kept.CHUNK)
    if dtype == "bfloat16":
        return Bf16State(n, chunk, xp, compute, array, fused)
    return Int8State(n, segments, chunk, xp, compute, fused)


#: The state encodings a Numba or CuPy twin's one pass reads and writes as they are (``form``).
FUSED_STATE_DTYPES = ("float32", "bfloat16", "int8")


def sr_bits(x):
    """The 32 hashed bits of each uint32 of ``x`` (NumPy, in place; "lowbias32")."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _numpy_round(values, bits, out) -> None:
    """``out`` (uint16) = ``values`` rounded stochastically with the hash of ``bits`` (the
    seeds, overwritten); inf stays inf, nan a quiet nan."""
    sr_bits(bits)
    bits &= np.uint32(0xFFFF)
    u = values.view(np.uint32)
    bits += u
    bits >>= np.uint32(16)
    special = (u & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000)
    if special.any():
        top = u[special] >> np.uint32(16)
        nan = (u[special] & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        bits[special] = np.where(nan, top | np.uint32(0x40), top)
    np.copyto(out, bits, casting="unsafe")


# -- the CuPy twin -------------------------------------------------------------------------------

_CUDA: dict[str, tuple[str, str, str]] = {
    "widen": ("uint16 bits", "uint32 out", "out = (unsigned int)bits << 16;"),
    "round": (
        "uint32 u, uint32 seed",
        "uint16 out",
        "unsigned int x = seed + (unsigned int)i * 0x9E3779B1u;"
        " x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;"
        " unsigned int a = u & 0x7FFFFFFFu, top = u >> 16;"
        " out = (unsigned short)(a > 0x7F800000u ? (top | 0x40u)"
        " : a == 0x7F800000u ? top : (u + (x & 0xFFFFu)) >> 16);",
    ),
}


def _cuda_kernel(name: str):
    return backend.elementwise_kernel(f"zero1_state_bf16_{name}", *_CUDA[name])


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_state_dtype(value, checked):
    if value not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype={value!r} is not understood: use 'float32', 'bfloat16' (the rule's "
            "state in 2 bytes, rounded stochastically) or 'int8' (8-bit blocks)"
        )
    return value
