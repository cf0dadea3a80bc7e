"""Adam and AdamW as an update rule: ``torch.optim.Adam`` / ``AdamW`` on one shard.

The rule (see ``zero1_mpi.rules``) keeps ``exp_avg`` and ``exp_avg_sq``; its param-group
options are ``lr``, ``betas``, ``eps`` and ``weight_decay``; bias corrections and the other
step-dependent factors are host scalars computed once per step (``AdamScalars.for_step``).
Its fused update has three twins, called as ``kernel(grad, master, exp_avg, exp_avg_sq, param,
scalars)``: the NumPy one here (in place, chunked), the Numba one in ``kernels_numba`` (the same
bits) and a CuPy ``ElementwiseKernel`` here. Each takes the gradient in any supported dtype (it
is multiplied by ``grad_scale`` first, which turns a sum over ranks into a mean), updates the
fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` in place, and writes the new value, rounded to
the parameter dtype, into ``param`` when the parameters are 16-bit. For fp32 parameters
``master`` *is* the parameter shard and ``param`` is None. Eps is outside the square root; weight
decay is L2 (Adam) or decoupled (AdamW).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..reductions import NUMPY_CHUNK
from .options import betas as check_betas
from .options import non_negative


def check_options(lr, betas, eps, weight_decay) -> dict:
    """The four Adam options as floats, or a ValueError naming the bad one."""
    return {"lr": non_negative(lr, "lr"), "betas": check_betas(betas, "(0.9, 0.999)"),
            "eps": non_negative(eps, "eps", " (torch's default is 1e-8)"),
            "weight_decay": non_negative(weight_decay, "weight_decay")}


class Adam:
    """The rule object the engine drives (``decoupled``: AdamW's weight decay)."""

    name = "adam"
    state_names = ("exp_avg", "exp_avg_sq")
    options = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, decoupled: bool):
        self.decoupled = decoupled

    def settings(self) -> dict:
        """What every rank's rule must share, beside the param groups' options (checked)."""
        if not isinstance(self.decoupled, bool):
            raise TypeError(f"decoupled_weight_decay={self.decoupled!r} must be True or False")
        return {"rule": self.name, "decoupled_weight_decay": self.decoupled}

    check_options = staticmethod(check_options)  # the group options, normalized or a ValueError

    def scalars(self, step: int, options: dict, grad_scale: float) -> AdamScalars:
        return AdamScalars.for_step(step, **options, decoupled=self.decoupled,
                                    grad_scale=grad_scale)

    @staticmethod
    def kernel(kind: str, largest: int = NUMPY_CHUNK):
        """The fused update for ``kind`` (``"cupy"``, ``"numba"`` or ``"numpy"``); ``largest``
        is the most elements one call will see (it caps the CPU scratch)."""
        if kind == "cupy":
            return CupyAdam()
        if kind == "numba":
            from ..kernels_numba import NumbaAdam
            return NumbaAdam(largest)
        return NumpyAdam(min(NUMPY_CHUNK, largest))


@dataclass(frozen=True)
class AdamScalars:
    """Host scalars of one step for one parameter group."""

    grad_scale: float      # multiplies the incoming gradient (1/world_size for a mean)
    beta1: float
    beta2: float
    one_minus_beta1: float  # computed on the host in double, as torch does
    one_minus_beta2: float
    eps: float
    l2: float              # Adam: weight_decay added to the gradient as weight_decay * p
    decay: float           # AdamW: p *= decay, with decay = 1 - lr * weight_decay
    step_size: float       # lr / (1 - beta1**step)
    bc2_sqrt: float        # sqrt(1 - beta2**step)

    @classmethod
    def for_step(cls, step: int, *, lr, betas, eps, weight_decay, decoupled, grad_scale=1.0):
        beta1, beta2 = betas
        return cls(grad_scale=float(grad_scale), beta1=float(beta1), beta2=float(beta2),
                   one_minus_beta1=1.0 - beta1, one_minus_beta2=1.0 - beta2, eps=float(eps),
                   l2=0.0 if decoupled else float(weight_decay),
                   decay=1.0 - lr * weight_decay if decoupled else 1.0,
                   step_size=lr / (1.0 - beta1 ** step),
                   bc2_sqrt=math.sqrt(1.0 - beta2 ** step))


