"""The oracles: each rule's textbook update on whole tensors in float64, one process, unsharded.

Written from the ``torch.optim.Adam`` / ``AdamW`` and ``clip_grad_norm_`` documentation,
independently of ``zero1_mpi``. Param groups are lists of names with their own options.
"""

from __future__ import annotations

import math

import numpy as np


def clipped(grads, max_norm):
    """``(grads in float64, clipped as clip_grad_norm_ does, their norm before clipping)``."""
    grads = {k: np.asarray(g, dtype=np.float64) for k, g in grads.items()}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        grads = {k: g * coef for k, g in grads.items()}
    return grads, norm


class ReferenceAdam:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=False, groups=None, max_grad_norm=None):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups = [{**defaults, **g} for g in (groups or [{"names": list(params)}])]
        self.decoupled, self.max_grad_norm = decoupled, max_grad_norm
        self.t = 0

    def step(self, grads) -> float:
        """One step on ``grads`` (already averaged); returns the norm before clipping."""
        grads, norm = clipped(grads, self.max_grad_norm)
        self.t += 1
        for group in self.groups:
            lr, (b1, b2), eps, wd = (group[k] for k in ("lr", "betas", "eps", "weight_decay"))
            for k in group["names"]:
                p, g = self.params[k], grads[k]
                if wd and not self.decoupled:
                    g = g + wd * p
                if self.decoupled:
                    p *= 1 - lr * wd
                self.m[k] = b1 * self.m[k] + (1 - b1) * g
                self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
                m_hat = self.m[k] / (1 - b1 ** self.t)
                v_hat = self.v[k] / (1 - b2 ** self.t)
                p -= lr * m_hat / (np.sqrt(v_hat) + eps)
        return norm


class ReferenceSGD:
    """``torch.optim.SGD`` in float64 from its documentation: ``g += wd * p``; with momentum,
    ``b = g`` on the first step, ``b = momentum * b + (1 - dampening) * g`` after, and the
    direction ``g + momentum * b`` (Nesterov) or ``b``; ``p -= lr * direction``."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, groups=None, max_grad_norm=None):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.buf = {}
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov}
        self.groups = [{**defaults, **g} for g in (groups or [{"names": list(params)}])]
        self.max_grad_norm = max_grad_norm

    def step(self, grads) -> float:
        grads, norm = clipped(grads, self.max_grad_norm)
        for group in self.groups:
            for k in group["names"]:
                p, g = self.params[k], grads[k]
                if group["weight_decay"]:
                    g = g + group["weight_decay"] * p
                if group["momentum"]:
                    if k not in self.buf:
                        self.buf[k] = g.copy()
                    else:
                        self.buf[k] = group["momentum"] * self.buf[k] \
                            + (1 - group["dampening"]) * g
                    g = g + group["momentum"] * self.buf[k] if group["nesterov"] \
                        else self.buf[k]
                p -= group["lr"] * g
        return norm


class ReferenceLion:
    """Lion (Chen et al. 2023) in float64: ``c = b1 m + (1 - b1) g``; ``p = p (1 - lr wd) -
    lr sign(c)``; ``m = b2 m + (1 - b2) g``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, groups=None,
                 max_grad_norm=None):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self.groups = [{**defaults, **g} for g in (groups or [{"names": list(params)}])]
        self.max_grad_norm = max_grad_norm

    def step(self, grads) -> float:
        grads, norm = clipped(grads, self.max_grad_norm)
        for group in self.groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for k in group["names"]:
                c = b1 * self.m[k] + (1 - b1) * grads[k]
                self.params[k] = self.params[k] * (1 - lr * wd) - lr * np.sign(c)
                self.m[k] = b2 * self.m[k] + (1 - b2) * grads[k]
        return norm


