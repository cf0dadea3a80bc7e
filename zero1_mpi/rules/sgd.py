"""SGD: ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay) on one shard, and
``ZeroSGD``.

Per owned element, in fp32: ``g = grad * grad_scale + weight_decay * p``; with momentum, the
buffer is ``g`` itself on the first step and ``momentum * b + (1 - dampening) * g`` after, and
the step direction is ``g + momentum * b`` (Nesterov) or ``b``; then ``p -= lr * direction``.
The only state array, ``momentum_buffer``, exists only when some param group has a non-zero
momentum at construction (``SGD(momentum_buffer=...)``); without it a group's momentum must
stay 0. Twins: ``NumpySGD``, ``NumbaSGD`` (the same bits), ``CupySGD``; called as
``kernel(grad, master, [momentum_buffer,] param, scalars)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine import ShardedOptimizer, with_engine_options
from ..kernels.cuda_generated import GeneratedCudaKernel
from ..kernels.local_sums import NUMPY_CHUNK
from ..kernels.numba_forms import NO_STATE, master_form, state_form
from ..kernels.numba_generated import GeneratedKernel
from ..kernels.numba_shared import jit
from .options import non_negative
from .protocol import Rule

__all__ = ["SGD", "SGDScalars", "NumpySGD", "NumbaSGD", "CupySGD", "ZeroSGD"]


class SGD(Rule):
    """The rule (``momentum_buffer``: whether the state array exists)."""

    name = "sgd"
    options = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(self, momentum_buffer: bool):
        self.momentum_buffer = momentum_buffer
        self.state_names = ("momentum_buffer",) if momentum_buffer else ()

    @classmethod
    def variants(cls) -> tuple[SGD, ...]:
        return cls(True), cls(False)

    def settings(self) -> dict:
        return {"rule": self.name, "momentum_buffer": self.momentum_buffer}

    def check_options(self, lr, momentum, dampening, weight_decay, nesterov) -> dict:
        """The SGD options, normalized, or a ValueError naming the bad one and the fix."""
        lr, momentum = non_negative(lr, "lr"), non_negative(momentum, "momentum")
        dampening = non_negative(dampening, "dampening")
        weight_decay = non_negative(weight_decay, "weight_decay")
        if not isinstance(nesterov, bool):
            raise ValueError(f"nesterov={nesterov!r} must be True or False")
        if nesterov and (momentum == 0 or dampening != 0):
            raise ValueError(
                f"nesterov=True needs momentum > 0 and dampening = 0 (got "
                f"momentum={momentum!r}, dampening={dampening!r}), as in torch"
            )
        if momentum and not self.momentum_buffer:
            raise ValueError(
                f"momentum={momentum!r} needs a momentum buffer, which is only "
                "allocated when a group has a non-zero momentum at construction: "
                "build the optimizer with momentum set"
            )
        return {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }

    @staticmethod
    def scalars(step: int, options: dict, grad_scale: float) -> SGDScalars:
        return SGDScalars(
            grad_scale=float(grad_scale),
            weight_decay=options["weight_decay"],
            momentum=options["momentum"],
            one_minus_dampening=1.0 - options["dampening"],
            nesterov=options["nesterov"],
            neg_lr=-options["lr"],
            first=step == 1,
        )

    def kernel(self, kind: str, largest: int = NUMPY_CHUNK):
        if kind == "cupy":
            return CupySGD(self.momentum_buffer)
        if kind == "numba":
            return NumbaSGD(self.momentum_buffer, largest)
        return NumpySGD(self.momentum_buffer, min(NUMPY_CHUNK, largest))


@dataclass(frozen=True)
class SGDScalars:
    """Host scalars of one step for one parameter group."""

    grad_scale: float
    weight_decay: float
    momentum: float  # 0: no buffer is used this step
    one_minus_dampening: float
    nesterov: bool
    neg_lr: float
    first: bool  # the buffer starts as the gradient itself (torch)


def split_args(has_buffer: bool, rest):
    """``(buffer or None, param, scalars)`` from the kernel's arguments after ``master``."""
    return (rest[0], rest[1], rest[2]) if has_buffer else (None, rest[0], rest[1])


# -- the NumPy twin ------------------------------------------------------------------------------


class NumpySGD:
    """In place, chunked; scratch is allocated once, never per step."""

    def __init__(self, has_buffer: bool, chunk: int = NUMPY_CHUNK):
        self.has_buffer = has_buffer
        self.chunk = max(1, chunk)
        self._g = np.empty(self.chunk, np.float32)
        self._t = np.empty(self.chunk, np.float32)

    @property
    def scratch_bytes(self) -> int:
        return self._g.nbytes + self._t.nbytes

    def __call__(self, grad, master, *rest) -> None:
        buf, param, s = split_args(self.has_buffer, rest)
        for start in range(0, master.size, self.chunk):
            stop = min(start + self.chunk, master.size)
            self._update(
                grad[start:stop],
                master[start:stop],
                None if buf is None else buf[start:stop],
                None if param is None else param[start:stop],
                s,
            )

    def _update(self, grad, p, b, param, s: SGDScalars) -> None:
        g, t = self._g[: p.size], self._t[: p.size]
        np.multiply(grad, s.grad_scale, out=g, dtype=np.float32)  # mean gradient, in fp32
        if s.weight_decay:
            np.multiply(p, s.weight_decay, out=t)  # g += wd * p
            g += t
        if s.momentum:
            if s.first:
                b[...] = g  # b = g on the first step
            else:
                b *= s.momentum  # b = m b + (1 - d) g
                np.multiply(g, s.one_minus_dampening, out=t)
                b += t
            if s.nesterov:
                np.multiply(b, s.momentum, out=t)  # Nesterov: g += m b
                g += t
            else:
                g = b
        np.multiply(g, s.neg_lr, out=t)  # p -= lr g
        p += t
        if param is not None:
            np.copyto(param, p, casting="unsafe")  # round to the 16-bit dtype