class NumpyAdam:
    """The NumPy twin: in place, chunked; scratch is allocated once, never per step."""

    def __init__(self, chunk: int = NUMPY_CHUNK):
        self.chunk = max(1, chunk)
        self._g = np.empty(self.chunk, np.float32)
        self._t = np.empty(self.chunk, np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._g.nbytes + self._t.nbytes

    def __call__(self, grad, master, exp_avg, exp_avg_sq, param, s: AdamScalars) -> None:
        for start in range(0, master.size, self.chunk):
            stop = min(start + self.chunk, master.size)
            self._update(grad[start:stop], master[start:stop], exp_avg[start:stop],
                         exp_avg_sq[start:stop], None if param is None else param[start:stop], s)

    def _update(self, grad, p, m, v, param, s: AdamScalars) -> None:
        g, t = self._g[:p.size], self._t[:p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # g = mean gradient, in fp32
        if s.l2:
            np.multiply(p, s.l2, out=t)                            # Adam: g += wd * p
            g += t
        np.subtract(g, m, out=t)                                   # m = lerp(m, g, 1 - beta1)
        t *= s.one_minus_beta1
        m += t
        v *= s.beta2                                               # v = beta2 v + (1-beta2) g^2
        np.multiply(g, g, out=t)
        t *= s.one_minus_beta2
        v += t
        if s.decay != 1.0:
            p *= s.decay                                           # AdamW: p *= 1 - lr * wd
        np.sqrt(v, out=t)                                          # denom = sqrt(v)/bc2_sqrt + eps
        t /= s.bc2_sqrt
        t += s.eps
        np.divide(m, t, out=t)                                     # p -= step_size * m / denom
        t *= -s.step_size
        p += t
        if param is not None:
            np.copyto(param, p, casting="unsafe")                  # round to the 16-bit dtype


# The CuPy twin. ``grad`` and ``param`` are templated (G, P): float32, float16 or bfloat16.
_CUDA_IN = ("G grad, float32 grad_scale, float32 beta2, float32 one_minus_beta1, "
            "float32 one_minus_beta2, float32 eps, float32 l2, float32 decay, "
            "float32 step_size, float32 bc2_sqrt")
_CUDA_MATH = r"""
    float g = (float)grad * grad_scale;                  // mean gradient, in fp32
    g += l2 * p;                                         // Adam: L2 term (l2 = 0 for AdamW)
    float m = exp_avg + one_minus_beta1 * (g - exp_avg);  // first moment: lerp(m, g, 1 - beta1)
    float v = beta2 * exp_avg_sq + one_minus_beta2 * (g * g);  // second moment
    p *= decay;                                          // AdamW: 1 - lr * wd (1 for Adam)
    float denom = sqrtf(v) / bc2_sqrt + eps;             // bias-corrected sqrt(v), eps outside
    p -= (m / denom) * step_size;                        // step_size = lr / (1 - beta1^t)
    exp_avg = m;
    exp_avg_sq = v;
"""
_CUDA_MIXED = ("float p = master;" + _CUDA_MATH +
               "    master = p;\n    param = (P)p;                    // round to 16 bits\n")
_CUDA_FP32 = "float p = param;" + _CUDA_MATH + "    param = p;\n"
_cuda_kernels: dict[str, object] = {}


def _cuda_kernel(kind: str):
    """The (cached) ElementwiseKernel: ``mixed`` (fp32 master + 16-bit param) or ``fp32``."""
    if kind not in _cuda_kernels:
        cupy = backend.xp_for("cupy")
        if kind == "mixed":
            out, body = "float32 master, float32 exp_avg, float32 exp_avg_sq, P param", _CUDA_MIXED
        else:
            out, body = "float32 param, float32 exp_avg, float32 exp_avg_sq", _CUDA_FP32
        _cuda_kernels[kind] = backend.ExplainedKernel(
            cupy.ElementwiseKernel(_CUDA_IN, out, body, f"zero1_adam_{kind}"))
    return _cuda_kernels[kind]


class CupyAdam:
    """The CuPy twin: one fused kernel launch per shard range, queued on the current stream."""

    scratch_bytes = 0

    def __call__(self, grad, master, exp_avg, exp_avg_sq, param, s: AdamScalars) -> None:
        scalars = tuple(np.float32(x) for x in (
            s.grad_scale, s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.eps, s.l2, s.decay,
            s.step_size, s.bc2_sqrt))
        args = (grad,) + scalars
        if param is None:
            _cuda_kernel("fp32")(*args, master, exp_avg, exp_avg_sq)
        else:
            _cuda_kernel("mixed")(*args, master, exp_avg, exp_avg_sq, param)
