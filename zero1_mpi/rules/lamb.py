"""LAMB as an update rule (You et al. 2020): Adam's moments with a per-tensor trust ratio.

Per owned element, in fp32: ``g = grad * grad_scale``; ``m = lerp(m, g, 1 - beta1)``; ``v =
beta2 v + (1 - beta2) g^2``; ``u = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps) +
weight_decay * p`` (the bias corrections applied as host reciprocals, so one division per
element). Per whole tensor: ``r = ||p|| / ||u||`` (1 where either norm is 0), and
``p -= lr * r * u``. State: ``exp_avg`` and ``exp_avg_sq``, as Adam's.

The norms are over whole tensors while tensors straddle shards and buckets, so the rule runs
in two phases (``tensor_sums = 2``, see ``zero1_mpi.rules``): ``kernel.tensor_sums(grad,
master, exp_avg, exp_avg_sq, scalars)`` updates the moments over one piece of one tensor and
returns that piece's ``[sum p^2, sum u^2]``; the engine adds the pieces, sums them over ranks
in one ``Allreduce`` per step, and ``Lamb.tensor_scalars`` turns each tensor's totals into its
step; ``kernel.apply(master, exp_avg, exp_avg_sq, param, scalars)`` then recomputes ``u`` (the
same operations, so the same bits) and moves ``p``. Three twins: NumPy here, Numba in
``kernels_numba`` (the same bits: the same float32 operations, and the sums through the same
BLAS dot products over the same chunks), CuPy here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .. import backend
from ..reductions import NUMPY_CHUNK, CupyReductions
from .options import betas as check_betas
from .options import non_negative


def check_options(lr, betas, eps, weight_decay) -> dict:
    """The four LAMB options as floats, or a ValueError naming the bad one and the fix."""
    return {"lr": non_negative(lr, "lr"), "betas": check_betas(betas, "(0.9, 0.999)"),
            "eps": non_negative(eps, "eps", " (LAMB's usual value is 1e-6)"),
            "weight_decay": non_negative(weight_decay, "weight_decay")}


class Lamb:
    """The rule object the engine drives."""

    name = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    options = ("lr", "betas", "eps", "weight_decay")
    check_options = staticmethod(check_options)
    tensor_sums = 2  # per tensor: sum p^2, sum u^2

    def settings(self) -> dict:
        return {"rule": self.name}

    @staticmethod
    def scalars(step: int, options: dict, grad_scale: float) -> LambScalars:
        beta1, beta2 = options["betas"]
        return LambScalars(grad_scale=float(grad_scale), beta2=beta2,
                           one_minus_beta1=1.0 - beta1, one_minus_beta2=1.0 - beta2,
                           eps=options["eps"], weight_decay=options["weight_decay"],
                           inv_bc1=1.0 / (1.0 - beta1 ** step),
                           inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2 ** step),
                           lr=options["lr"])

    @staticmethod
    def tensor_scalars(s: LambScalars, sums) -> LambScalars:
        """One tensor's step from its totals over ranks ``[sum p^2, sum u^2]``."""
        p_norm, u_norm = math.sqrt(sums[0]), math.sqrt(sums[1])
        ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
        return replace(s, neg_step=-s.lr * ratio)

    @staticmethod
    def kernel(kind: str, largest: int = NUMPY_CHUNK):
        if kind == "cupy":
            return CupyLamb()
        if kind == "numba":
            from ..kernels_numba import NumbaLamb
            return NumbaLamb(largest)
        return NumpyLamb(largest)


@dataclass(frozen=True)
class LambScalars:
    """Host scalars of one step for one parameter group (``neg_step``: for one tensor)."""

    grad_scale: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    inv_bc1: float           # 1 / (1 - beta1^t)
    inv_bc2_sqrt: float      # 1 / sqrt(1 - beta2^t)
    lr: float
    neg_step: float = 0.0    # -lr * trust ratio, set by Lamb.tensor_scalars


