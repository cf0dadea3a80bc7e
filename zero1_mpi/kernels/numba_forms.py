"""How the masters and the rule's state are stored, a chunk at a time, for the Numba twins' one
pass per range: ``load_master``/``store_master`` (fp32 masters, or bf16 parameters' int16
remainders and the ties beside them) and ``load_state``/``store_state`` (fp32, or bf16 bit
patterns rounded stochastically). A form is a tuple (``master_form``, ``state_form``); a chunk's
decoded values live in the form's own cache-sized scratch from its load to its store, so the
update moves the stored bytes only. The codecs are ``state.masters``' and ``state.encodings``'
own Numba twins (the same bits as their NumPy and CuPy twins).
"""

from __future__ import annotations

import numpy as np

from .numba_shared import CHUNK, jit

__all__ = [
    "FP32_FORM",
    "REMAINDER_FORM",
    "BF16_FORM",
    "TIE",
    "master_form",
    "state_form",
    "load_master",
    "store_master",
    "load_state",
    "store_state",
    "decode_remainders",
    "encode_remainders",
    "tie_positions",
    "round_stochastic",
]

FP32_FORM, REMAINDER_FORM, BF16_FORM = 0, 1, 2
#: The remainder of a tie (half a bf16 step above an even parameter): stored as ``-TIE``.
TIE = 0x8000
#: The stochastic rounding's odd multiplier of the flat index (``state.encodings``).
INDEX, M32 = 0x9E3779B1, 0xFFFFFFFF
_F32, _I16, _U16, _I64 = (np.empty(0, t) for t in (np.float32, np.int16, np.uint16, np.int64))


def master_form(fp32=None, remainder=None, ties=None, scratch=None) -> tuple:
    """The masters of one range: ``fp32`` (updated in place: fp32 masters, or fp32 parameters'
    own range), or bf16 parameters' ``remainder`` (int16) with the ``ties`` in the range
    (sorted positions from its start) and a ``scratch`` of ``CHUNK`` fp32 values."""
    if remainder is None:
        return (FP32_FORM, fp32, _I16, _I64, _F32)
    return (REMAINDER_FORM, _F32, remainder, ties, scratch)


def state_form(fp32=None, bits=None, seed: int = 0, scratch=None) -> tuple:
    """One state array over one range: ``fp32`` (updated in place), or bf16 ``bits`` (uint16)
    rounded with the stream starting at ``seed`` (the range's first element), through a
    ``scratch`` of ``CHUNK`` fp32 values."""
    if bits is None:
        return (FP32_FORM, fp32, _U16, np.uint32(0), _F32)
    return (BF16_FORM, _F32, bits, np.uint32(seed), scratch)


def scratch() -> np.ndarray:
    """A form's scratch: one chunk of fp32 values (``CHUNK``: stays in L1)."""
    return np.empty(CHUNK, np.float32)


@jit
def load_master(form, param16, start, stop):
    """The fp32 masters over ``[start, stop)`` of the range (a view, or decoded into the
    scratch against ``param16``, the parameters before the update)."""
    kind, fp32, rem, ties, scratch = form
    if kind == FP32_FORM:
        return fp32[start:stop]
    out = scratch[: stop - start]
    bits = out.view(np.int32)
    decode_remainders(param16[start:stop], rem[start:stop], bits)
    for j in range(np.searchsorted(ties, start), np.searchsorted(ties, stop)):
        bits[ties[j] - start] += 2 * TIE  # a tie decodes half a step below: move it above
    return out


@jit
def store_master(form, values, param16, start, stop, found, count):
    """Keep ``values`` (the updated masters over ``[start, stop)``) against ``param16``, their
    rounding; the ties go to ``found[:count]`` (grown as needed): returns both."""
    kind, rem = form[0], form[2]
    if kind == FP32_FORM:
        return found, count
    bits, param = values.view(np.int32), param16[start:stop]
    new = encode_remainders(bits, param, rem[start:stop])
    if new:
        if count + new > found.size:
            grown = np.empty(max(2 * found.size, count + new, 16), np.int64)
            grown[:count] = found[:count]
            found = grown
        found[count : count + new] = tie_positions(bits, param, new) + start
        count += new
    return found, count


@jit
def load_state(form, start, stop):
    """The fp32 state over ``[start, stop)`` of the range (a view, or widened into the
    scratch)."""
    kind, fp32, bits, scratch = form[0], form[1], form[2], form[4]
    if kind == FP32_FORM:
        return fp32[start:stop]
    out = scratch[: stop - start]
    widen_bf16(bits[start:stop], out.view(np.uint32))
    return out


@jit
def store_state(form, values, start, stop) -> None:
    """Keep ``values`` (the updated state over ``[start, stop)``): bf16 rounds them with the
    bits of each element's place in the stream."""
    kind, bits, seed = form[0], form[2], form[3]
    if kind == BF16_FORM:
        at = np.uint32((np.uint64(seed) + np.uint64(start) * np.uint64(INDEX)) & np.uint64(M32))
        round_stochastic(values.view(np.uint32), at, bits[start:stop])


# -- the codecs (passes of their own, so that LLVM vectorizes each) ------------------------------


@jit(inline="never")
def widen_bf16(bits16, out32):
    for i in range(bits16.size):
        out32[i] = np.uint32(bits16[i]) << np.uint32(16)


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
