"""LAMB (You et al. 2020): Adam's moments with a per-tensor trust ratio, and ``ZeroLAMB``.

Per owned element, in fp32: ``g = grad * grad_scale``; Adam's ``m`` and ``v``; ``u = (m / (1 -
beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps) + weight_decay * p`` (bias corrections as host
reciprocals). Per whole tensor: ``r = ||p|| / ||u||`` (1 where either norm is 0), ``p -= lr r
u``. State: ``exp_avg``, ``exp_avg_sq``. The norms span tensors that straddle shards, so it is
a two-phase rule (``tensor_sums = 2``): ``tensor_sums`` updates the moments over a piece and
returns its ``[sum p^2, sum u^2]``, the engine sums those per tensor over ranks, and ``apply``
recomputes ``u`` (the same bits) and moves ``p``. Twins: ``NumpyLamb``, ``NumbaLamb`` (the
same bits, the same BLAS dot products over the same chunks), ``CupyLamb``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..engine import ShardedOptimizer, with_engine_options
from ..kernels import backend
from ..kernels.local_sums import NUMPY_CHUNK, CupyReductions
from ..kernels.numba_shared import (
    FP16_TABLE,
    compile_marked,
    fp32_chunk,
    jit,
    param_bits,
    round_params,
    split_grad,
)
from .options import betas as check_betas
from .options import non_negative
from .protocol import Rule

__all__ = ["Lamb", "LambScalars", "NumpyLamb", "NumbaLamb", "CupyLamb", "ZeroLAMB"]


class Lamb(Rule):
    """The rule."""

    name = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    options = ("lr", "betas", "eps", "weight_decay")
    tensor_sums = 2  # per tensor: sum p^2, sum u^2

    @staticmethod
    def check_options(lr, betas, eps, weight_decay) -> dict:
        """The four LAMB options as floats, or a ValueError naming the bad one and the fix."""
        return {
            "lr": non_negative(lr, "lr"),
            "betas": check_betas(betas, "(0.9, 0.999)"),
            "eps": non_negative(eps, "eps", " (LAMB's usual value is 1e-6)"),
            "weight_decay": non_negative(weight_decay, "weight_decay"),
        }

    @staticmethod
    def scalars(step: int, options: dict, grad_scale: float) -> LambScalars:
        beta1, beta2 = options["betas"]
        return LambScalars(
            grad_scale=float(grad_scale),
            beta2=beta2,
            one_minus_beta1=1.0 - beta1,
            one_minus_beta2=1.0 - beta2,
            eps=options["eps"],
            weight_decay=options["weight_decay"],
            inv_bc1=1.0 / (1.0 - beta1**step),
            inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
            lr=options["lr"],
        )

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
    inv_bc1: float  # 1 / (1 - beta1^t)
    inv_bc2_sqrt: float  # 1 / sqrt(1 - beta2^t)
    lr: float
    neg_step: float = 0.0  # -lr * trust ratio, set by Lamb.tensor_scalars


# -- the NumPy twin ------------------------------------------------------------------------------


class NumpyLamb:
    """In place, chunked; scratch is allocated once, never per step.

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
            self._apply(
                master[sl], exp_avg[sl], exp_avg_sq[sl], None if param is None else param[sl], s
            )

    def _direction(self, grad, p, m, v, s: LambScalars):
        g, t = self._g[: p.size], self._t[: p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # mean gradient, in fp32
        np.subtract(g, m, out=t)  # m = lerp(m, g, 1 - beta1)
        t *= s.one_minus_beta1
        m += t
        v *= s.beta2  # v = beta2 v + (1-beta2) g^2
        np.multiply(g, g, out=t)
        t *= s.one_minus_beta2
        v += t
        return self._update_direction(p, m, v, s)

    def _update_direction(self, p, m, v, s: LambScalars):
        """``u`` from the current moments: ``m inv_bc1 / (sqrt(v) inv_bc2_sqrt + eps) + wd p``
        (the bias corrections as reciprocals: one division per element, not three)."""
        t, u = self._t[: p.size], self._u[: p.size]
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
        u *= s.neg_step  # p -= lr r u
        p += u
        if param is not None:
            np.copyto(param, p, casting="unsafe")  # round to the 16-bit dtype


# -- the Numba twin: the NumPy twin's chunks, dot products and float32 operations ---------------


@jit(inline="never")
def _numba_direction(
    grad, p, m, v, u, grad_scale, beta2, omb1, omb2, inv_bc1, inv_bc2_sqrt, eps, weight_decay
):
    """The moments and ``u = m inv_bc1 / (sqrt(v) inv_bc2_sqrt + eps) + wd p`` over one
    chunk: ``NumpyLamb._direction``'s operations in its order."""
    for i in range(p.size):
        g = grad[i] * grad_scale  # mean gradient
        mi = m[i]
        mi = mi + (g - mi) * omb1  # m = lerp(m, g, 1 - beta1)
        vi = v[i] * beta2 + (g * g) * omb2  # v = beta2 v + (1 - beta2) g^2
        m[i] = mi
        v[i] = vi
        ui = (mi * inv_bc1) / (np.sqrt(vi) * inv_bc2_sqrt + eps)
        if weight_decay != 0:
            ui = ui + p[i] * weight_decay
        u[i] = ui


@jit(inline="never")
def _numba_step(p, m, v, inv_bc1, inv_bc2_sqrt, eps, weight_decay, neg_step):
    """``p -= lr r u`` over one chunk, ``u`` recomputed as ``_numba_direction`` computed it."""
    for i in range(p.size):
        ui = (m[i] * inv_bc1) / (np.sqrt(v[i]) * inv_bc2_sqrt + eps)
        if weight_decay != 0:
            ui = ui + p[i] * weight_decay
        p[i] = p[i] + ui * neg_step


@jit
def _numba_chunk(
    grad32,
    grad16,
    grad_kind,
    table,
    scratch,
    p,
    m,
    v,
    u,
    grad_scale,
    beta2,
    omb1,
    omb2,
    inv_bc1,
    inv_bc2_sqrt,
    eps,
    weight_decay,
):
    grad = fp32_chunk(grad32, grad16, grad_kind, table, scratch, 0, p.size)
    _numba_direction(
        grad, p, m, v, u, grad_scale, beta2, omb1, omb2, inv_bc1, inv_bc2_sqrt, eps, weight_decay
    )


@jit
def _numba_apply(p, m, v, param16, param_kind, inv_bc1, inv_bc2_sqrt, eps, weight_decay, neg_step):
    _numba_step(p, m, v, inv_bc1, inv_bc2_sqrt, eps, weight_decay, neg_step)
    round_params(p, param16, param_kind)


class NumbaLamb(NumpyLamb):
    """``NumpyLamb``'s chunk loop and dot products, with each chunk's elementwise work
    compiled; the same bits."""

    def __init__(self, largest: int = NUMPY_CHUNK):
        compile_marked(globals())
        super().__init__(largest)

    def _direction(self, grad, p, m, v, s):
        f = np.float32
        u = self._u[: p.size]
        _numba_chunk(
            *split_grad(grad),
            FP16_TABLE,
            self._g,
            p,
            m,
            v,
            u,
            f(s.grad_scale),
            f(s.beta2),
            f(s.one_minus_beta1),
            f(s.one_minus_beta2),
            f(s.inv_bc1),
            f(s.inv_bc2_sqrt),
            f(s.eps),
            f(s.weight_decay),
        )
        return u

    def _apply(self, p, m, v, param, s) -> None:
        f = np.float32
        _numba_apply(
            p,
            m,
            v,
            *param_bits(param),
            f(s.inv_bc1),
            f(s.inv_bc2_sqrt),
            f(s.eps),
            f(s.weight_decay),
            f(s.neg_step),
        )


# -- the CuPy twin: the moments in one kernel, u^2 summed by a reduction that recomputes u, and
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
                "float32 one_minus_beta2",
                "float32 exp_avg, float32 exp_avg_sq",
                r"""float g = (float)grad * grad_scale;
                exp_avg = exp_avg + (g - exp_avg) * one_minus_beta1;
                exp_avg_sq = exp_avg_sq * beta2 + (g * g) * one_minus_beta2;""",
                "zero1_lamb_moments",
            )
        elif kind == "u_sq":
            kernel = cupy.ReductionKernel(
                "float32 exp_avg, float32 exp_avg_sq, float32 p, " + _CUDA_SCALARS,
                "float64 total",
                "zero1_lamb_u_sq(exp_avg, exp_avg_sq, p, inv_bc1, inv_bc2_sqrt, eps, weight_decay)",
                "a + b",
                "total = a",
                "0",
                "zero1_lamb_u_sq",
                preamble=_CUDA_DIRECTION,
            )
        else:
            mixed = kind == "mixed"
            update = r"""float p = PARAM;
                p += zero1_lamb_u(exp_avg, exp_avg_sq, p, inv_bc1, inv_bc2_sqrt, eps,
                                  weight_decay) * neg_step;
                """.replace("PARAM", "master" if mixed else "param")
            body = update + ("master = p; param = (P)p;" if mixed else "param = p;")
            kernel = cupy.ElementwiseKernel(
                "float32 exp_avg, float32 exp_avg_sq, " + _CUDA_SCALARS + ", float32 neg_step",
                "float32 master, P param" if mixed else "float32 param",
                body,
                f"zero1_lamb_{kind}",
                preamble=_CUDA_DIRECTION,
            )
        _cuda_kernels[kind] = backend.ExplainedKernel(kernel)
    return _cuda_kernels[kind]


