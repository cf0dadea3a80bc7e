"""How the masters and the rule's state are stored, for the Numba twins' one pass per range
(``numba_generated``): a master form (fp32 masters, or bf16 parameters' int16 remainders with the
ties beside them) and one state form per state array (fp32, bf16 bit patterns rounded
stochastically, or 8-bit blocks). A form is a tuple; its first item, its kind, picks the
generated kernel. The chunk codecs below are the passes of the paths that decode or encode a
whole range at once (``state.masters``, ``state.encodings``: reads, writes, checkpoints);
``numba_scalars`` holds their one-element twins (the same bits).
"""

from __future__ import annotations

import numpy as np

from .numba_shared import CHUNK, jit

__all__ = [
    "FP32_FORM",
    "REMAINDER_FORM",
    "BF16_FORM",
    "NONE_FORM",
    "INT8_FORM",
    "TIE",
    "master_form",
    "state_form",
    "NO_STATE",
    "flags",
    "decode_remainders",
    "encode_remainders",
    "tie_positions",
    "round_stochastic",
]

FP32_FORM, REMAINDER_FORM, BF16_FORM, NONE_FORM, INT8_FORM = 0, 1, 2, 3, 4
#: The remainder of a tie (half a bf16 step above an even parameter): stored as ``-TIE``.
TIE = 0x8000
#: The stochastic rounding's odd multiplier of the flat index (``state.encodings``).
INDEX, M32 = 0x9E3779B1, 0xFFFFFFFF
_F32, _I16, _I64 = (np.empty(0, t) for t in (np.float32, np.int16, np.int64))
#: The flags of fp32 masters, which have no ties: never written.
_NO_FLAGS = np.zeros(CHUNK, np.bool_)


def master_form(fp32=None, remainder=None, ties=None, flagged=None) -> tuple:
    """The masters of one range: ``fp32`` (updated in place: fp32 masters, or fp32 parameters'
    own range), or bf16 parameters' ``remainder`` (int16) with the ``ties`` in the range
    (sorted positions from its start) and ``flagged``, a chunk of flags for the new ties
    (``flags()``)."""
    if remainder is None:
        return (FP32_FORM, fp32, _I16, _I64, _NO_FLAGS)
    return (REMAINDER_FORM, _F32, remainder, ties, flagged)


def state_form(fp32=None, bits=None, seed: int = 0, codes=None, scales=None) -> tuple:
    """One state array over one range, as ``(kind, array, seed, scales)``: ``fp32`` (updated in
    place), bf16 ``bits`` (uint16) rounded with the stream starting at ``seed`` (the range's
    first element), or 8-bit ``codes`` (uint8) with the fp32 ``scales`` of their blocks
    (``state.int8_blocks``; the range starts a block)."""
    if codes is not None:
        return (INT8_FORM, codes, np.uint32(0), scales)
    if bits is None:
        return (FP32_FORM, fp32, np.uint32(0), _F32)
    return (BF16_FORM, bits, np.uint32(seed), _F32)


#: A state array the rule does not keep (SGD without momentum).
NO_STATE = (NONE_FORM, _F32, np.uint32(0), _F32)


def flags(n: int = CHUNK) -> np.ndarray:
    """The new ties' flags of one chunk of a range (``CHUNK``: stays in L1)."""
    return np.zeros(n, np.bool_)


# -- the codecs (passes of their own, so that LLVM vectorizes each) ------------------------------


@jit(inline="never")
def decode_remainders(param, rem, out):
    """``out`` (int32 view of fp32) = the masters of bf16 ``param`` bits and int16 ``rem``."""
    for i in range(out.size):
        out[i] = np.int32((np.uint32(param[i]) << np.uint32(16)) + np.uint32(np.int32(rem[i])))


@jit(inline="never")
def encode_remainders(master, param, rem):
    """``rem`` = the int16 remainders of ``master`` (int32 view) against ``param`` (bf16
    bits); returns how many are ties (stored as ``-TIE``)."""
    count = 0
    for i in range(master.size):
        r = np.int32(np.uint32(master[i]) - (np.uint32(param[i]) << np.uint32(16)))
        count += r == TIE
        rem[i] = np.int16(r)
    return count


@jit
def tie_positions(master, param, count):
    """The ``count`` positions whose remainder is a tie (``encode_remainders``' count)."""
    ties = np.empty(count, np.int64)
    k = 0
    if count:
        for i in range(master.size):
            if np.int32(np.uint32(master[i]) - (np.uint32(param[i]) << np.uint32(16))) == TIE:
                ties[k] = i
                k += 1
    return ties


@jit(inline="never")
def round_stochastic(values, seed, out):
    """``out`` (bf16 bits) = ``values`` (fp32 bits) rounded with the hashed bits of ``seed +
    i * INDEX`` for element ``i``; inf stays inf, nan a quiet nan."""
    for i in range(values.size):  # (each step cast back: Numba widens integer arithmetic)
        x = np.uint32((np.uint64(seed) + np.uint64(i) * np.uint64(INDEX)) & np.uint64(M32))
        x = np.uint32(x ^ (x >> np.uint32(16)))
        x = np.uint32((np.uint64(x) * np.uint64(0x7FEB352D)) & np.uint64(M32))
        x = np.uint32(x ^ (x >> np.uint32(15)))
        x = np.uint32((np.uint64(x) * np.uint64(0x846CA68B)) & np.uint64(M32))
        x = np.uint32(x ^ (x >> np.uint32(16)))
        # inf plus at most 0xFFFF stays inf and a nan is quieted: a select, so LLVM vectorizes
        u = values[i]
        rounded = np.uint32(u + (x & np.uint32(0xFFFF))) >> np.uint32(16)
        quiet = (u >> np.uint32(16)) | np.uint32(0x40)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[i] = np.uint16(quiet if nan else rounded)
