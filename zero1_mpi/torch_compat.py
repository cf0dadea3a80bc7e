"""What torch code asks of ``zero1_mpi.torch.ZeroOptimizer`` in torch's own terms.

``torch_options(cls, options)``: a ``torch.optim`` optimizer's keyword arguments that change
nothing here (``foreach``, ``fused``, ``capturable``, ``differentiable=False``,
``amsgrad=False``, ``maximize=False``) dropped, the others refused naming the argument, the class
and the docs' differences. ``install_clipping()`` (run when ``zero1_mpi.torch`` is imported) puts
into ``torch.nn.utils`` a ``clip_grad_norm_``, ``get_total_norm`` and ``clip_grads_with_norm_``
(what accelerate calls) that on a ZeroOptimizer's parameters or gradients are its global norm
(each rank's ``.grad`` is its own unreduced gradient: torch's would be silently wrong), and a
``clip_grad_value_`` that refuses them; on any other tensors they are torch's. Imports torch.
"""

from __future__ import annotations

import inspect
import math
import weakref

import torch

__all__ = [
    "OWNER",
    "DIFFERENCES",
    "torch_options",
    "install_clipping",
    "BOUND",
    "clip_grad_norm_",
    "clip_grad_value_",
    "get_total_norm",
    "clip_grads_with_norm_",
    "check_norm_type",
    "nonfinite_error",
]

#: The attribute naming a bound parameter's optimizer (a weak reference): binding a parameter
#: to two optimizers would silently split its updates.
OWNER = "_zero1_mpi_owner"

#: The ZeroOptimizers that have parameters bound (whose ``.grad`` ``get_total_norm`` may get).
BOUND: weakref.WeakSet = weakref.WeakSet()

#: Where the docs list what differs from ``torch.optim``.
DIFFERENCES = "docs/pytorch.md#differences-from-torchoptim"

#: torch.optim arguments and the values that change nothing here (any value when None).
_NEUTRAL: dict[str, tuple | None] = {
    "foreach": None,  # torch's implementation choices: one fused kernel runs here
    "fused": None,
    "capturable": None,
    "differentiable": (False,),
    "amsgrad": (False,),
    "maximize": (False,),
}

#: torch.optim arguments whose other values mean another algorithm, and what to use instead.
_INSTEAD = {
    "amsgrad": "AMSGrad is not implemented",
    "maximize": "negate the loss instead",
    "differentiable": "the update runs outside autograd",
}

#: torch's own functions, which ``install_clipping`` replaces.
_TORCH = {
    name: getattr(torch.nn.utils, name)
    for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
}


def torch_options(cls, options: dict) -> dict:
    """``options`` without the torch arguments that change nothing; a TypeError or ValueError
    for an argument ``cls`` (the rule's optimizer class) does not take."""
    accepted = [
        name
        for name, p in inspect.signature(cls).parameters.items()
        if name not in ("params", "comm") and p.kind is not p.VAR_KEYWORD
    ]
    kept = {}
    for name, value in options.items():
        neutral = _NEUTRAL.get(name, ())
        if name in accepted:
            kept[name] = value
        elif neutral is None or (neutral and any(value is v for v in neutral)):
            continue
        elif name in _INSTEAD:
            raise ValueError(
                f"ZeroOptimizer({cls.__name__}): {name}={value!r} is not supported "
                f"({_INSTEAD[name]}); see {DIFFERENCES}"
            )
        else:
            raise TypeError(
                f"ZeroOptimizer({cls.__name__}) got an unexpected argument {name!r}: it takes "
                f"{', '.join(accepted)}, and torch's {', '.join(_NEUTRAL)} where they change "
                f"nothing; see {DIFFERENCES}"
            )
    return kept