class CupyLamb:
    """Kernel launches on the current stream; the sums stay on the device."""

    scratch_bytes = 0

    def __init__(self):
        self._reductions = CupyReductions()

    def tensor_sums(self, grad, master, exp_avg, exp_avg_sq, s: LambScalars):
        f = np.float32
        _cuda_kernel("moments")(
            grad,
            f(s.grad_scale),
            f(s.beta2),
            f(s.one_minus_beta1),
            f(s.one_minus_beta2),
            exp_avg,
            exp_avg_sq,
        )
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
        return tuple(np.float32(x) for x in (s.inv_bc1, s.inv_bc2_sqrt, s.eps, s.weight_decay))


# -- the optimizer -------------------------------------------------------------------------------


@with_engine_options
class ZeroLAMB(ShardedOptimizer):
    """LAMB with its ``exp_avg`` and ``exp_avg_sq`` sharded over MPI ranks: Adam's
    bias-corrected direction plus ``weight_decay * p``, scaled per tensor by the trust ratio
    ``||p|| / ||u||`` (norms over whole tensors, from the shards with one ``Allreduce`` per
    step).

    Args:
        params, comm: as for ``ZeroAdam`` (group options: these four).
        lr, betas, eps, weight_decay: the groups' defaults.
    """

    def __init__(
        self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, **engine
    ):
        super().__init__(
            params,
            comm,
            Lamb(),
            {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
            **engine,
        )


RULE, OPTIMIZER = Lamb, ZeroLAMB  # what rules.registry lists