class ReferenceLAMB:
    """LAMB in float64 from the formulas: Adam's moments with bias correction; ``u = m_hat /
    (sqrt(v_hat) + eps) + wd * p``; per tensor ``r = ||p|| / ||u||`` (1 where either norm is
    0); ``p -= lr * r * u``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 groups=None, max_grad_norm=None):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups = [{**defaults, **g} for g in (groups or [{"names": list(params)}])]
        self.max_grad_norm = max_grad_norm
        self.t = 0

    def step(self, grads) -> float:
        grads, norm = clipped(grads, self.max_grad_norm)
        self.t += 1
        for group in self.groups:
            lr, (b1, b2), eps, wd = (group[k] for k in ("lr", "betas", "eps", "weight_decay"))
            for k in group["names"]:
                p, g = self.params[k], grads[k]
                self.m[k] = b1 * self.m[k] + (1 - b1) * g
                self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
                m_hat = self.m[k] / (1 - b1 ** self.t)
                v_hat = self.v[k] / (1 - b2 ** self.t)
                u = m_hat / (np.sqrt(v_hat) + eps) + wd * p
                p_norm, u_norm = np.linalg.norm(p), np.linalg.norm(u)
                ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
                p -= lr * ratio * u
        return norm


class ReferenceSignMomentum:
    """signSGD with momentum, the example rule of docs/update-rules.md (which
    tests/test_rule_registry.py adds to a copy of the package), in float64: ``m = b m + (1 - b)
    g``; ``p -= lr sign(m)``."""

    def __init__(self, params, lr=1e-3, beta=0.9, groups=None, max_grad_norm=None):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.buf = {k: np.zeros_like(v) for k, v in self.params.items()}
        defaults = {"lr": lr, "beta": beta}
        self.groups = [{**defaults, **g} for g in (groups or [{"names": list(params)}])]
        self.max_grad_norm = max_grad_norm

    def step(self, grads) -> float:
        grads, norm = clipped(grads, self.max_grad_norm)
        for group in self.groups:
            for k in group["names"]:
                self.buf[k] = group["beta"] * self.buf[k] + (1 - group["beta"]) * grads[k]
                self.params[k] -= group["lr"] * np.sign(self.buf[k])
        return norm


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """16-bit floats as integers whose difference counts units in the last place."""
    bits = a.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, 0x8000 - bits, bits)


def max_ulp_diff(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in ulps between two 16-bit arrays of the same dtype."""
    if a.size == 0:
        return 0
    return int(np.abs(ordered_bits(a) - ordered_bits(b)).max())


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Relative error in the max norm: max |a - b| / max |b| over the tensor."""
    if a.size == 0:
        return 0.0
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), np.finfo(np.float64).tiny))


def close_to_reference(got, want, dtype) -> tuple[bool, float]:
    """The project's bound, as ``(ok, worst error)``.

    fp32: relative error <= 1e-6 (max norm over the tensor). fp16/bf16: within one unit in the
    last place of the reference rounded to that dtype. One exception: an element much smaller
    than the rest of its tensor has 16-bit ulps finer than what an fp32 master can hold after
    it has moved (its rounding history is absolute), so there the fp32 bound applies instead.
    """
    got, want = np.asarray(got), np.asarray(want, np.float64)
    if np.dtype(dtype) == np.float32:
        err = max_rel_err(got, want)
        return err <= 1e-6, err
    if got.size == 0:
        return True, 0
    ulps = _ulps_off(got, want, dtype)
    worst = int(ulps[~_tiny_and_close(got, want)].max(initial=0))
    return worst <= 1, worst


def within_reference(got, want, dtype) -> np.ndarray:
    """Which elements are within ``close_to_reference``'s bound (a boolean array)."""
    got, want = np.asarray(got), np.asarray(want, np.float64)
    if np.dtype(dtype) == np.float32:
        scale = max(np.abs(want).max(initial=0), np.finfo(np.float64).tiny)
        return np.abs(got.astype(np.float64) - want) <= 1e-6 * scale
    return (_ulps_off(got, want, dtype) <= 1) | _tiny_and_close(got, want)


def _ulps_off(got, want, dtype) -> np.ndarray:
    return np.abs(ordered_bits(got) - ordered_bits(want.astype(np.float32).astype(dtype)))


def _tiny_and_close(got, want) -> np.ndarray:
    """Elements within the fp32 bound of their tensor (16-bit ulps finer than that are moot)."""
    fp32_bound = 1e-6 * np.abs(want).max(initial=0)
    return np.abs(got.astype(np.float64) - want) <= fp32_bound


# -- the 8-bit wire format, modelled in float64 (zero1_mpi.wire's arithmetic written anew) ------
# Each fp32 operation of the format is done in float64 and rounded to fp32: for +, -, * and /
# of fp32 values that is the correctly rounded fp32 result, so the model is exact.


def _f32(a):
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def int8_encode(x, residual=None, block=256):
    """``(scales fp32, q int8, new residual in x's dtype or None)`` of the values ``x``."""
    v = np.asarray(x).astype(np.float64)
    if residual is not None:
        v = _f32(v + np.asarray(residual).astype(np.float64))
    scales, q, res = [], np.zeros(v.size, np.int8), np.zeros(v.size)
    for lo in range(0, v.size, block):
        vb = v[lo : lo + block]
        if not np.isfinite(vb).all():
            scales.append(np.nan)
            continue  # q and the residual stay 0
        scale = float(_f32(np.abs(vb).max() / 127.0))
        scales.append(scale)
        qb = np.zeros(vb.size) if scale == 0 else np.clip(np.rint(_f32(vb / scale)), -127, 127)
        q[lo : lo + block] = qb
        res[lo : lo + block] = _f32(vb - _f32(qb * scale))
    new_residual = None if residual is None else res.astype(np.asarray(residual).dtype)
    return np.array(scales, np.float32), q, new_residual


