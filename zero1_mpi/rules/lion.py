"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on one shard, and
``ZeroLion``.

Per owned element, in fp32: ``g = grad * grad_scale``; ``c = beta1 * m + (1 - beta1) * g``;
``p = p * (1 - lr * weight_decay) - lr * sign(c)``; ``m = beta2 * m + (1 - beta2) * g``. One
state array, ``exp_avg``. Twins: ``NumpyLion``, ``NumbaLion`` (the same bits), ``CupyLion``;
called as ``kernel(grad, master, exp_avg, param, scalars)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine import ShardedOptimizer, with_engine_options
from ..kernels.cuda_generated import GeneratedCudaKernel
from ..kernels.local_sums import NUMPY_CHUNK
from ..kernels.numba_generated import GeneratedKernel
from ..kernels.numba_shared import jit
from .options import betas as check_betas
from .options import non_negative
from .protocol import Rule

__all__ = ["Lion", "LionScalars", "NumpyLion", "NumbaLion", "CupyLion", "ZeroLion"]


class Lion(Rule):
    """The rule."""

    name = "lion"
    state_names = ("exp_avg",)
    options = ("lr", "betas", "weight_decay")

    @staticmethod
    def check_options(lr, betas, weight_decay) -> dict:
        """The Lion options as floats, or a ValueError naming the bad one and the fix."""
        return {
            "lr": non_negative(lr, "lr"),
            "betas": check_betas(betas, "(0.9, 0.99)"),
            "weight_decay": non_negative(weight_decay, "weight_decay"),
        }

    @staticmethod
    def scalars(step: int, options: dict, grad_scale: float) -> LionScalars:
        beta1, beta2 = options["betas"]
        return LionScalars(
            grad_scale=float(grad_scale),
            beta1=beta1,
            one_minus_beta1=1 - beta1,
            beta2=beta2,
            one_minus_beta2=1 - beta2,
            decay=1.0 - options["lr"] * options["weight_decay"],
            neg_lr=-options["lr"],
        )

    @staticmethod
    def kernel(kind: str, largest: int = NUMPY_CHUNK):
        if kind == "cupy":
            return CupyLion()
        if kind == "numba":
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
    decay: float  # 1 - lr * weight_decay
    neg_lr: float


# -- the NumPy twin ------------------------------------------------------------------------------


class NumpyLion:
    """In place, chunked; scratch is allocated once, never per step."""

    def __init__(self, chunk: int = NUMPY_CHUNK):
        self.chunk = max(1, chunk)
        self._g, self._t, self._u = (np.empty(self.chunk, np.float32) for _ in range(3))

    @property
    def scratch_bytes(self) -> int:
        return 3 * self._g.nbytes

    def __call__(self, grad, master, exp_avg, param, s: LionScalars) -> None:
        for start in range(0, master.size, self.chunk):
            stop = min(start + self.chunk, master.size)
            self._update(
                grad[start:stop],
                master[start:stop],
                exp_avg[start:stop],
                None if param is None else param[start:stop],
                s,
            )

    def _update(self, grad, p, m, param, s: LionScalars) -> None:
        g, t, u = self._g[: p.size], self._t[: p.size], self._u[: p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # mean gradient, in fp32
        np.multiply(m, s.beta1, out=t)  # c = b1 m + (1 - b1) g
        np.multiply(g, s.one_minus_beta1, out=u)
        t += u
        np.sign(t, out=t)
        if s.decay != 1.0:
            p *= s.decay  # p *= 1 - lr wd
        t *= s.neg_lr  # p -= lr sign(c)
        p += t
        m *= s.beta2  # m = b2 m + (1 - b2) g
        np.multiply(g, s.one_minus_beta2, out=t)
        m += t
        if param is not None:
            np.copyto(param, p, casting="unsafe")  # round to the 16-bit dtype


# -- the Numba twin: the NumPy twin's float32 operations in its order, on one element ----------


@jit
def _lion_element(g, p, m, s):
    """One element: fp32 gradient ``g``, master ``p`` and moment ``m`` in; the new ``(p, m)``."""
    grad_scale, beta1, omb1, beta2, omb2, decay, neg_lr = s
    g = g * grad_scale  # mean gradient
    c = m * beta1 + g * omb1  # c = b1 m + (1 - b1) g
    if decay != 1:
        p = p * decay  # p *= 1 - lr wd
    return p + np.sign(c) * neg_lr, m * beta2 + g * omb2  # p -= lr sign(c); m = b2 m + (1-b2) g


class NumbaLion(GeneratedKernel):
    """One generated pass per range (``numba_generated``); the bits of ``NumpyLion``."""

    element = staticmethod(_lion_element)

    def scalars(self, s: LionScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.beta1), f(s.one_minus_beta1), f(s.beta2),
                f(s.one_minus_beta2), f(s.decay), f(s.neg_lr))  # fmt: skip


# -- the CuPy twin: the same math, one generated kernel per stored form (``cuda_generated``) -----


class CupyLion(GeneratedCudaKernel):
    """One fused kernel launch per shard range, queued on the current stream."""

    base = "zero1_lion_{master}"
    state_names = ("exp_avg",)
    scalar_params = (
        "float32 grad_scale, float32 beta1, float32 one_minus_beta1, float32 beta2, "
        "float32 one_minus_beta2, float32 decay, float32 neg_lr"
    )
    element = r"""
    float g = g_in * grad_scale;                         // mean gradient, in fp32
    float c = exp_avg * beta1 + g * one_minus_beta1;     // c = b1 m + (1 - b1) g
    float sign_c = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign (0 and nan kept)
    p *= decay;                                          // p *= 1 - lr wd
    p += sign_c * neg_lr;                                // p -= lr sign(c)
    exp_avg = exp_avg * beta2 + g * one_minus_beta2;     // m = b2 m + (1 - b2) g
"""

    def scalars(self, s: LionScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.beta1), f(s.one_minus_beta1), f(s.beta2),
                f(s.one_minus_beta2), f(s.decay), f(s.neg_lr))  # fmt: skip


# -- the optimizer -------------------------------------------------------------------------------


@with_engine_options
class ZeroLion(ShardedOptimizer):
    """Lion with its ``exp_avg`` sharded over MPI ranks.

    Args:
        params, comm: as for ``ZeroAdam`` (group options: these three).
        lr, betas, weight_decay: the groups' defaults.
    """

    def __init__(self, params, comm=None, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **engine):
        super().__init__(
            params, comm, Lion(), {"lr": lr, "betas": betas, "weight_decay": weight_decay}, **engine
        )


RULE, OPTIMIZER = Lion, ZeroLion  # what rules.registry lists
