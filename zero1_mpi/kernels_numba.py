"""Compiled CPU kernels (Numba): the rules' updates and the engine's reductions, bitwise equal
to their NumPy twins (``rules.adam.NumpyAdam``, ``reductions.NumpyReductions``).

Optional (``pip install zero1-mpi[fast]``); used when Numba imports (``ZERO1_MPI_KERNEL``).
One pass over each cache-sized chunk does everything the NumPy twin does in ~14 ufunc passes,
with the same float32 operations in the same order (no fused multiply-add, no fast-math), so
the results are bit for bit those of the NumPy twins. Numba has no CPU float16 type, so
16-bit values travel as ``uint16`` bit patterns: bf16 widens by a shift and rounds to nearest
even on the way back; fp16 widens through a 65536-entry table and rounds with integer
arithmetic, subnormals and overflow included.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .reductions import NUMPY_CHUNK, add_blocks, sum_of_squares
from .rules.lamb import NumpyLamb
from .rules.sgd import split_args

FP32, BF16, FP16 = 0, 1, 2  # how a gradient or parameter array is encoded
_FP16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)
_NO_F32 = np.empty(0, np.float32)
_NO_U16 = np.empty(0, np.uint16)
CHUNK = 4096  # elements of scratch per pass: 16 KiB, stays in L1


# Each pass is its own (not inlined) function over whole slices: that is what lets LLVM
# vectorize it; fused into one loop the same work ran 30-40% slower.

@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _widen(bits16, kind, table, out):
    """``out`` = the 16-bit values ``bits16`` (bf16 or fp16 patterns) as fp32, exactly."""
    if kind == BF16:
        out32 = out.view(np.uint32)
        for i in range(bits16.size):
            out32[i] = np.uint32(bits16[i]) << np.uint32(16)
    else:
        for i in range(bits16.size):
            out[i] = table[bits16[i]]


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _narrow_bf16(values, out):
    """``out`` = ``values`` rounded to bf16 (nearest even; NaN stays NaN), as bit patterns."""
    bits = values.view(np.uint32)
    for i in range(values.size):
        u = bits[i]
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        quiet_nan = (u >> np.uint32(16)) | np.uint32(0x40)
        is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[i] = np.uint16(quiet_nan if is_nan else rounded)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _narrow_f16(values, out):
    """``out`` = ``values`` rounded to IEEE half (nearest even, subnormals, inf), as bits."""
    bits = values.view(np.uint32)
    for i in range(values.size):
        u = bits[i]
        sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
        a = u & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):                       # NaN: keep it a quiet NaN
            h = np.uint32(0x7E00)
        elif a >= np.uint32(0x477FF000):                    # >= 65520: rounds to inf
            h = np.uint32(0x7C00)
        elif a < np.uint32(0x38800000):                     # below 2^-14: subnormal or 0
            h = np.uint32(np.rint(abs(values[i]) * np.float32(16777216.0)))  # x 2^24, exact
        else:                                               # normal: rebias, round 23->10
            r = a - np.uint32(112 << 23)
            h = r >> np.uint32(13)
            rest = r & np.uint32(0x1FFF)
            if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):
                h += np.uint32(1)
        out[i] = np.uint16(sign | h)


@njit(cache=True, error_model="numpy", nogil=True)
def _fp32_chunk(grad32, grad16, grad_kind, table, scratch, start, stop):
    """The gradient over ``[start, stop)`` in fp32: a slice, or the 16-bit chunk widened into
    the scratch."""
    if grad_kind == FP32:
        return grad32[start:stop]
    grad = scratch[:stop - start]
    _widen(grad16[start:stop], grad_kind, table, grad)
    return grad


@njit(cache=True, error_model="numpy", nogil=True)
def _round_params(master, param16, param_kind):
    """The 16-bit parameters (bit patterns) = the fp32 masters rounded; nothing for fp32."""
    if param_kind == BF16:
        _narrow_bf16(master, param16)
    elif param_kind == FP16:
        _narrow_f16(master, param16)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _update(grad, master, m, v, grad_scale, beta2, omb1, omb2, eps, l2, decay, neg_step,
            bc2_sqrt):
    """The update over one chunk (fp32 gradient in, state in place): the NumPy twin's
    operations in its order."""
    for i in range(master.size):
        g = grad[i] * grad_scale                         # mean gradient
        p = master[i]
        if l2 != 0:
            g = g + p * l2                               # Adam: L2 term
        mi = m[i]
        mi = mi + (g - mi) * omb1                        # m = lerp(m, g, 1 - beta1)
        vi = v[i] * beta2 + (g * g) * omb2               # v = beta2 v + (1 - beta2) g^2
        if decay != 1:
            p = p * decay                                # AdamW: p *= 1 - lr wd
        denom = np.sqrt(vi) / bc2_sqrt + eps             # bias-corrected sqrt(v) + eps
        m[i] = mi
        v[i] = vi
        master[i] = p + (mi / denom) * neg_step          # p -= lr / (1 - beta1^t) m / denom


@njit(cache=True, error_model="numpy", nogil=True)
def _adam(grad32, grad16, grad_kind, master, m, v, param16, param_kind, table, scratch,
          grad_scale, beta2, omb1, omb2, eps, l2, decay, neg_step, bc2_sqrt):
    n = master.size
    for start in range(0, n, scratch.size):
        stop = min(n, start + scratch.size)
        grad = _fp32_chunk(grad32, grad16, grad_kind, table, scratch, start, stop)
        _update(grad, master[start:stop], m[start:stop], v[start:stop], grad_scale, beta2,
                omb1, omb2, eps, l2, decay, neg_step, bc2_sqrt)
        _round_params(master[start:stop], param16[start:stop], param_kind)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _sgd_update(grad, master, buf, grad_scale, weight_decay, momentum, omd, nesterov, first,
                neg_lr):
    """SGD over one chunk: ``rules.sgd.NumpySGD``'s operations in its order."""
    for i in range(master.size):
        g = grad[i] * grad_scale                         # mean gradient
        p = master[i]
        if weight_decay != 0:
            g = g + p * weight_decay                     # L2 weight decay
        if momentum != 0:
            if first:
                b = g                                    # the buffer starts as g
            else:
                b = buf[i] * momentum + g * omd          # b = m b + (1 - d) g
            buf[i] = b
            if nesterov:
                g = g + b * momentum                     # Nesterov: g + m b
            else:
                g = b
        master[i] = p + g * neg_lr                       # p -= lr g


