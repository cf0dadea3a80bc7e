"""Adam and AdamW: ``torch.optim.Adam`` / ``AdamW`` on one shard, and ``ZeroAdam``/``ZeroAdamW``.

State: ``exp_avg``, ``exp_avg_sq``. Per owned element, in fp32: ``g = grad * grad_scale`` (+
``weight_decay * p`` for Adam's L2); ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 -
beta2) g^2``; ``p *= 1 - lr wd`` (AdamW); ``p -= lr / (1 - beta1^t) * m / (sqrt(v) /
sqrt(1 - beta2^t) + eps)``, eps outside the square root. Bias corrections are host scalars
(``AdamScalars.for_step``). Twins: ``NumpyAdam``, ``NumbaAdam`` (the same bits), ``CupyAdam``.
"""

from __future__ import annotations

import math
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

__all__ = ["Adam", "AdamScalars", "NumpyAdam", "NumbaAdam", "CupyAdam", "ZeroAdam", "ZeroAdamW"]


class Adam(Rule):
    """The rule (``decoupled``: AdamW's weight decay)."""

    name = "adam"
    state_names = ("exp_avg", "exp_avg_sq")
    options = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, decoupled: bool):
        self.decoupled = decoupled

    @classmethod
    def variants(cls) -> tuple[Adam, ...]:
        """AdamW, then Adam (their kernels are the same; their scalars differ)."""
        return cls(True), cls(False)

    def settings(self) -> dict:
        if not isinstance(self.decoupled, bool):
            raise TypeError(f"decoupled_weight_decay={self.decoupled!r} must be True or False")
        return {"rule": self.name, "decoupled_weight_decay": self.decoupled}

    @staticmethod
    def check_options(lr, betas, eps, weight_decay) -> dict:
        """The four Adam options as floats, or a ValueError naming the bad one."""
        return {
            "lr": non_negative(lr, "lr"),
            "betas": check_betas(betas, "(0.9, 0.999)"),
            "eps": non_negative(eps, "eps", " (torch's default is 1e-8)"),
            "weight_decay": non_negative(weight_decay, "weight_decay"),
        }

    def scalars(self, step: int, options: dict, grad_scale: float) -> AdamScalars:
        return AdamScalars.for_step(
            step, **options, decoupled=self.decoupled, grad_scale=grad_scale
        )

    def kernel(self, kind: str, largest: int = NUMPY_CHUNK):
        if kind == "cupy":
            return CupyAdam()
        if kind == "numba":
            return NumbaAdam(largest)
        return NumpyAdam(min(NUMPY_CHUNK, largest))


@dataclass(frozen=True)
class AdamScalars:
    """Host scalars of one step for one parameter group."""

    grad_scale: float  # multiplies the incoming gradient (1/world_size for a mean)
    beta1: float
    beta2: float
    one_minus_beta1: float  # computed on the host in double, as torch does
    one_minus_beta2: float
    eps: float
    l2: float  # Adam: weight_decay added to the gradient as weight_decay * p
    decay: float  # AdamW: p *= decay, with decay = 1 - lr * weight_decay
    step_size: float  # lr / (1 - beta1**step)
    bc2_sqrt: float  # sqrt(1 - beta2**step)

    @classmethod
    def for_step(cls, step: int, *, lr, betas, eps, weight_decay, decoupled, grad_scale=1.0):
        beta1, beta2 = betas
        return cls(
            grad_scale=float(grad_scale),
            beta1=float(beta1),
            beta2=float(beta2),
            one_minus_beta1=1.0 - beta1,
            one_minus_beta2=1.0 - beta2,
            eps=float(eps),
            l2=0.0 if decoupled else float(weight_decay),
            decay=1.0 - lr * weight_decay if decoupled else 1.0,
            step_size=lr / (1.0 - beta1**step),
            bc2_sqrt=math.sqrt(1.0 - beta2**step),
        )


# -- the NumPy twin ------------------------------------------------------------------------------


