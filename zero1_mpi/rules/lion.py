"""Lion as an update rule (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Per owned element, in fp32: ``g = grad * grad_scale``; ``c = beta1 * m + (1 - beta1) * g``;
``p = p * (1 - lr * weight_decay) - lr * sign(c)``; ``m = beta2 * m + (1 - beta2) * g``. One
state array, ``exp_avg``. The same three twins as Adam's (NumPy here, Numba in
``kernels_numba`` with the same bits, CuPy here), called as ``kernel(grad, master, exp_avg,
param, scalars)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import backend
from ..reductions import NUMPY_CHUNK
from .options import betas as check_betas
from .options import non_negative


def check_options(lr, betas, weight_decay) -> dict:
    """The Lion options as floats, or a ValueError naming the bad one and the fix."""
    return {"lr": non_negative(lr, "lr"), "betas": check_betas(betas, "(0.9, 0.99)"),
            "weight_decay": non_negative(weight_decay, "weight_decay")}


class Lion:
    """The rule object the engine drives."""

    name = "lion"
    state_names = ("exp_avg",)
    options = ("lr", "betas", "weight_decay")
    check_options = staticmethod(check_options)

    def settings(self) -> dict:
        return {"rule": self.name}

    @staticmethod
    def scalars(step: int, options: dict, grad_scale: float) -> LionScalars:
        beta1, beta2 = options["betas"]
        return LionScalars(grad_scale=float(grad_scale), beta1=beta1, one_minus_beta1=1 - beta1,
                           beta2=beta2, one_minus_beta2=1 - beta2,
                           decay=1.0 - options["lr"] * options["weight_decay"],
                           neg_lr=-options["lr"])

    @staticmethod
    def kernel(kind: str, largest: int = NUMPY_CHUNK):
        if kind == "cupy":
            return CupyLion()
        if kind == "numba":
            from ..kernels_numba import NumbaLion
            return NumbaLion(largest)
        return NumpyLion(min(NUMPY_CHUNK, largest))


@dataclass(frozen=True)
class LionScalars:
    """Host scalars of one step for one parameter group."""

    grad_scale: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    decay: float             # 1 - lr * weight_decay
    neg_lr: float


class NumpyLion:
    """The NumPy twin: in place, chunked; scratch is allocated once, never per step."""

    def __init__(self, chunk: int = NUMPY_CHUNK):
        self.chunk = max(1, chunk)
        self._g, self._t, self._u = (np.empty(self.chunk, np.float32) for _ in range(3))

    @property
    def scratch_bytes(self) -> int:
        return 3 * self._g.nbytes

    def __call__(self, grad, master, exp_avg, param, s: LionScalars) -> None:
        for start in range(0, master.size, self.chunk):
            stop = min(start + self.chunk, master.size)
            self._update(grad[start:stop], master[start:stop], exp_avg[start:stop],
                         None if param is None else param[start:stop], s)

    def _update(self, grad, p, m, param, s: LionScalars) -> None:
        g, t, u = self._g[:p.size], self._t[:p.size], self._u[:p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # mean gradient, in fp32
        np.multiply(m, s.beta1, out=t)                             # c = b1 m + (1 - b1) g
        np.multiply(g, s.one_minus_beta1, out=u)
        t += u
        np.sign(t, out=t)
        if s.decay != 1.0:
            p *= s.decay                                           # p *= 1 - lr wd
        t *= s.neg_lr                                              # p -= lr sign(c)
        p += t
        m *= s.beta2                                               # m = b2 m + (1 - b2) g
        np.multiply(g, s.one_minus_beta2, out=t)
        m += t
        if param is not None:
            np.copyto(param, p, casting="unsafe")                  # round to the 16-bit dtype


_CUDA_IN = ("G grad, float32 grad_scale, float32 beta1, float32 one_minus_beta1, "
            "float32 beta2, float32 one_minus_beta2, float32 decay, float32 neg_lr")
_CUDA_MATH = r"""
    float g = (float)grad * grad_scale;                  // mean gradient, in fp32
    float c = exp_avg * beta1 + g * one_minus_beta1;     // c = b1 m + (1 - b1) g
    float sign_c = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign (0 and nan kept)
    p *= decay;                                          // p *= 1 - lr wd
    p += sign_c * neg_lr;                                // p -= lr sign(c)
    exp_avg = exp_avg * beta2 + g * one_minus_beta2;     // m = b2 m + (1 - b2) g
"""
_cuda_kernels: dict[bool, object] = {}


def _cuda_kernel(mixed: bool):
    if mixed not in _cuda_kernels:
        if mixed:
            out = "float32 master, float32 exp_avg, P param"
            body = "float p = master;" + _CUDA_MATH + "    master = p;\n    param = (P)p;\n"
        else:
            out, body = "float32 param, float32 exp_avg", \
                "float p = param;" + _CUDA_MATH + "    param = p;\n"
        name = f"zero1_lion_{'mixed' if mixed else 'fp32'}"
        _cuda_kernels[mixed] = backend.ExplainedKernel(
            backend.xp_for("cupy").ElementwiseKernel(_CUDA_IN, out, body, name))
    return _cuda_kernels[mixed]


class CupyLion:
    """The CuPy twin: one fused kernel launch per shard range, on the current stream."""

    scratch_bytes = 0

    def __call__(self, grad, master, exp_avg, param, s: LionScalars) -> None:
        f = np.float32
        args = (grad, f(s.grad_scale), f(s.beta1), f(s.one_minus_beta1), f(s.beta2),
                f(s.one_minus_beta2), f(s.decay), f(s.neg_lr))
        if param is None:
            _cuda_kernel(False)(*args, master, exp_avg)
        else:
            _cuda_kernel(True)(*args, master, exp_avg, param)