@njit(cache=True, error_model="numpy", nogil=True)
def _sgd(grad32, grad16, grad_kind, master, buf, param16, param_kind, table, scratch,
         grad_scale, weight_decay, momentum, omd, nesterov, first, neg_lr):
    n = master.size
    for start in range(0, n, scratch.size):
        stop = min(n, start + scratch.size)
        grad = _fp32_chunk(grad32, grad16, grad_kind, table, scratch, start, stop)
        _sgd_update(grad, master[start:stop], buf[start:stop],
                    grad_scale, weight_decay, momentum, omd, nesterov, first, neg_lr)
        _round_params(master[start:stop], param16[start:stop], param_kind)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _lion_update(grad, master, m, grad_scale, beta1, omb1, beta2, omb2, decay, neg_lr):
    """Lion over one chunk: ``rules.lion.NumpyLion``'s operations in its order."""
    for i in range(master.size):
        g = grad[i] * grad_scale                         # mean gradient
        mi = m[i]
        c = mi * beta1 + g * omb1                        # c = b1 m + (1 - b1) g
        p = master[i]
        if decay != 1:
            p = p * decay                                # p *= 1 - lr wd
        master[i] = p + np.sign(c) * neg_lr              # p -= lr sign(c)
        m[i] = mi * beta2 + g * omb2                     # m = b2 m + (1 - b2) g


