"""One element's codecs for the generated Numba kernels (``numba_generated``): fp32 <-> its bits
(``bits_of``, ``float_of``: LLVM bitcasts, so the loops that use them vectorize), bf16 widened and
rounded to nearest even, fp16 rounded, bf16 rounded stochastically with the hashed bits of the
element's place in the stream, and bf16 parameters' int16 remainders. Each is the scalar of a
chunk codec in ``numba_shared``/``numba_forms`` (the same bits). Numba is optional: this module
imports without it, and ``compile_marked`` compiles its ``@jit`` functions where it is found.
"""

from __future__ import annotations

import numpy as np

from .numba_forms import INDEX, M32, TIE
from .numba_shared import jit

__all__ = [
    "bits_of",
    "float_of",
    "widen_bf16",
    "rne_bf16",
    "round_f16",
    "round_stochastic",
    "decode_remainder",
    "remainder_of",
    "stream_at",
    "TIE",
]

try:  # (the bitcasts are Numba intrinsics: only where Numba is found)
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised where Numba is missing
    intrinsic = None

if intrinsic is not None:

    @intrinsic
    def bits_of(typingctx, x):
        """The bits of a float32 as a uint32."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def float_of(typingctx, u):
        """The float32 whose bits are the uint32 ``u``."""
        if u != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen
else:  # pragma: no cover
    bits_of = float_of = None


@jit
def widen_bf16(b16):
    """The float32 of bf16 bits (exact)."""
    return float_of(np.uint32(np.uint32(b16) << np.uint32(16)))


@jit
def rne_bf16(x):
    """``x`` rounded to bf16 (nearest even; NaN stays a quiet NaN), as bits."""
    u = bits_of(x)  # (each step cast back to 32 bits: Numba widens, and 64-bit lanes halve
    top = np.uint32(u >> np.uint32(16))  # what a vector register holds)
    rounded = np.uint32(np.uint32(u + np.uint32(0x7FFF) + (top & np.uint32(1))) >> np.uint32(16))
    quiet_nan = np.uint32(top | np.uint32(0x40))
    is_nan = np.uint32(u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(quiet_nan if is_nan else rounded)


@jit
def round_f16(x):
    """``x`` rounded to IEEE half (nearest even, subnormals, inf), as bits."""
    u = bits_of(x)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN: keep it a quiet NaN
        h = np.uint32(0x7E00)
    elif a >= np.uint32(0x477FF000):  # >= 65520: rounds to inf
        h = np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below 2^-14: subnormal or 0
        h = np.uint32(np.rint(abs(x) * np.float32(16777216.0)))  # x 2^24, exact
    else:  # normal: rebias, round 23->10
        r = a - np.uint32(112 << 23)
        h = r >> np.uint32(13)
        rest = r & np.uint32(0x1FFF)
        if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):
            h += np.uint32(1)
    return np.uint16(sign | h)


@jit
def stream_at(seed, i):
    """The stream's state for element ``i`` of a range whose first element's is ``seed``."""
    return np.uint32((np.uint64(seed) + np.uint64(i) * np.uint64(INDEX)) & np.uint64(M32))


@jit
def round_stochastic(x, at):
    """``x`` rounded to bf16 with the hashed bits of ``at`` (``stream_at``); inf stays inf,
    NaN a quiet NaN (``numba_forms.round_stochastic``, one element)."""
    h = np.uint32(at ^ (at >> np.uint32(16)))
    h = np.uint32((np.uint64(h) * np.uint64(0x7FEB352D)) & np.uint64(M32))
    h = np.uint32(h ^ (h >> np.uint32(15)))
    h = np.uint32((np.uint64(h) * np.uint64(0x846CA68B)) & np.uint64(M32))
    h = np.uint32(h ^ (h >> np.uint32(16)))
    u = bits_of(x)
    rounded = np.uint32(u + (h & np.uint32(0xFFFF))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(0x40)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(quiet if nan else rounded)


@jit
def decode_remainder(param, rem, tie):
    """The fp32 master of bf16 ``param`` bits and its int16 remainder ``rem``; ``tie``: 1
    where the remainder is a tie kept above the parameter (stored as ``-TIE``), else 0."""
    high = np.uint32(np.uint32(param) << np.uint32(16))
    bits = np.uint32(
        high + np.uint32(np.int32(rem)) + np.uint32(np.uint32(tie) * np.uint32(2 * TIE))
    )
    return float_of(bits)


@jit
def remainder_of(x, param):
    """The remainder of the fp32 master ``x`` against its bf16 rounding ``param`` (int32: a tie
    is ``TIE``, which int16 keeps as ``-TIE``)."""
    return np.int32(np.uint32(bits_of(x) - np.uint32(np.uint32(param) << np.uint32(16))))
