"""The 8-bit wire format: blockwise symmetric int8 with one fp32 scale per block, in three twins.

A row of ``n`` values travels as ``packed_bytes(n)`` bytes: the fp32 scales of its ``BLOCK``-value
blocks, then the int8 values. In fp32 (the float64 model of ``tests/reference.py`` repeats it):
``encode``: ``v = x (+ residual)``, per block ``scale = max|v| / 127``, ``q = clip(rint(v /
scale), ±127)`` (0 for a zero scale), ``residual = v - q * scale`` in its dtype; a block holding
inf or nan gets the scale nan (q and residual 0), so it decodes to nan. ``decode_sum``: rows
decoded and added in row order; ``decode_add``: ``target + decoded`` rounded to its dtype.
``codec_for(kind, largest)``: the NumPy, Numba or CuPy twin, the same bits (CuPy flushes fp32
subnormals, as all its kernels here); scratch allocated once. ``BLOCK``: docs/performance.md.
"""

from __future__ import annotations

import numpy as np

from ..kernels import backend
from ..kernels.numba_shared import (
    BF16,
    CHUNK,
    FP16_TABLE,
    FP32,
    compile_marked,
    encoding,
    jit,
    narrow_bf16,
    narrow_f16,
    widen,
)
from .sizes import BLOCK, packed_bytes

__all__ = [
    "BLOCK",
    "LEVELS",
    "packed_bytes",
    "split_packed",
    "codec_for",
    "NumpyCodec",
    "NumbaCodec",
    "CupyCodec",
]

#: The largest quantized magnitude (symmetric: -127 .. 127).
LEVELS = 127
F32 = np.float32
#: Elements per NumPy pass (a multiple of ``BLOCK``): the fp32 scratch stays in cache.
NUMPY_CHUNK = 1 << 16