def clip_grad_norm_(
    parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``; on the parameters of a ZeroOptimizer (all of them,
    on all ranks) its ``clip_grad_norm_``: the global norm of the gradients averaged over the
    ranks, and the coming ``step()`` clipped to ``max_norm``."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = _owner(params, "clip_grad_norm_")
    if owner is None:
        return _TORCH["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(parameters, clip_value, foreach=None) -> None:
    """``torch.nn.utils.clip_grad_value_``, refused on the parameters of a ZeroOptimizer."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if _owner(params, "clip_grad_value_") is not None:
        raise ValueError(
            "torch.nn.utils.clip_grad_value_ on a ZeroOptimizer's parameters would clip each "
            "rank's own gradient before the ranks average them (DDP clips the average): "
            "zero1_mpi clips by the global norm, opt.clip_grad_norm_(max_norm) or "
            f"max_grad_norm=...; see {DIFFERENCES}"
        )
    return _TORCH["clip_grad_value_"](params, clip_value, foreach)


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.get_total_norm``; given the ``.grad`` of a ZeroOptimizer's parameters
    (all that have one, on all ranks) its global norm (``clip_grad_norm_(None)``: the step's
    reduction done now, nothing clipped yet)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owner = _grads_owner(tensors)
    if owner is None:
        return _TORCH["get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)
    return owner.clip_grad_norm_(None, norm_type, error_if_nonfinite)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``; on a ZeroOptimizer's parameters (all of them,
    on all ranks) the coming ``step()`` clipped to ``max_norm`` by the global norm
    (``total_norm`` is that norm when ``get_total_norm`` gave it, and is not read)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = _owner(params, "clip_grads_with_norm_")
    if owner is None:
        return _TORCH["clip_grads_with_norm_"](params, max_norm, total_norm, foreach)
    owner.clip_grad_norm_(max_norm)
    return None


def install_clipping() -> None:
    """Put this module's clipping functions where torch code finds them (``torch.nn.utils``
    and ``torch.nn.utils.clip_grad``); idempotent."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
        module.get_total_norm = get_total_norm
        module.clip_grads_with_norm_ = clip_grads_with_norm_


def _owner(params: list, function: str):
    """The ZeroOptimizer every one of ``params`` is bound to, None when none is; a ValueError
    when some are and the others are not, or belong to another optimizer."""
    owners = [getattr(p, OWNER, lambda: None)() for p in params]
    bound = {id(o): o for o in owners if o is not None and o.sharded is not None}
    if not bound:
        return None
    (owner, *others) = bound.values()
    if others or None in owners or len({id(p) for p in params}) < len(owner._binding):
        raise ValueError(
            f"torch.nn.utils.{function} was given {len(params)} tensors, of which "
            f"{sum(o is not None for o in owners)} are bound to a ZeroOptimizer that holds "
            f"{len(owner._binding)}{' (and others bound to another)' if others else ''}: its "
            "norm is global over all of its parameters, so pass all of them and nothing else "
            "(model.parameters()), or call opt.clip_grad_norm_(max_norm)"
        )
    return owner


def _grads_owner(tensors: list):
    """The ZeroOptimizer whose parameters' ``.grad`` are ``tensors`` (those that have one),
    None when none of them is; a ValueError when only some are."""
    grads = {id(t) for t in tensors}
    for owner in list(BOUND):
        mine = {id(p.grad) for p, *_ in owner._binding.values() if p.grad is not None}
        if grads & mine:
            if grads != mine:
                raise ValueError(
                    f"torch.nn.utils.get_total_norm was given {len(grads)} tensors, "
                    f"{len(grads & mine)} of them gradients of a ZeroOptimizer's parameters "
                    f"({len(mine)} have one): its norm is global over all of them, so pass "
                    "all of them and nothing else, or call opt.clip_grad_norm_(max_norm)"
                )
            return owner
    return None


def check_norm_type(norm_type) -> str | None:
    """A problem (for the step to raise on every rank) if ``norm_type`` is not 2."""
    try:
        two = float(norm_type) == 2.0
    except (TypeError, ValueError):
        two = False
    if two:
        return None
    return (
        f"clip_grad_norm_(norm_type={norm_type!r}): only the L2 norm (2.0) is computed "
        f"across the ranks; see {DIFFERENCES}"
    )


def nonfinite_error(norm: float) -> RuntimeError | None:
    """torch's error for ``error_if_nonfinite=True``, if ``norm`` is inf or nan."""
    if math.isfinite(norm):
        return None
    return RuntimeError(
        f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({norm}), "
        "so it cannot be clipped. To disable this error and scale the gradients by the "
        "non-finite norm anyway, set `error_if_nonfinite=False`"
    )