class NumpyAdam:
    """In place, chunked; scratch is allocated once, never per step."""

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
            self._update(
                grad[start:stop],
                master[start:stop],
                exp_avg[start:stop],
                exp_avg_sq[start:stop],
                None if param is None else param[start:stop],
                s,
            )

    def _update(self, grad, p, m, v, param, s: AdamScalars) -> None:
        g, t = self._g[: p.size], self._t[: p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # g = mean gradient, in fp32
        if s.l2:
            np.multiply(p, s.l2, out=t)  # Adam: g += wd * p
            g += t
        np.subtract(g, m, out=t)  # m = lerp(m, g, 1 - beta1)
        t *= s.one_minus_beta1
        m += t
        v *= s.beta2  # v = beta2 v + (1-beta2) g^2
        np.multiply(g, g, out=t)
        t *= s.one_minus_beta2
        v += t
        if s.decay != 1.0:
            p *= s.decay  # AdamW: p *= 1 - lr * wd
        np.sqrt(v, out=t)  # denom = sqrt(v)/bc2_sqrt + eps
        t /= s.bc2_sqrt
        t += s.eps
        np.divide(m, t, out=t)  # p -= step_size * m / denom
        t *= -s.step_size
        p += t
        if param is not None:
            np.copyto(param, p, casting="unsafe")  # round to the 16-bit dtype


# -- the Numba twin: the NumPy twin's float32 operations in its order, on one element ----------


@jit
def _adam_element(g, p, m, v, s):
    """One element: fp32 gradient ``g``, master ``p`` and state in; the new ``(p, m, v)``."""
    grad_scale, beta2, omb1, omb2, eps, l2, decay, neg_step, bc2_sqrt = s
    g = g * grad_scale  # mean gradient
    if l2 != 0:
        g = g + p * l2  # Adam: L2 term
    m = m + (g - m) * omb1  # m = lerp(m, g, 1 - beta1)
    v = v * beta2 + (g * g) * omb2  # v = beta2 v + (1 - beta2) g^2
    if decay != 1:
        p = p * decay  # AdamW: p *= 1 - lr wd
    denom = np.sqrt(v) / bc2_sqrt + eps  # bias-corrected sqrt(v) + eps
    return p + (m / denom) * neg_step, m, v  # p -= lr / (1 - beta1^t) m / denom


class NumbaAdam(GeneratedKernel):
    """One generated pass per range (``numba_generated``); the bits of ``NumpyAdam``."""

    element = staticmethod(_adam_element)

    def scalars(self, s: AdamScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.beta2), f(s.one_minus_beta1), f(s.one_minus_beta2),
                f(s.eps), f(s.l2), f(s.decay), f(-s.step_size), f(s.bc2_sqrt))  # fmt: skip


# -- the CuPy twin: the same math, one generated kernel per stored form (``cuda_generated``) -----


class CupyAdam(GeneratedCudaKernel):
    """One fused kernel launch per shard range, queued on the current stream."""

    base = "zero1_adam_{master}"
    state_names = ("exp_avg", "exp_avg_sq")
    scalar_params = (
        "float32 grad_scale, float32 beta2, float32 one_minus_beta1, float32 one_minus_beta2, "
        "float32 eps, float32 l2, float32 decay, float32 step_size, float32 bc2_sqrt"
    )
    element = r"""
    float g = g_in * grad_scale;                         // mean gradient, in fp32
    g += l2 * p;                                         // Adam: L2 term (l2 = 0 for AdamW)
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg);  // first moment: lerp(m, g, 1 - beta1)
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * (g * g);  // second moment
    p *= decay;                                          // AdamW: 1 - lr * wd (1 for Adam)
    float denom = sqrtf(exp_avg_sq) / bc2_sqrt + eps;    // bias-corrected sqrt(v), eps outside
    p -= (exp_avg / denom) * step_size;                  // step_size = lr / (1 - beta1^t)
"""

    def scalars(self, s: AdamScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.beta2), f(s.one_minus_beta1), f(s.one_minus_beta2),
                f(s.eps), f(s.l2), f(s.decay), f(s.step_size), f(s.bc2_sqrt))  # fmt: skip


# -- the optimizers ------------------------------------------------------------------------------


@with_engine_options
class ZeroAdam(ShardedOptimizer):
    """Adam (``torch.optim.Adam`` semantics) with its state sharded over MPI ranks.

    Args:
        params: a mapping name -> NumPy or CuPy array, or param groups with ``lr``,
            ``betas``, ``eps``, ``weight_decay`` (see ``ShardedOptimizer``).
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None) or a
            ``Communicator``.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``; defaults for the groups.
        decoupled_weight_decay: AdamW's decay (``p *= 1 - lr * wd``) instead of L2.
    """

    def __init__(
        self,
        params,
        comm=None,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        decoupled_weight_decay=False,
        **engine,
    ):
        super().__init__(
            params,
            comm,
            Adam(decoupled_weight_decay),
            {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
            **engine,
        )

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.rule.decoupled


@with_engine_options
class ZeroAdamW(ZeroAdam):
    """AdamW (``torch.optim.AdamW`` semantics): ``ZeroAdam`` with decoupled weight decay."""

    def __init__(
        self,
        params,
        comm=None,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        decoupled_weight_decay=True,
        **engine,
    ):
        super().__init__(
            params,
            comm,
            lr,
            betas,
            eps,
            weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            **engine,
        )


RULE, OPTIMIZER = Adam, ZeroAdam  # what rules.registry lists