@njit(cache=True, error_model="numpy", nogil=True)
def _lion(grad32, grad16, grad_kind, master, m, param16, param_kind, table, scratch,
          grad_scale, beta1, omb1, beta2, omb2, decay, neg_lr):
    n = master.size
    for start in range(0, n, scratch.size):
        stop = min(n, start + scratch.size)
        grad = _fp32_chunk(grad32, grad16, grad_kind, table, scratch, start, stop)
        _lion_update(grad, master[start:stop], m[start:stop], grad_scale, beta1, omb1, beta2,
                     omb2, decay, neg_lr)
        _round_params(master[start:stop], param16[start:stop], param_kind)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _lamb_direction(grad, p, m, v, u, grad_scale, beta2, omb1, omb2, inv_bc1, inv_bc2_sqrt, eps,
                    weight_decay):
    """LAMB's moments and ``u = m inv_bc1 / (sqrt(v) inv_bc2_sqrt + eps) + wd p`` over one
    chunk: ``rules.lamb.NumpyLamb._direction``'s operations in its order."""
    for i in range(p.size):
        g = grad[i] * grad_scale                         # mean gradient
        mi = m[i]
        mi = mi + (g - mi) * omb1                        # m = lerp(m, g, 1 - beta1)
        vi = v[i] * beta2 + (g * g) * omb2               # v = beta2 v + (1 - beta2) g^2
        m[i] = mi
        v[i] = vi
        ui = (mi * inv_bc1) / (np.sqrt(vi) * inv_bc2_sqrt + eps)
        if weight_decay != 0:
            ui = ui + p[i] * weight_decay
        u[i] = ui


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _lamb_step(p, m, v, inv_bc1, inv_bc2_sqrt, eps, weight_decay, neg_step):
    """``p -= lr r u`` over one chunk, ``u`` recomputed from the new moments as
    ``_lamb_direction`` computed it."""
    for i in range(p.size):
        ui = (m[i] * inv_bc1) / (np.sqrt(v[i]) * inv_bc2_sqrt + eps)
        if weight_decay != 0:
            ui = ui + p[i] * weight_decay
        p[i] = p[i] + ui * neg_step


@njit(cache=True, error_model="numpy", nogil=True)
def _lamb_chunk(grad32, grad16, grad_kind, table, scratch, p, m, v, u, grad_scale, beta2,
                omb1, omb2, inv_bc1, inv_bc2_sqrt, eps, weight_decay):
    grad = _fp32_chunk(grad32, grad16, grad_kind, table, scratch, 0, p.size)
    _lamb_direction(grad, p, m, v, u, grad_scale, beta2, omb1, omb2, inv_bc1, inv_bc2_sqrt, eps,
                    weight_decay)


@njit(cache=True, error_model="numpy", nogil=True)
def _lamb_apply(p, m, v, param16, param_kind, inv_bc1, inv_bc2_sqrt, eps, weight_decay,
                neg_step):
    _lamb_step(p, m, v, inv_bc1, inv_bc2_sqrt, eps, weight_decay, neg_step)
    _round_params(p, param16, param_kind)


@njit(cache=True, error_model="numpy", nogil=True)
def _sum_blocks(blocks, kind, table, scratch, out):
    """``out`` = the rows of ``blocks`` (16-bit patterns) widened and summed in fp32, in row
    order (as the NumPy path: row 0, plus row 1, plus row 2, ...)."""
    rows, count = blocks.shape
    for start in range(0, count, scratch.size):
        stop = min(count, start + scratch.size)
        _widen(blocks[0, start:stop], kind, table, out[start:stop])
        for r in range(1, rows):
            widened = scratch[:stop - start]
            _widen(blocks[r, start:stop], kind, table, widened)
            _accumulate(out[start:stop], widened)


@njit(cache=True, error_model="numpy", nogil=True, inline="never")
def _accumulate(total, values):
    for i in range(total.size):
        total[i] = total[i] + values[i]


def _encoding(array) -> int:
    name = array.dtype.name
    return FP32 if name == "float32" else BF16 if name == "bfloat16" else FP16


