"""Where a rank keeps the fp32 master weights of its shard: ``Fp32Masters`` (an fp32 array) or
``RemainderMasters`` (bf16 parameters: the 16 bits the parameter lacks, 2 bytes instead of 4).

A remainder is ``bits(master) - bits(param) << 16`` as a signed 16-bit integer, ``param`` being
the master rounded to the nearest bf16, ties to even (what the kernels write), so the master is
its parameter and remainder, bit for bit. That holds for all but one master per parameter: an
even parameter is the rounding of 65,537 fp32 values, and the one 16 bits cannot tell apart,
half a bf16 step above it, is a *tie*, whose position ``ties`` keeps (about one element in 2^17
per step; 8 bytes each). Both keep ``load(st, at, param)`` (the fp32 masters over ``st`` for the
kernel, decoded into scratch at ``at``), ``store(st, values, param)`` after it, ``read`` and
``write`` for checkpoints; ``masters_for`` builds one. Twins: NumPy, Numba, CuPy (same bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import backend, numba_forms
from ..kernels.cuda_generated import TieFlags
from ..kernels.numba_forms import TIE, decode_remainders, encode_remainders, tie_positions
from ..kernels.numba_shared import compile_marked
from .host import keeps_host_share

__all__ = ["Fp32Masters", "RemainderMasters", "masters_for", "TIE", "MASTERS", "check_masters"]

FP32 = np.dtype(np.float32)
_NO_TIES = np.zeros(0, np.int64)
#: Elements per NumPy pass: the int32 scratch stays in cache.
NUMPY_CHUNK = 1 << 16


class Fp32Masters:
    """The masters as the fp32 ``array`` given, updated in place."""

    kind = "fp32"
    scratch_bytes = 0
    chunk = 1 << 62  # the kernel updates the array in place: one call per range

    def __init__(self, array):
        self.array = self.held = array

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def real_bytes(self, owned: int) -> int:
        """The bytes of ``owned`` real elements (the rest of ``nbytes`` is padding)."""
        return owned * FP32.itemsize

    def load(self, st: slice, at: int, param):
        return self.array[st]

    def store(self, st: slice, values, param) -> None:
        """Nothing: the kernel updated ``load``'s view in place."""

    def form(self, st: slice) -> tuple:
        """The masters over ``st`` for a Numba or CuPy twin's one pass (``numba_forms``)."""
        return numba_forms.master_form(fp32=self.array[st])

    def record_ties(self, st: slice, ties) -> None:
        """Nothing: fp32 masters have no ties."""

    def read(self, st: slice, param):
        """A writable view (``write`` needs no call after writing into it)."""
        return self.array[st]

    def write(self, st: slice, values, param, rounded=None) -> None:
        """Set the masters over ``st`` to ``values`` and ``param`` (None: none apart, fp32
        parameters) to ``rounded`` (16-bit values as a checkpoint saved them), or to the
        masters rounded."""
        self.array[st] = backend.like(self.array, values)
        if param is not None:
            source = values if rounded is None else rounded
            param[...] = backend.like(param, source).astype(param.dtype)