def int8_decode(scales, q, block=256):
    """The decoded values (fp32-exact, as float64)."""
    return _f32(q.astype(np.float64) * np.repeat(scales.astype(np.float64), block)[: q.size])


def int8_sum(rows, block=256):
    """Rows of ``(scales, q)`` decoded and summed in row order, each sum rounded to fp32."""
    total = int8_decode(*rows[0], block=block)
    for scales, q in rows[1:]:
        total = _f32(total + int8_decode(scales, q, block=block))
    return total.astype(np.float32)


def remainder_encode(master, param):
    """The remainder masters' integer model: for fp32 ``master`` and ``param`` (its bf16
    rounding, ties to even), ``(remainders as int16, sorted positions of the ties)``. In exact
    integers: ``r = bits(master) - bits(param) * 2**16`` (sign-magnitude halves: the two share
    a sign), ``|r| <= 2**15``; ``r = +2**15`` is a tie, kept as ``-2**15`` and by position."""
    m = np.asarray(master, np.float32).view(np.uint32).astype(np.int64)
    p = np.asarray(param).view(np.uint16).astype(np.int64) << 16
    r = m - p
    finite = np.isfinite(np.asarray(master, np.float32))
    assert (np.abs(r[finite]) <= 1 << 15).all(), "param is not the master rounded to nearest"
    ties = np.flatnonzero(r == 1 << 15)
    r[ties] = -(1 << 15)
    return r.astype(np.int16), ties.astype(np.int64)


def _lowbias32(x):
    """The 32-bit hash of ``zero1_mpi.state.encodings`` on exact integers (int64 arrays)."""
    m = (1 << 32) - 1
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def sr_bf16(values, flat, step, array):
    """The bf16 bit patterns (uint16) of fp32 ``values`` rounded stochastically: bits of the
    hash of ``(flat * 0x9E3779B1 + step * 0x85EBCA77 + array * 0xC2B2AE3D) mod 2**32`` (``flat``:
    each value's parameter index) added below the kept half, in exact integers; inf kept, nan
    quieted."""
    u = np.asarray(values, np.float32).view(np.uint32).astype(np.int64)
    seed = (np.asarray(flat, np.int64) * 0x9E3779B1 + step * 0x85EBCA77
            + array * 0xC2B2AE3D) & ((1 << 32) - 1)
    out = (u + (_lowbias32(seed) & 0xFFFF)) >> 16
    magnitude = u & 0x7FFFFFFF
    out = np.where(magnitude == 0x7F800000, u >> 16, out)
    out = np.where(magnitude > 0x7F800000, (u >> 16) | 0x40, out)
    return out.astype(np.uint16)


def int8_state_bounds(codes):
    """The fp32 boundaries between neighbouring codes of a sorted map: their midpoints."""
    c = np.asarray(codes, np.float64)
    return ((c[:-1] + c[1:]) / 2).astype(np.float32)


def int8_state_encode(x, unsigned_map, signed_map, block=256):
    """The 8-bit state's float64 model: ``(codes, scales)`` of fp32 ``x``. Per block: a value
    that is not finite gives the scale nan and codes 0; else the scale is the largest magnitude,
    negated where a value is negative (the signed map); a code is the number of the map's
    midpoints below ``fp32(x / |scale|)`` (0 for a zero block)."""
    x = np.asarray(x, np.float32)
    codes, scales = np.zeros(x.size, np.uint8), []
    for lo in range(0, x.size, block):
        v = x[lo : lo + block].astype(np.float64)
        if not np.isfinite(v).all():
            scales.append(np.nan)
            continue
        amax, unsigned = float(np.max(np.abs(v))), bool(np.min(v) >= 0)
        scales.append(amax if unsigned else -amax)
        if amax == 0:
            continue
        bounds = int8_state_bounds(unsigned_map if unsigned else signed_map).astype(np.float64)
        normal = (v / amax).astype(np.float32).astype(np.float64)
        codes[lo : lo + block] = (bounds[None, :] < normal[:, None]).sum(axis=1)
    return codes, np.array(scales, np.float32)


def int8_state_decode(codes, scales, unsigned_map, signed_map, block=256):
    """fp32 values of ``codes`` and ``scales`` (``int8_state_encode``'s): the map's value times
    the scale's magnitude, rounded once to fp32."""
    out = np.zeros(len(codes), np.float32)
    for b, s in enumerate(np.asarray(scales, np.float32)):
        table = np.asarray(signed_map if np.signbit(s) else unsigned_map, np.float64)
        lo = b * block
        out[lo : lo + block] = (table[codes[lo : lo + block]] * abs(float(s))).astype(np.float32)
    return out