# -- the Numba twin: the NumPy twin's float32 operations in its order, on one element ----------


@jit
def _sgd_element(g, p, b, s):
    """One element: fp32 gradient ``g``, master ``p`` and momentum buffer ``b`` in (0 and
    left alone where momentum is 0); the new ``(p, b)``."""
    grad_scale, weight_decay, momentum, omd, nesterov, first, neg_lr = s
    g = g * grad_scale  # mean gradient
    if weight_decay != 0:
        g = g + p * weight_decay  # L2 weight decay
    if momentum != 0:
        if first:
            b = g  # the buffer starts as g
        else:
            b = b * momentum + g * omd  # b = m b + (1 - d) g
        if nesterov:
            g = g + b * momentum  # Nesterov: g + m b
        else:
            g = b
    return p + g * neg_lr, b  # p -= lr g


class NumbaSGD(GeneratedKernel):
    """One generated pass per range (``numba_generated``); the bits of ``NumpySGD``."""

    element = staticmethod(_sgd_element)

    def __init__(self, has_buffer: bool, largest: int = 0):
        super().__init__(largest)
        self.has_buffer = has_buffer

    def __call__(self, grad, master, *rest) -> None:
        buf, param, s = split_args(self.has_buffer, rest)
        states = () if buf is None else (state_form(buf),)
        self.fused(grad, master_form(master), states, param, s)

    def fused(self, grad, master, states, param, s: SGDScalars):
        """``GeneratedKernel.fused``; without a buffer ``states`` is empty (and momentum 0)."""
        self._momentum = np.float32(s.momentum) if states else np.float32(0)
        return super().fused(grad, master, states or (NO_STATE,), param, s)

    def scalars(self, s: SGDScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.weight_decay), self._momentum, f(s.one_minus_dampening),
                bool(s.nesterov), bool(s.first), f(s.neg_lr))  # fmt: skip


# -- the CuPy twin: the same math, one generated kernel per stored form (``cuda_generated``);
# ``first`` and ``nesterov`` are 0/1 flags; momentum 0 leaves the buffer alone ------------------

_CUDA_MATH = r"""
    float g = g_in * grad_scale;                         // mean gradient, in fp32
    g += p * weight_decay;                               // L2 weight decay
    MOMENTUM
    p += g * neg_lr;                                     // p -= lr g
"""
_CUDA_MOMENTUM = r"""if (momentum != 0.0f) {
        float b = first ? g : momentum_buffer * momentum + g * one_minus_dampening;
        momentum_buffer = b;                             // b = g first, m b + (1 - d) g after
        g = nesterov ? g + b * momentum : b;             // Nesterov: g + m b
    }"""


class CupySGD(GeneratedCudaKernel):
    """One fused kernel launch per shard range, queued on the current stream."""

    scalar_params = (
        "float32 grad_scale, float32 weight_decay, float32 momentum, "
        "float32 one_minus_dampening, int32 nesterov, int32 first, float32 neg_lr"
    )

    def __init__(self, has_buffer: bool):
        self.has_buffer = has_buffer
        self.base = "zero1_sgd_{master}" + ("_momentum" if has_buffer else "")
        self.state_names = ("momentum_buffer",) if has_buffer else ()
        self.element = _CUDA_MATH.replace("MOMENTUM", _CUDA_MOMENTUM if has_buffer else "")

    def scalars(self, s: SGDScalars) -> tuple:
        f = np.float32
        return (f(s.grad_scale), f(s.weight_decay), f(s.momentum), f(s.one_minus_dampening),
                np.int32(s.nesterov), np.int32(s.first), f(s.neg_lr))  # fmt: skip


# -- the optimizer -------------------------------------------------------------------------------


@with_engine_options
class ZeroSGD(ShardedOptimizer):
    """SGD (``torch.optim.SGD`` semantics) with its momentum buffer sharded over MPI ranks.

    Args:
        params, comm: as for ``ZeroAdam`` (group options: these five).
        lr, momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``; defaults
            for the groups (settable per group between steps). The momentum buffer (4 bytes
            per parameter / N) exists only when the default or some group has a non-zero
            momentum at construction.
    """

    def __init__(
        self,
        params,
        comm=None,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        **engine,
    ):
        super().__init__(
            params,
            comm,
            SGD(_wants_momentum(params, momentum)),
            {
                "lr": lr,
                "momentum": momentum,
                "dampening": dampening,
                "weight_decay": weight_decay,
                "nesterov": nesterov,
            },
            **engine,
        )


def _wants_momentum(params, momentum) -> bool:
    """Whether the default or any group asks for momentum (bad input is reported later)."""
    groups = params if isinstance(params, (list, tuple)) else []
    values = [momentum] + [g.get("momentum", 0) for g in groups if isinstance(g, dict)]
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0 for v in values)


RULE, OPTIMIZER = SGD, ZeroSGD  # what rules.registry lists