class NumbaAdam:
    """The compiled twin of ``rules.adam.NumpyAdam``: same interface, same bits."""

    def __init__(self, chunk: int = CHUNK):
        self._scratch = np.empty(max(1, min(chunk, CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes

    def __call__(self, grad, master, exp_avg, exp_avg_sq, param, s) -> None:
        f = np.float32
        grad32, grad16, kind = _split(grad)
        param16 = _NO_U16 if param is None else param.view(np.uint16)
        param_kind = FP32 if param is None else _encoding(param)
        _adam(grad32, grad16, kind, master, exp_avg, exp_avg_sq, param16, param_kind,
              _FP16_TABLE, self._scratch, f(s.grad_scale), f(s.beta2), f(s.one_minus_beta1),
              f(s.one_minus_beta2), f(s.eps), f(s.l2), f(s.decay), f(-s.step_size),
              f(s.bc2_sqrt))


class NumbaSGD:
    """The compiled twin of ``rules.sgd.NumpySGD``: same interface, same bits."""

    def __init__(self, has_buffer: bool, chunk: int = CHUNK):
        self.has_buffer = has_buffer
        self._scratch = np.empty(max(1, min(chunk, CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes

    def __call__(self, grad, master, *rest) -> None:
        buf, param, s = split_args(self.has_buffer, rest)
        f = np.float32
        grad32, grad16, kind = _split(grad)
        param16 = _NO_U16 if param is None else param.view(np.uint16)
        param_kind = FP32 if param is None else _encoding(param)
        momentum = f(s.momentum) if buf is not None else f(0)
        _sgd(grad32, grad16, kind, master, _NO_F32 if buf is None else buf, param16,
             param_kind, _FP16_TABLE, self._scratch, f(s.grad_scale), f(s.weight_decay),
             momentum, f(s.one_minus_dampening), bool(s.nesterov), bool(s.first),
             f(s.neg_lr))


class NumbaLion:
    """The compiled twin of ``rules.lion.NumpyLion``: same interface, same bits."""

    def __init__(self, chunk: int = CHUNK):
        self._scratch = np.empty(max(1, min(chunk, CHUNK)), np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._scratch.nbytes

    def __call__(self, grad, master, exp_avg, param, s) -> None:
        f = np.float32
        grad32, grad16, kind = _split(grad)
        param16 = _NO_U16 if param is None else param.view(np.uint16)
        param_kind = FP32 if param is None else _encoding(param)
        _lion(grad32, grad16, kind, master, exp_avg, param16, param_kind, _FP16_TABLE,
              self._scratch, f(s.grad_scale), f(s.beta1), f(s.one_minus_beta1), f(s.beta2),
              f(s.one_minus_beta2), f(s.decay), f(s.neg_lr))


class NumbaLamb(NumpyLamb):
    """The compiled twin of ``rules.lamb.NumpyLamb``: its chunk loop and dot products, with
    each chunk's elementwise work compiled; the same bits."""

    def _direction(self, grad, p, m, v, s):
        f = np.float32
        grad32, grad16, kind = _split(grad)
        u = self._u[:p.size]
        _lamb_chunk(grad32, grad16, kind, _FP16_TABLE, self._g, p, m, v, u, f(s.grad_scale),
                    f(s.beta2), f(s.one_minus_beta1), f(s.one_minus_beta2), f(s.inv_bc1),
                    f(s.inv_bc2_sqrt), f(s.eps), f(s.weight_decay))
        return u

    def _apply(self, p, m, v, param, s) -> None:
        f = np.float32
        param16 = _NO_U16 if param is None else param.view(np.uint16)
        param_kind = FP32 if param is None else _encoding(param)
        _lamb_apply(p, m, v, param16, param_kind, f(s.inv_bc1), f(s.inv_bc2_sqrt), f(s.eps),
                    f(s.weight_decay), f(s.neg_step))


class NumbaReductions:
    """The compiled twin of ``reductions.NumpyReductions``: same interface, same bits."""

    def __init__(self, chunk: int = NUMPY_CHUNK):
        self._scratch = np.empty(max(1, min(chunk, CHUNK)), np.float32)
        # The sum of squares goes through BLAS (a compiled loop cannot reorder float sums).
        self._sum_scratch = np.empty(max(1, min(chunk, NUMPY_CHUNK)), np.float32)

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
        _sum_blocks(blocks.view(np.uint16), _encoding(blocks), _FP16_TABLE, self._scratch, out)


def _split(array):
    """``(fp32 array, 16-bit patterns, encoding)``, the unused one empty."""
    kind = _encoding(array)
    if kind == FP32:
        return array, _NO_U16, kind
    return _NO_F32, array.view(np.uint16), kind