class NumpyLamb:
    """The NumPy twin: in place, chunked; scratch is allocated once, never per step.

    ``_direction`` and ``_apply`` do the elementwise work of one chunk; the Numba twin
    replaces only those two, so the chunks, and the dot products over them, are the same.
    """

    def __init__(self, largest: int = NUMPY_CHUNK):
        self.chunk = max(1, min(NUMPY_CHUNK, largest))
        self._g, self._t, self._u = (np.empty(self.chunk, np.float32) for _ in range(3))

    @property
    def scratch_bytes(self) -> int:
        return 3 * self._u.nbytes

    def tensor_sums(self, grad, master, exp_avg, exp_avg_sq, s: LambScalars) -> np.ndarray:
        """Update the moments over one piece of one tensor; its ``[sum p^2, sum u^2]``."""
        p_sq = u_sq = 0.0
        for start in range(0, master.size, self.chunk):
            sl = slice(start, min(start + self.chunk, master.size))
            p = master[sl]
            u = self._direction(grad[sl], p, exp_avg[sl], exp_avg_sq[sl], s)
            p_sq += float(np.dot(p, p))
            u_sq += float(np.dot(u, u))
        return np.array([p_sq, u_sq])

    def apply(self, master, exp_avg, exp_avg_sq, param, s: LambScalars) -> None:
        """``p -= lr * ratio * u`` over one piece of one tensor (``s.neg_step`` set)."""
        for start in range(0, master.size, self.chunk):
            sl = slice(start, min(start + self.chunk, master.size))
            self._apply(master[sl], exp_avg[sl], exp_avg_sq[sl],
                        None if param is None else param[sl], s)

    def _direction(self, grad, p, m, v, s: LambScalars):
        g, t = self._g[:p.size], self._t[:p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # mean gradient, in fp32
        np.subtract(g, m, out=t)                                   # m = lerp(m, g, 1 - beta1)
        t *= s.one_minus_beta1
        m += t
        v *= s.beta2                                               # v = beta2 v + (1-beta2) g^2
        np.multiply(g, g, out=t)
        t *= s.one_minus_beta2
        v += t
        return self._update_direction(p, m, v, s)

    def _update_direction(self, p, m, v, s: LambScalars):
        """``u`` from the current moments: ``m inv_bc1 / (sqrt(v) inv_bc2_sqrt + eps) + wd p``
        (the bias corrections as reciprocals: one division per element, not three)."""
        t, u = self._t[:p.size], self._u[:p.size]
        np.sqrt(v, out=t)
        t *= s.inv_bc2_sqrt
        t += s.eps
        np.multiply(m, s.inv_bc1, out=u)
        u /= t
        if s.weight_decay:
            np.multiply(p, s.weight_decay, out=t)
            u += t
        return u

    def _apply(self, p, m, v, param, s: LambScalars) -> None:
        u = self._update_direction(p, m, v, s)
        u *= s.neg_step                                            # p -= lr r u
        p += u
        if param is not None:
            np.copyto(param, p, casting="unsafe")                  # round to the 16-bit dtype


# The CuPy twin: the moments in one kernel, u^2 summed by a reduction that recomputes u, and
# the update in a second elementwise kernel; all three share this device function.
_CUDA_DIRECTION = r"""
__device__ float zero1_lamb_u(float m, float v, float p, float inv_bc1, float inv_bc2_sqrt,
                              float eps, float weight_decay) {
    float denom = sqrtf(v) * inv_bc2_sqrt + eps;
    return (m * inv_bc1) / denom + p * weight_decay;
}
__device__ double zero1_lamb_u_sq(float m, float v, float p, float inv_bc1, float inv_bc2_sqrt,
                                  float eps, float weight_decay) {
    double u = zero1_lamb_u(m, v, p, inv_bc1, inv_bc2_sqrt, eps, weight_decay);
    return u * u;
}
"""
_CUDA_SCALARS = "float32 inv_bc1, float32 inv_bc2_sqrt, float32 eps, float32 weight_decay"
_cuda_kernels: dict[str, object] = {}


def _cuda_kernel(kind: str):
    if kind not in _cuda_kernels:
        cupy = backend.xp_for("cupy")
        if kind == "moments":
            kernel = cupy.ElementwiseKernel(
                "G grad, float32 grad_scale, float32 beta2, float32 one_minus_beta1, "
                "float32 one_minus_beta2", "float32 exp_avg, float32 exp_avg_sq",
                r"""float g = (float)grad * grad_scale;
                exp_avg = exp_avg + (g - exp_avg) * one_minus_beta1;
                exp_avg_sq = exp_avg_sq * beta2 + (g * g) * one_minus_beta2;""",
                "zero1_lamb_moments")
        elif kind == "u_sq":
            kernel = cupy.ReductionKernel(
                "float32 exp_avg, float32 exp_avg_sq, float32 p, " + _CUDA_SCALARS,
                "float64 total",
                "zero1_lamb_u_sq(exp_avg, exp_avg_sq, p, inv_bc1, inv_bc2_sqrt, eps, "
                "weight_decay)", "a + b", "total = a", "0", "zero1_lamb_u_sq",
                preamble=_CUDA_DIRECTION)
        else:
            mixed = kind == "mixed"
            update = r"""float p = PARAM;
                p += zero1_lamb_u(exp_avg, exp_avg_sq, p, inv_bc1, inv_bc2_sqrt, eps,
                                  weight_decay) * neg_step;
                """.replace("PARAM", "master" if mixed else "param")
            body = update + ("master = p; param = (P)p;" if mixed else "param = p;")
            kernel = cupy.ElementwiseKernel(
                "float32 exp_avg, float32 exp_avg_sq, " + _CUDA_SCALARS + ", float32 neg_step",
                "float32 master, P param" if mixed else "float32 param", body,
                f"zero1_lamb_{kind}", preamble=_CUDA_DIRECTION)
        _cuda_kernels[kind] = backend.ExplainedKernel(kernel)
    return _cuda_kernels[kind]


class CupyLamb:
    """The CuPy twin: kernel launches on the current stream; the sums stay on the device."""

    scratch_bytes = 0

    def __init__(self):
        self._reductions = CupyReductions()

    def tensor_sums(self, grad, master, exp_avg, exp_avg_sq, s: LambScalars):
        f = np.float32
        _cuda_kernel("moments")(grad, f(s.grad_scale), f(s.beta2), f(s.one_minus_beta1),
                                f(s.one_minus_beta2), exp_avg, exp_avg_sq)
        u_sq = _cuda_kernel("u_sq")(exp_avg, exp_avg_sq, master, *self._direction_args(s))
        p_sq = self._reductions.sum_of_squares(master)
        return backend.xp_for("cupy").stack([p_sq, u_sq])

    def apply(self, master, exp_avg, exp_avg_sq, param, s: LambScalars) -> None:
        args = (exp_avg, exp_avg_sq, *self._direction_args(s), np.float32(s.neg_step))
        if param is None:
            _cuda_kernel("fp32")(*args, master)
        else:
            _cuda_kernel("mixed")(*args, master, param)

    @staticmethod
    def _direction_args(s: LambScalars):
        return tuple(np.float32(x) for x in (s.inv_bc1, s.inv_bc2_sqrt, s.eps,
                                             s.weight_decay))
