"""The rule's state in 8 bits (``Int8State``): codes of the dynamic map of 8-bit Adam, an fp32
scale per ``STATE_BLOCK`` values (signed or unsigned map per block), tensors under
``MIN_8BIT_SIZE`` elements in fp32; ``exact_codes`` makes a checkpoint's values load bit for bit.
Same interface as ``encodings.py``'s ``Fp32State``/``Bf16State``. Twins: NumPy, Numba, CuPy.
"""

from __future__ import annotations

import numpy as np

from ..kernels import backend, numba_forms
from ..kernels.numba_scalars import bits_of, float_of
from ..kernels.numba_shared import compile_marked, jit

__all__ = [
    "Int8State",
    "dynamic_map",
    "exact_codes",
    "STATE_BLOCK",
    "MIN_8BIT_SIZE",
    "CODES",
    "BOUNDS",
    "FIRST_CODES",
    "PAST",
    "numba_encode8",
]

FP32 = np.dtype(np.float32)


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 fp32 values of the dynamic (tree) quantization map of Dettmers et al. ("8-bit
    Optimizers via Block-wise Quantization", 2022; bitsandbytes' ``create_dynamic_map``), sorted:
    per decade 10^-6 .. 10^0 of ``|x|`` a linear run of values (twice as many per decade as the one
    below), 0 and 1; ``signed`` halves each run between the two signs (unsigned: all >= 0)."""
    data: list[float] = []
    for i in range(7):
        count = 2**i + 1 if signed else 2 ** (i + 1) + 1
        edges = np.linspace(0.1, 1.0, count, dtype=np.float32)
        means = (edges[:-1] + edges[1:]) / np.float32(2.0)
        run = (np.float32(10.0 ** (i - 6)) * means).astype(np.float32)
        data += run.tolist() + ((-run).tolist() if signed else [])
    data += [0.0, 1.0]
    return np.sort(np.array(data, np.float32))


CODES = {False: dynamic_map(False), True: dynamic_map(True)}  # unsigned, signed
#: The fp32 boundaries between neighbouring codes: a value's code is how many lie below it.
BOUNDS = {s: ((c[:-1].astype(np.float64) + c[1:]) / 2).astype(np.float32) for s, c in CODES.items()}


def _first_codes(bounds) -> np.ndarray:
    """For each top half (16 bits) of an fp32 pattern: how many ``bounds`` lie below the lowest
    value with that top half. A value's code is that plus the bounds between that value and it
    (a top half spans 2^-7 of a value, and the maps' bounds are sparser: at most one), which a
    scan counts: the binary search's count, without its unpredictable branches."""
    top = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lowest = np.where(top >> np.uint32(31) == 1, top | np.uint32(0xFFFF), top).view(np.float32)
    with np.errstate(invalid="ignore"):
        return np.searchsorted(bounds, lowest).astype(np.uint8)


FIRST_CODES = {s: _first_codes(b) for s, b in BOUNDS.items()}
#: The bounds and one past the last (inf), for the step from a first code.
PAST = {s: np.append(b, np.float32(np.inf)) for s, b in BOUNDS.items()}
#: Values per fp32 scale of the 8-bit state (a multiple divides ``Int8State.CHUNK``).
STATE_BLOCK = 256
#: Tensors with fewer elements keep fp32 state (bitsandbytes' ``min_8bit_size``): their bytes are
#: few, and a block of a small tensor (a bias, a norm's gain) holds few values to share a scale.
MIN_8BIT_SIZE = 4096


class Int8State:
    """A state array as 8-bit codes of the dynamic map (``held``: uint8) with one fp32 scale per
    ``STATE_BLOCK`` values of a segment, and the segments of small tensors in fp32 (``side``).

    A block's scale is its largest magnitude, negative where the block holds a negative value:
    the signed map then, else the unsigned one (twice as fine); a value's code is the number of
    ``BOUNDS`` below ``value / |scale|`` (0 for a zero block); a block holding inf or nan gets
    the scale nan and decodes to nan. Blocks start at each segment's start, so that a kernel
    call, which stays within a segment and starts a multiple of ``STATE_BLOCK`` into it, owns
    its blocks whole.

    Args:
        n: elements of the shard; ``segments``: ``(start, stop, quantized)`` shard ranges, in
            order, that the kernel calls stay within; ``largest``: the most elements one call
            (or calls used together) takes; ``xp``; ``kind``: the twin.
    """

    dtype = "int8"
    CHUNK = 1 << 16  # host elements per kernel call: a multiple of STATE_BLOCK

    def __init__(self, n: int, segments, largest: int, xp, kind: str, fused: bool = False):
        self._xp, self._kind = xp, kind
        self.held = xp.zeros(n, np.uint8)
        starts, stops, quantized, offsets, blocks, side = [], [], [], [], 0, 0
        for start, stop, q in segments:
            starts.append(start)
            stops.append(stop)
            quantized.append(q)
            offsets.append(blocks if q else side)
            if q:
                blocks += -(-(stop - start) // STATE_BLOCK)
            else:
                side += stop - start
        self._starts, self._stops = np.array(starts, np.int64), np.array(stops, np.int64)
        self._quantized, self._offsets = quantized, offsets
        self.scales = xp.zeros(blocks, FP32)  # 0: a zero block (the state starts at 0)
        self.side = xp.zeros(side, FP32)
        # ``load``'s scratch; with ``fused`` (a Numba or CuPy pass decodes and encodes each block in
        # its one pass: ``form``) none, and a kernel call takes a whole tensor piece
        self._decoded = xp.empty(0 if fused else largest, FP32)
        self._largest = largest
        self.chunk = 1 << 62 if fused else largest
        if kind == "numba":
            compile_marked(globals())
        self._quotients = np.empty(STATE_BLOCK, FP32)  # (the Numba encoder's scratch)
        self._codes = {s: xp.asarray(c) for s, c in CODES.items()}
        self._bounds = {s: xp.asarray(b) for s, b in BOUNDS.items()}

    @property
    def nbytes(self) -> int:
        return self.held.nbytes + self.scales.nbytes + self.side.nbytes

    @property
    def scratch_bytes(self) -> int:
        return self._decoded.nbytes

    def real_bytes(self, owned: int) -> int:
        """A code per owned element (unused where its tensor is kept in fp32), the scales and
        the fp32 side array."""
        return owned + self.scales.nbytes + self.side.nbytes

    def form(self, st: slice, flat: int, step: int) -> tuple:
        """The state over ``st`` for a Numba or CuPy twin's one pass (``numba_forms``): the
        codes and the scales of its blocks, or a small tensor's fp32 values."""
        i, first = self._blocks_of(st)
        if not self._quantized[i]:
            return numba_forms.state_form(fp32=self.side[first : first + st.stop - st.start])
        blocks = self.scales[first : first + _blocks(st.stop - st.start)]
        return numba_forms.state_form(codes=self.held[st], scales=blocks)

    def load(self, st: slice, at: int):
        i, first = self._blocks_of(st)
        if not self._quantized[i]:  # a small tensor's: fp32, updated in place
            return self.side[first : first + st.stop - st.start]
        if self._decoded.size == 0:  # (made with ``fused``)
            self._decoded = self._xp.empty(self._largest, FP32)
        out = self._decoded[at : at + st.stop - st.start]
        self._decode(self.held[st], self.scales[first:], out)
        return out

    def store(self, st: slice, values, flat: int, step: int) -> None:
        i, first = self._blocks_of(st)
        if self._quantized[i]:
            self._encode(values, self.held[st], self.scales[first : first + _blocks(values.size)])

    def read(self, st: slice):
        out = self._xp.empty(st.stop - st.start, FP32)
        for i, a, b, lo, hi in self._covering(st):
            piece = self._segment_values(i, a, b)
            out[lo - st.start : hi - st.start] = piece[lo - a : hi - a]
        return out

    def write(self, st: slice, values) -> None:
        """Set the values over ``st``; a block it covers in part is decoded, changed and
        encoded again (its other values quantized twice). A block of values that some codes
        and scale decode to gets codes and a scale that decode to them again (``exact_codes``),
        so that a checkpoint of this state loads bit for bit."""
        values = backend.like(self.side, values).astype(FP32, copy=False)
        for i, a, b, lo, hi in self._covering(st):
            piece = self._segment_values(i, a, b)
            piece[lo - a : hi - a] = values[lo - st.start : hi - st.start]
            if self._quantized[i]:
                first = self._offsets[i] + (a - int(self._starts[i])) // STATE_BLOCK
                codes, scales = self.held[a:b], self.scales[first : first + _blocks(b - a)]
                self._encode(piece, codes, scales)
                if self._kind == "cupy":
                    found = exact_codes(*(backend.to_numpy(x) for x in (piece, codes, scales)))
                    codes[...], scales[...] = (self._xp.asarray(x) for x in found)
                else:
                    exact_codes(piece, codes, scales)
            else:
                at = self._offsets[i] + a - int(self._starts[i])
                self.side[at : at + b - a] = piece

    # -- where a range's blocks are -------------------------------------------------------------

    def _blocks_of(self, st: slice) -> tuple[int, int]:
        """``(segment, first scale or side index)`` of a kernel call's range ``st``."""
        i = int(np.searchsorted(self._starts, st.start, "right")) - 1
        into = st.start - int(self._starts[i])
        if i < 0 or st.stop > self._stops[i] or (self._quantized[i] and into % STATE_BLOCK):
            raise AssertionError(f"{st} is not a kernel call's range of the 8-bit state")
        return i, self._offsets[i] + (into // STATE_BLOCK if self._quantized[i] else into)

    def _covering(self, st: slice):
        """``(segment, a, b, lo, hi)``: each segment meeting ``st``, ``[lo, hi)`` its part of
        ``st`` and ``[a, b)`` that part widened to whole blocks."""
        first = max(0, int(np.searchsorted(self._stops, st.start, "right")))
        for i in range(first, len(self._starts)):
            start, stop = int(self._starts[i]), int(self._stops[i])
            if start >= st.stop:
                break
            lo, hi = max(st.start, start), min(st.stop, stop)
            if lo >= hi:
                continue
            a = start + (lo - start) // STATE_BLOCK * STATE_BLOCK
            b = min(stop, start + -(-(hi - start) // STATE_BLOCK) * STATE_BLOCK)
            yield (i, lo, hi, lo, hi) if not self._quantized[i] else (i, a, b, lo, hi)

    def _segment_values(self, i: int, a: int, b: int):
        """A copy of segment ``i``'s values over ``[a, b)`` (whole blocks where quantized)."""
        into = a - int(self._starts[i])
        if not self._quantized[i]:
            return self.side[self._offsets[i] + into : self._offsets[i] + into + b - a].copy()
        out = self._xp.empty(b - a, FP32)
        self._decode(self.held[a:b], self.scales[self._offsets[i] + into // STATE_BLOCK :], out)
        return out

    # -- the twins ---------------------------------------------------------------------------

    def _decode(self, codes, scales, out) -> None:
        n = codes.size
        if self._kind == "numba":
            numba_decode8(codes, scales, CODES[False], CODES[True], out, STATE_BLOCK)
        elif self._kind == "cupy":
            _cuda_kernel8("decode")(codes, scales, self._codes[False], self._codes[True],
                                    STATE_BLOCK, out)  # fmt: skip
        else:
            for lo, hi in _whole_blocks_then_tail(n):  # (each block a row)
                c = codes[lo:hi].reshape(-1, min(STATE_BLOCK, hi - lo))
                scale = scales[lo // STATE_BLOCK : lo // STATE_BLOCK + c.shape[0], None]
                index = c.astype(np.intp)
                index += np.signbit(scale).astype(np.intp) << 8  # the signed map's half
                values = out[lo:hi].reshape(c.shape)
                np.take(_BOTH_MAPS, index, out=values)
                values *= np.abs(scale)

    def _encode(self, values, codes, scales) -> None:
        n = values.size
        if self._kind == "numba":
            numba_encode8(values, PAST[False], PAST[True], FIRST_CODES[False],
                           FIRST_CODES[True], codes, scales, STATE_BLOCK,
                           self._quotients)  # fmt: skip
            return
        if self._kind == "cupy":
            _cuda_kernel8("scales")(values, n, STATE_BLOCK, scales)
            _cuda_kernel8("quantize")(values, scales, self._bounds[False], self._bounds[True],
                                      STATE_BLOCK, codes)  # fmt: skip
            return
        for lo, hi in _whole_blocks_then_tail(n):  # (each block a row)
            v = values[lo:hi].reshape(-1, min(STATE_BLOCK, hi - lo))
            first = lo // STATE_BLOCK
            _numpy_encode(v, codes[lo:hi].reshape(v.shape), scales[first : first + v.shape[0]])


def _blocks(n: int) -> int:
    return -(-n // STATE_BLOCK)


def _whole_blocks_then_tail(n: int):
    """``(lo, hi)``: the whole blocks of ``n`` values, then the partial last block."""
    whole = n // STATE_BLOCK * STATE_BLOCK
    if whole:
        yield 0, whole
    if whole < n:
        yield whole, n


#: The NumPy twin's tables, the signed half after the unsigned one: the maps, the first codes
#: (by top half of a value) and the bounds with inf appended (``PAST``).
_BOTH_MAPS = np.concatenate((CODES[False], CODES[True]))
_BOTH_FIRST = np.concatenate((FIRST_CODES[False], FIRST_CODES[True])).astype(np.int16)
_BOTH_PAST = np.concatenate((PAST[False], PAST[True]))


def _numpy_encode(v, codes, scales) -> None:
    """``v`` (a block per row) encoded into ``codes`` and ``scales``, on the bits as
    ``numba_encode8``: each value's first code, and one step."""
    bits = v.view(np.uint32)
    top = np.bitwise_and(bits, np.uint32(0x7FFFFFFF)).max(axis=1)
    signed = (bits > np.uint32(0x80000000)).any(axis=1)
    bad = top >= np.uint32(0x7F800000)
    amax = top.view(np.float32)
    scales[...] = np.where(bad, np.float32(np.nan), np.where(signed, -amax, amax))
    with np.errstate(invalid="ignore", divide="ignore"):  # (a bad or zero block's: code 0)
        x = v / amax[:, None]
    index = (x.view(np.uint32) >> np.uint32(16)).astype(np.intp)
    index += signed.astype(np.intp)[:, None] << 16
    code = _BOTH_FIRST[index]
    code += _BOTH_PAST[code + (signed.astype(np.int16)[:, None] << 8)] < x
    code[bad | (top == 0)] = 0
    codes[...] = code


def exact_codes(values, codes, scales):
    """Make the NumPy ``codes`` and ``scales`` that ``values`` were encoded to decode to
    ``values`` bit for bit wherever some codes and scale of the signed map do, and return them.

    Encoding is not idempotent for two kinds of block of the signed map: one whose largest
    magnitude was negative (the map ends at 1 but not at -1, so that value decodes to -0.993 of
    the scale, and the decoded block's own largest magnitude is a new scale), and one whose
    negative values all decoded to 0 (its decoded values look unsigned). For each block that
    does not decode to itself, the signed map is tried with the scales that could have made its
    extreme value: its largest value (code 1), and its smallest over the map's most negative
    code, to within 2 fp32 steps; the first that decodes to the block whole is kept, else the
    block keeps its plain encoding (fp32 values that no encoding holds: quantized once)."""
    n = values.size
    padded = _blocks(n) * STATE_BLOCK
    flat = np.zeros(padded, FP32)
    flat[:n] = values
    scale = np.repeat(scales, STATE_BLOCK)[:n]
    back = np.zeros(padded, FP32)
    back[:n] = np.where(np.signbit(scale), CODES[True][codes], CODES[False][codes])
    back[:n] *= np.abs(scale)
    v, decoded = flat.reshape(-1, STATE_BLOCK), back.reshape(-1, STATE_BLOCK)
    bits = v.view(np.uint32)
    wrong = np.flatnonzero(
        np.isfinite(v).all(axis=1) & (decoded.view(np.uint32) != bits).any(axis=1)
    )
    if wrong.size == 0:
        return codes, scales
    signed, bounds = CODES[True], BOUNDS[True]
    largest = v[wrong].max(axis=1)
    from_min = (-v[wrong].min(axis=1) / -signed[0]).astype(FP32)
    down, up = [from_min], [from_min]
    for _ in range(2):
        down.append(np.nextafter(down[-1], np.float32(0)))
        up.append(np.nextafter(up[-1], np.float32(np.inf)))
    candidates = [largest, from_min, down[1], up[1], down[2], up[2]]
    all_codes = np.zeros(padded, np.uint8)
    all_codes[:n] = codes
    codes2d = all_codes.reshape(-1, STATE_BLOCK)
    done = np.zeros(wrong.size, bool)
    for s in candidates:
        s = s.astype(FP32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            x = v[wrong] / s[:, None]
        trial = np.searchsorted(bounds, np.nan_to_num(x), "left").astype(np.uint8)
        back = signed[trial] * s[:, None]
        fits = ~done & (s > 0) & (back.view(np.uint32) == bits[wrong]).all(axis=1)
        codes2d[wrong[fits]] = trial[fits]
        scales[wrong[fits]] = -s[fits]
        done |= fits
    codes[...] = all_codes[:n]
    return codes, scales


@jit
def numba_decode8(codes, scales, unsigned, signed, out, block):
    for i in range(codes.size):
        s = scales[i // block]
        table = signed if np.signbit(s) else unsigned
        out[i] = table[codes[i]] * abs(s)


@jit
def numba_encode8(
    values, unsigned, signed, first_unsigned, first_signed, codes, scales, block, quotients
):
    """``values`` encoded (``Int8State``): per block its scale, and each value's code, its
    first code (``FIRST_CODES``) plus whether the next bound (``unsigned``/``signed``: the
    bounds with inf appended, ``PAST``) lies below it: one step, always enough (a top half
    holds at most one bound; tests/test_state_dtypes.py checks every top half).
    ``quotients``: ``block`` fp32 of scratch (the divisions in a loop of their own vectorize)."""
    n = values.size
    for b in range((n + block - 1) // block):
        lo, hi = b * block, min(n, (b + 1) * block)
        # On the bits: the largest magnitude's (inf or nan above 0x7F800000) and whether a
        # value is below 0 (sign bit and a magnitude): integer reductions, which vectorize.
        top, negative = np.uint32(0), np.uint32(0)
        for i in range(lo, hi):
            u = bits_of(values[i])
            m = u & np.uint32(0x7FFFFFFF)
            top = np.uint32(m if m > top else top)
            negative = np.uint32(negative | (u > np.uint32(0x80000000)))
        bad = top >= np.uint32(0x7F800000)
        amax = float_of(top)
        up = negative == 0
        scales[b] = np.float32(np.nan) if bad else (amax if up else -amax)
        if bad or top == 0:
            codes[lo:hi] = 0
            continue
        past = unsigned if up else signed
        starts = first_unsigned if up else first_signed
        v, out = values[lo:hi], codes[lo:hi]
        for i in range(hi - lo):
            quotients[i] = v[i] / amax
        for i in range(hi - lo):
            x = quotients[i]
            code = np.int32(starts[bits_of(x) >> np.uint32(16)])
            out[i] = code + (past[code] < x)


_CUDA8: dict[str, tuple[str, str, str]] = {
    "decode": (
        "uint8 code, raw float32 scales, raw float32 unsigned_map, raw float32 signed_map, "
        "int64 block",
        "float32 out",
        "float s = scales[i / block];"
        " out = __fmul_rn(signbit(s) ? signed_map[code] : unsigned_map[code], fabsf(s));",
    ),
    "scales": (
        "raw float32 x, int64 n, int64 block",
        "float32 scale",
        "long long lo = i * block, hi = min(n, lo + block); float amax = 0.0f, low = 0.0f;"
        " bool bad = false;"
        " for (long long j = lo; j < hi; ++j) { float a = fabsf(x[j]);"
        " if (!(a <= 3.402823466e+38f)) bad = true; else amax = fmaxf(amax, a);"
        " low = fminf(low, x[j]); }"
        " scale = bad ? __int_as_float(0x7fc00000) : (low >= 0.0f ? amax : -amax);",
    ),
    "quantize": (
        "float32 x, raw float32 scales, raw float32 unsigned_bounds, "
        "raw float32 signed_bounds, int64 block",
        "uint8 code",
        "float s = scales[i / block], a = fabsf(s); int first = 0;"
        " if (!isnan(s) && a != 0.0f) { float v = __fdiv_rn(x, a); int last = 255;"
        " while (first < last) { int m = (first + last) / 2;"
        " float bound = signbit(s) ? signed_bounds[m] : unsigned_bounds[m];"
        " if (bound < v) first = m + 1; else last = m; } }"
        " code = (unsigned char)first;",
    ),
}


def _cuda_kernel8(name: str):
    return backend.elementwise_kernel(f"zero1_state_int8_{name}", *_CUDA8[name])