def split_packed(packed, n: int, block: int = BLOCK):
    """``(scales, q)``: the fp32 scales and the ``n`` int8 values of the byte row ``packed``."""
    blocks = -(-n // block)
    return packed[: 4 * blocks].view(F32), packed[4 * blocks : 4 * blocks + n].view(np.int8)


def codec_for(kind: str, largest: int = NUMPY_CHUNK, block: int = BLOCK):
    """The codec of the kernel family ``kind``; ``largest``: the most values one call sees;
    ``block``: values per scale (the engine's: ``BLOCK``; others for ``tools/bench.py quant``)."""
    if kind == "cupy":
        return CupyCodec(block)
    if kind == "numba":
        return NumbaCodec(largest, block)
    return NumpyCodec(largest, block)


class NumpyCodec:
    """The NumPy twin, a chunk of ``NUMPY_CHUNK`` values at a time."""

    def __init__(self, largest: int = NUMPY_CHUNK, block: int = BLOCK):
        self.block = block
        chunk = max(block, NUMPY_CHUNK // block * block)
        size = max(block, min(-(-largest // block) * block, chunk))
        self._v, self._w = np.empty(size, F32), np.empty(size, F32)

    @property
    def scratch_bytes(self) -> int:
        return self._v.nbytes + self._w.nbytes

    def encode(self, x, packed, residual=None) -> None:
        """Quantize ``x`` (fp32, bf16 or fp16) into the byte row ``packed``; with ``residual``
        (``x``'s dtype and size), add it first and leave there what quantizing dropped."""
        b = self.block
        scales, q = split_packed(packed, x.size, b)
        for start in range(0, x.size, self._v.size):
            stop = min(x.size, start + self._v.size)
            v, w = self._v[: stop - start], self._w[: stop - start]
            np.copyto(v, x[start:stop], casting="unsafe")
            if residual is not None:
                np.copyto(w, residual[start:stop], casting="unsafe")
                np.add(v, w, out=v)
            s = scales[start // b : -(-stop // b)]
            bad = _block_scales(v, s, b)
            _per_value(s, v, np.divide, w, b, zero_for=bad)  # w = v / scale (0: a zero block)
            np.rint(w, out=w)
            np.clip(w, -LEVELS, LEVELS, out=w)
            q[start:stop] = w
            if residual is not None:
                _per_value(s, w, np.multiply, w, b)  # w = q * scale
                np.subtract(v, w, out=v)
                _zero_blocks(v, bad, b)
                residual[start:stop] = v

    def decode_sum(self, rows, n: int, out) -> None:
        """``out`` (fp32, ``n``) = the sum of the byte rows ``rows`` decoded, in row order."""
        b = self.block
        for start in range(0, n, self._v.size):
            stop = min(n, start + self._v.size)
            total, w = out[start:stop], self._w[: stop - start]
            for r in range(rows.shape[0]):
                scales, q = split_packed(rows[r], n, b)
                target = total if r == 0 else w
                np.copyto(target, q[start:stop], casting="unsafe")
                _per_value(scales[start // b : -(-stop // b)], target, np.multiply, target, b)
                if r:
                    np.add(total, w, out=total)

    def decode_add(self, packed, target) -> None:
        """``target`` (fp32, bf16 or fp16) = ``target + decoded``, rounded to its dtype."""
        n, b = target.size, self.block
        scales, q = split_packed(packed, n, b)
        for start in range(0, n, self._v.size):
            stop = min(n, start + self._v.size)
            v, w = self._v[: stop - start], self._w[: stop - start]
            np.copyto(w, q[start:stop], casting="unsafe")
            _per_value(scales[start // b : -(-stop // b)], w, np.multiply, w, b)
            np.copyto(v, target[start:stop], casting="unsafe")
            np.add(v, w, out=v)
            target[start:stop] = v


def _blocks(values, block):
    """``(full, tail)``: the whole blocks of ``values`` as rows of ``block``, and the rest."""
    full = values.size // block * block
    return values[:full].reshape(-1, block), values[full:]


def _block_scales(v, scales, block):
    """``scales`` = each block's ``max |v| / 127`` (nan where a value is not finite); returns
    which blocks are bad (nan scale)."""
    amax = np.maximum.reduceat(np.abs(v), np.arange(0, v.size, block))
    bad = ~np.isfinite(amax)
    np.divide(amax, F32(LEVELS), out=scales)
    scales[bad] = np.nan
    return bad


def _per_value(scales, values, op, out, block, zero_for=None):
    """``out = op(values, scale of each value's block)``; with ``zero_for`` (bad blocks),
    0 where the scale is 0 or bad."""
    if zero_for is not None:
        divisor = np.where(zero_for | (scales == 0), F32(1), scales)
        full_v, tail_v = _blocks(values, block)
        full_o, tail_o = _blocks(out, block)
        op(full_v, divisor[: full_v.shape[0], None], out=full_o)
        if tail_v.size:
            op(tail_v, divisor[-1], out=tail_o)
        _zero_blocks(out, zero_for, block)
        return
    full_v, tail_v = _blocks(values, block)
    full_o, tail_o = _blocks(out, block)
    op(full_v, scales[: full_v.shape[0], None], out=full_o)
    if tail_v.size:
        op(tail_v, scales[-1], out=tail_o)


def _zero_blocks(values, bad, block) -> None:
    """0 in the blocks of ``values`` marked ``bad``."""
    for index in np.flatnonzero(bad):
        values[index * block : (index + 1) * block] = 0


# -- the Numba twin: per block, widened into fp32 scratch; 16-bit values as bit patterns -----


@jit
def _encode(x32, x16, kind, res32, res16, feedback, table, v, w, scales, q, block):
    n = x32.size if kind == FP32 else x16.size
    one = np.empty(1, np.int32)
    for b in range((n + block - 1) // block):
        lo, hi = b * block, min(n, (b + 1) * block)
        vb, wb = v[: hi - lo], w[: hi - lo]
        if kind == FP32:
            vb[:] = x32[lo:hi]
        else:
            widen(x16[lo:hi], kind, table, vb)
        if feedback:
            if kind == FP32:
                wb[:] = res32[lo:hi]
            else:
                widen(res16[lo:hi], kind, table, wb)
            _add(vb, wb)
        scale = _block_scale(vb, one)
        scales[b] = scale
        if np.isnan(scale) or scale == np.float32(0):  # a bad or zero block: zeros
            q[lo:hi] = 0
            if np.isnan(scale):
                vb[:] = np.float32(0)
        else:
            _quantize(vb, scale, q[lo:hi], wb, feedback)
        if feedback:
            if kind == FP32:
                res32[lo:hi] = vb
            elif kind == BF16:
                narrow_bf16(vb, res16[lo:hi])
            else:
                narrow_f16(vb, res16[lo:hi])


@jit(inline="never")
def _add(total, values):
    for i in range(total.size):
        total[i] = total[i] + values[i]


@jit(inline="never")
def _block_scale(v, one):
    """``max |v| / 127``, or nan where a value is not finite. The largest magnitude is found on
    the bit patterns (for finite floats their order is the integers'), which vectorizes."""
    bits = v.view(np.int32)
    top = np.int32(0)
    for i in range(bits.size):
        a = bits[i] & np.int32(0x7FFFFFFF)
        top = a if a > top else top
    if top >= np.int32(0x7F800000):  # inf or nan
        return np.float32(np.nan)
    one[0] = top  # (one: an int32 scratch of one element)
    return one.view(np.float32)[0] / np.float32(LEVELS)


@jit(inline="never")
def _quantize(v, scale, q, w, feedback):
    """``q`` = ``v / scale`` rounded and clipped; with ``feedback``, ``v`` = what was dropped."""
    for i in range(v.size):
        w[i] = min(max(np.rint(v[i] / scale), np.float32(-LEVELS)), np.float32(LEVELS))
    for i in range(v.size):
        q[i] = np.int8(w[i])
    if feedback:
        for i in range(v.size):
            v[i] = v[i] - w[i] * scale


@jit
def _decode_sum(q, scales, n, out, block):
    for b in range((n + block - 1) // block):
        lo, hi = b * block, min(n, (b + 1) * block)
        _scaled(q[0, lo:hi], scales[0, b], out[lo:hi])
        for r in range(1, q.shape[0]):
            _scaled_add(q[r, lo:hi], scales[r, b], out[lo:hi])


@jit(inline="never")
def _scaled(q, scale, out):
    for i in range(q.size):
        out[i] = np.float32(q[i]) * scale


@jit(inline="never")
def _scaled_add(q, scale, out):
    for i in range(q.size):
        out[i] = out[i] + np.float32(q[i]) * scale


@jit
def _decode_add(q, scales, t32, t16, kind, table, v, block):
    n = q.size
    for lo in range(0, n, v.size):  # v.size: a multiple of block
        hi = min(n, lo + v.size)
        vb = v[: hi - lo]
        if kind == FP32:
            vb[:] = t32[lo:hi]
        else:
            widen(t16[lo:hi], kind, table, vb)
        for b in range(lo // block, (hi + block - 1) // block):
            a, z = b * block - lo, min(hi, (b + 1) * block) - lo
            _scaled_add(q[lo + a : lo + z], scales[b], vb[a:z])
        if kind == FP32:
            t32[lo:hi] = vb
        elif kind == BF16:
            narrow_bf16(vb, t16[lo:hi])
        else:
            narrow_f16(vb, t16[lo:hi])


_NO32, _NO16 = np.empty(0, F32), np.empty(0, np.uint16)


def _split(array):
    """``(fp32 array, 16-bit patterns, encoding)``, the unused one empty."""
    if array is None:
        return _NO32, _NO16
    return (array, _NO16) if encoding(array) == FP32 else (_NO32, array.view(np.uint16))


class NumbaCodec:
    """The compiled twin: the bits of ``NumpyCodec``."""

    def __init__(self, largest: int = CHUNK, block: int = BLOCK):
        compile_marked(globals())
        self.block = block
        self._v, self._w = np.empty(block, F32), np.empty(block, F32)
        self._add = np.empty(max(1, min(largest, CHUNK) // block) * block, F32)

    @property
    def scratch_bytes(self) -> int:
        return self._v.nbytes + self._w.nbytes + self._add.nbytes

    def encode(self, x, packed, residual=None) -> None:
        scales, q = split_packed(packed, x.size, self.block)
        x32, x16 = _split(x)
        r32, r16 = _split(residual)
        _encode(x32, x16, encoding(x), r32, r16, residual is not None, FP16_TABLE,
                self._v, self._w, scales, q, self.block)  # fmt: skip

    def decode_sum(self, rows, n: int, out) -> None:
        blocks = -(-n // self.block)
        scales = rows[:, : 4 * blocks].view(F32)
        q = rows[:, 4 * blocks : 4 * blocks + n].view(np.int8)
        _decode_sum(q, scales, n, out, self.block)

    def decode_add(self, packed, target) -> None:
        scales, q = split_packed(packed, target.size, self.block)
        t32, t16 = _split(target)
        _decode_add(q, scales, t32, t16, encoding(target), FP16_TABLE, self._add, self.block)


# -- the CuPy twin: a thread per block for the scales, a thread per value for the rest; products
# and sums rounded one at a time (__fmul_rn, __fadd_rn: no fused multiply-add), as on the CPU ---

_SCALES = r"""
    long long lo = i * block, hi = min(lo + block, n);
    float amax = 0.0f;
    bool bad = false;
    for (long long j = lo; j < hi; ++j) {
        float a = fabsf(VALUE(j));
        if (!(a <= 3.402823466e+38f)) bad = true; else amax = fmaxf(amax, a);
    }
    scale = bad ? __int_as_float(0x7fc00000) : amax / 127.0f;
"""
_QUANTIZE = r"""
    float s = scales[i / block];
    float v = VALUE;
    bool bad = isnan(s);
    float qi = (bad || s == 0.0f) ? 0.0f : fminf(fmaxf(rintf(v / s), -127.0f), 127.0f);
    q = (signed char)qi;
    FEEDBACK
"""
_DECODE_SUM = r"""
    float total = 0.0f;
    for (int r = 0; r < rows; ++r) {
        const unsigned char* row = &packed[r * row_bytes];
        float v = __fmul_rn((float)((const signed char*)(row + 4 * blocks))[i],
                            ((const float*)row)[i / block]);
        total = r == 0 ? v : __fadd_rn(total, v);
    }
    out = total;
"""
_DECODE_ADD = r"""
    target = (T)__fadd_rn((float)target, __fmul_rn((float)q, scales[i / block]));
"""


class CupyCodec:
    """The CuPy twin: CuPy elementwise kernels on the current stream."""

    scratch_bytes = 0

    def __init__(self, block: int = BLOCK):
        self.block = block

    def encode(self, x, packed, residual=None) -> None:
        scales, q = split_packed(packed, x.size, self.block)
        if residual is None:
            backend.elementwise_kernel(
                "zero1_int8_scales",
                "raw X x, int64 n, int64 block",
                "float32 scale",
                _SCALES.replace("VALUE(j)", "(float)x[j]"),
            )(x, x.size, self.block, scales)
            backend.elementwise_kernel(
                "zero1_int8_quantize",
                "X x, raw float32 scales, int64 block",
                "int8 q",
                _QUANTIZE.replace("VALUE", "(float)x").replace("FEEDBACK", ""),
            )(x, scales, self.block, q)
            return
        backend.elementwise_kernel(
            "zero1_int8_scales_feedback",
            "raw X x, raw X residual, int64 n, int64 block",
            "float32 scale",
            _SCALES.replace("VALUE(j)", "__fadd_rn((float)x[j], (float)residual[j])"),
        )(x, residual, x.size, self.block, scales)
        backend.elementwise_kernel(
            "zero1_int8_quantize_feedback",
            "X x, raw float32 scales, int64 block",
            "int8 q, X residual",
            _QUANTIZE.replace("VALUE", "__fadd_rn((float)x, (float)residual)").replace(
                "FEEDBACK", "residual = (X)(bad ? 0.0f : __fsub_rn(v, __fmul_rn(qi, s)));"
            ),
        )(x, scales, self.block, q, residual)

    def decode_sum(self, rows, n: int, out) -> None:
        backend.elementwise_kernel(
            "zero1_int8_decode_sum",
            "raw uint8 packed, int32 rows, int64 row_bytes, int64 blocks, int64 block",
            "float32 out", _DECODE_SUM,
        )(rows.reshape(-1), rows.shape[0], rows.shape[1], -(-n // self.block), self.block,
          out)  # fmt: skip

    def decode_add(self, packed, target) -> None:
        scales, q = split_packed(packed, target.size, self.block)
        backend.elementwise_kernel(
            "zero1_int8_decode_add", "int8 q, raw float32 scales, int64 block", "T target",
            _DECODE_ADD,
        )(q, scales, self.block, target)  # fmt: skip