class RemainderMasters:
    """The masters as int16 remainders against bf16 parameters, and the positions of the ties.

    Args:
        n: elements of the shard; ``largest``: ``chunk``, the most elements one kernel call
            (or calls used together) takes: the decoded masters' scratch; ``xp``; ``kind``:
            ``"numpy"``, ``"numba"`` or ``"cupy"``; ``fused``: a Numba or CuPy twin takes
            the remainders as they are (``form``) and decodes each element in its one pass.
    """

    kind = "remainder"
    #: Elements per kernel call on the host: the decoded masters stay in cache between the
    #: decoding, the kernel and the encoding.
    CHUNK = 1 << 18

    def __init__(self, n: int, largest: int, xp, kind: str, fused: bool = False):
        self._xp, self._kind, self._largest = xp, kind, largest
        self.remainder = self.held = xp.zeros(n, np.int16)
        #: Sorted positions (in the shard) of the masters half a bf16 step above an even param.
        self.ties = np.zeros(0, np.int64)
        # ``load``'s scratch, or with ``fused`` (a Numba or CuPy pass decodes each element in its
        # registers) none, and one kernel call per range. The new ties: on the device a bit
        # per element (``TieFlags``), for a Numba pass a chunk of flags.
        self._decoded = xp.empty(0 if fused else largest, FP32)
        self._flags: Any = np.empty(0, np.bool_)
        if kind == "cupy":
            self._flags = TieFlags(xp, largest)
        elif fused:
            self._flags = numba_forms.flags()
        self.chunk = 1 << 62 if fused else largest
        if kind == "cupy":
            self._tied = np.empty(0, np.int32)
        elif kind == "numpy":
            self._tied = np.empty(min(largest, NUMPY_CHUNK), np.int32)  # the int32 remainders
        else:
            compile_marked(globals())
            self._tied = np.empty(0, np.int32)

    @property
    def nbytes(self) -> int:
        return self.remainder.nbytes + self.ties.nbytes

    def real_bytes(self, owned: int) -> int:
        """The bytes of ``owned`` real elements and of the ties (the rest is padding)."""
        return owned * self.remainder.itemsize + self.ties.nbytes

    @property
    def scratch_bytes(self) -> int:
        return self._decoded.nbytes + self._tied.nbytes + self._flags.nbytes

    def load(self, st: slice, at: int, param):
        """The fp32 masters over ``st``, decoded into the scratch at ``at`` (disjoint ranges of
        one bucket's shard stay valid together) against ``param``, the parameters before the
        kernel."""
        if self._decoded.size == 0:  # (made with ``fused``)
            self._decoded = self._xp.empty(self._largest, FP32)
        out = self._decoded[at : at + st.stop - st.start]
        self._decode(st, param, out)
        return out

    def store(self, st: slice, values, param) -> None:
        """Keep ``values`` (fp32, the kernel's new masters over ``st``) against ``param``, their
        rounding the kernel wrote."""
        if self._kind == "numpy":
            ties = self._encode_numpy(values, param, self.remainder[st])
        elif self._kind == "numba":
            bits, param16 = values.view(np.int32), param.view(np.uint16)
            ties = tie_positions(
                bits, param16, encode_remainders(bits, param16, self.remainder[st])
            )
        else:
            ties = self._encode_cupy(values, param, self.remainder[st])
        self.record_ties(st, ties)

    def form(self, st: slice) -> tuple:
        """The remainders over ``st`` (and their ties) for a Numba or CuPy twin's one pass, which
        decodes and encodes each element (``numba_forms``); ``record_ties`` after."""
        if self._flags.nbytes == 0:  # (made without ``fused``)
            self._flags = numba_forms.flags()
        lo, hi = np.searchsorted(self.ties, (st.start, st.stop))
        ties = self.ties[lo:hi] - st.start if lo < hi else _NO_TIES
        return numba_forms.master_form(remainder=self.remainder[st], ties=ties, flagged=self._flags)

    def record_ties(self, st: slice, ties) -> None:
        """The ties over ``st`` are now ``ties`` (positions from ``st.start``)."""
        lo, hi = np.searchsorted(self.ties, (st.start, st.stop))
        if lo < hi or ties.size:
            self.ties = np.concatenate((self.ties[:lo], ties + st.start, self.ties[hi:]))

    def read(self, st: slice, param):
        """A copy of the fp32 masters over ``st`` (``write`` changes them)."""
        out = self._xp.empty(st.stop - st.start, FP32)
        self._decode(st, param, out)
        return out

    def write(self, st: slice, values, param, rounded=None) -> None:
        """Set the masters over ``st`` to ``values`` and ``param`` to their rounding (always:
        a remainder completes that, so ``rounded`` is not taken)."""
        values = backend.like(param, values).astype(FP32, copy=False)
        param[...] = values.astype(param.dtype)
        self.store(st, values, param)

    # -- the twins ---------------------------------------------------------------------------

    def _decode(self, st: slice, param, out) -> None:
        rem = self.remainder[st]
        if self._kind == "numpy":
            bits = out.view(np.int32)
            np.left_shift(param.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
            np.add(bits, rem, out=bits)
        elif self._kind == "numba":
            decode_remainders(param.view(np.uint16), rem, out.view(np.int32))
        else:
            _cuda_kernel("decode")(param.view(np.uint16), rem, out.view(np.int32))
        lo, hi = np.searchsorted(self.ties, (st.start, st.stop))
        if lo < hi:  # a tie decodes half a step below its parameter: move it above
            at = self.ties[lo:hi] - st.start
            out.view(np.int32)[backend.like(out, at)] += 2 * TIE

    def _encode_numpy(self, values, param, rem) -> np.ndarray:
        bits, ties = values.view(np.int32), []
        for start in range(0, values.size, self._tied.size):
            stop = min(values.size, start + self._tied.size)
            r = self._tied[: stop - start]
            np.left_shift(param[start:stop].view(np.uint16), 16, out=r.view(np.uint32),
                          dtype=np.uint32)  # fmt: skip
            np.subtract(bits[start:stop], r, out=r)
            ties.append(np.flatnonzero(r == TIE) + start)
            np.copyto(rem[start:stop], r, casting="unsafe")  # (TIE wraps to -TIE)
        return np.concatenate(ties) if ties else np.zeros(0, np.int64)

    def _encode_cupy(self, values, param, rem) -> np.ndarray:
        if 32 * self._flags.mask.size < values.size:  # (a write wider than a kernel call)
            self._flags = TieFlags(self._xp, values.size)
        flags = self._flags
        _cuda_kernel("encode")(values.view(np.int32), param.view(np.uint16), rem, flags.mask,
                               flags.count)  # fmt: skip
        return flags.taken()  # a few, usually none


def masters_for(
    kind: str, n: int, largest: int, xp, compute: str, whole: bool, fused: bool = False
) -> Fp32Masters | RemainderMasters:
    """The masters of ``kind`` (``"fp32"`` or ``"remainder"``) for a shard of ``n`` elements;
    ``compute``: the kernel family (``"numpy"``, ``"numba"``, ``"cupy"``); ``whole``: a kernel
    call may need a whole bucket's shard decoded at once (a two-phase rule's sums), else
    ``RemainderMasters.CHUNK`` elements on the host; ``fused``: the kernel takes their
    ``form`` (a Numba or CuPy twin's one pass)."""
    if kind == "remainder":
        chunk = largest if whole or compute == "cupy" else min(largest, RemainderMasters.CHUNK)
        return RemainderMasters(n, chunk, xp, compute, fused)
    return Fp32Masters(xp.zeros(n, FP32))


# -- the CuPy twin -------------------------------------------------------------------------------

_CUDA: dict[str, tuple[str, str, str]] = {
    "decode": (
        "uint16 param, int16 rem",
        "int32 master",
        "master = (int)(((unsigned int)param << 16) + (unsigned int)(int)rem);",
    ),
    "encode": (  # (a new tie: its bit set in the range's mask, ``TieFlags``)
        "int32 master, uint16 param",
        "int16 rem, raw uint32 tie_mask, raw int32 tie_count",
        "int r = (int)((unsigned int)master - ((unsigned int)param << 16)); rem = (short)r;"
        " if (r == 0x8000) { atomicOr(&tie_mask[i >> 5], 1u << (i & 31));"
        " atomicAdd(&tie_count[0], 1); }",
    ),
}


def _cuda_kernel(name: str):
    return backend.elementwise_kernel(f"zero1_remainder_{name}", *_CUDA[name])


# -- the engine options this module owns (declared in config/options.py) ---------------

MASTERS = ("auto", "fp32", "remainder")


def check_masters(value, checked):
    if value not in MASTERS:
        raise ValueError(
            f"masters={value!r} is not understood: use 'auto' (remainders where they apply, "
            "else fp32), 'fp32' or 'remainder' (bfloat16 parameters: 2 bytes a master)"
        )
    dtype, why = checked["param_dtype"], None
    if dtype == np.float32:
        why = "param_dtype is float32, whose shard is its own master"
    elif dtype == np.float16:
        why = (
            "param_dtype is float16, whose 5 exponent bits do not span fp32's: a master is "
            "not its float16 rounding and 16 more bits (2**-30 rounds to 0)"
        )
    elif checked["offload"] is not None and checked["offload_fraction"] == 1:
        why = (
            "offload='cpu' keeps every master on the host, as fp32 (with offload_fraction "
            "below 1 the device's part may be remainders)"
        )
    elif checked["gather_dtype"] is not None:
        why = (
            "gather_dtype='int8' keeps an approximation of the parameters, and a remainder "
            "completes the exact one"
        )
    if value == "remainder" and why:
        raise ValueError(
            f"masters='remainder' keeps the 16 bits a bfloat16 parameter lacks, but {why}: "
            "use masters='fp32' (or 'auto')"
        )
    if value == "auto" and keeps_host_share(checked["offload"], checked["offload_fraction"]):
        return "fp32"  # (the memory tool's tables count offload so too)
    return "remainder" if value != "fp32" and not why else "fp32"
