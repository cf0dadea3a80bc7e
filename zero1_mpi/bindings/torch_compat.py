"""What torch code gives and asks of ``zero1_mpi.torch.ZeroOptimizer``, in torch's own terms.

``named_groups``: its ``params`` (a module, named parameters, torch-style param groups) as named
groups. ``torch_options``: a ``torch.optim`` optimizer's arguments that change nothing here
(``foreach``, ``fused``, ``capturable``, ``differentiable=False``, ``amsgrad=False``,
``maximize=False``) dropped, others refused naming the class and the docs' differences.
``push_groups``/``pull_groups``: ``param_groups`` to and from the core, as ``state_dict()``
holds them. ``install_clipping()`` puts into ``torch.nn.utils`` a ``clip_grad_norm_``,
``get_total_norm`` and ``clip_grads_with_norm_`` that give a ZeroOptimizer's global norm on its
parameters (torch's would read each rank's unreduced ``.grad``), and a ``clip_grad_value_`` that
refuses them; other tensors get torch's. Imports torch.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..flat.inputs import group_extras

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
    "named_groups",
    "push_groups",
    "pull_groups",
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

#: torch's clipping functions as torch exports them (``torch.nn.utils.<name>``): wrappers that
#: run their body under ``torch.no_grad()``, and which every reference to them reaches, however
#: early it was bound (``from torch.nn.utils import clip_grad_norm_`` before zero1_mpi).
_WRAPPERS = {
    name: getattr(torch.nn.utils, name)
    for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
}
#: Their bodies (under ``torch.no_grad()``, as torch runs them): what a tensor no ZeroOptimizer
#: holds gets.
_BODIES = {name: getattr(wrapper, "__wrapped__", None) for name, wrapper in _WRAPPERS.items()}
_TORCH = {
    name: torch.no_grad()(body) if body is not None else _WRAPPERS[name]
    for name, body in _BODIES.items()
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
    """Make torch's clipping functions these, whichever name reaches them; idempotent.

    Each of torch's wrappers calls the body it closes over (its ``func`` cell): that body
    becomes this module's function of the same name, so that a name bound before
    ``zero1_mpi.torch`` was imported, ``torch.nn.utils.clip_grad.clip_grad_norm_`` and
    torch's own calls between them all dispatch here. A torch whose wrappers differ gets the
    names replaced in ``torch.nn.utils`` and ``torch.nn.utils.clip_grad`` instead, and a
    warning that names bound earlier are not reached."""
    ours = {
        "clip_grad_norm_": clip_grad_norm_,
        "clip_grad_value_": clip_grad_value_,
        "get_total_norm": get_total_norm,
        "clip_grads_with_norm_": clip_grads_with_norm_,
    }
    for name, wrapper in _WRAPPERS.items():
        cell = _body_cell(name, wrapper)
        if cell is not None:
            cell.cell_contents = ours[name]
            continue
        warnings.warn(
            f"torch {torch.__version__}'s {name} is not the wrapper zero1_mpi knows: only "
            f"torch.nn.utils.{name} looked up after importing zero1_mpi.torch gives the global "
            "norm; call opt.clip_grad_norm_(max_norm) to be sure",
            RuntimeWarning,
            stacklevel=2,
        )
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            setattr(module, name, ours[name])


def _body_cell(name: str, wrapper):
    """The closure cell holding the body torch's wrapper of ``name`` calls (its ``_no_grad``
    wrapper's ``func``, which ``__wrapped__`` names), or None when it has no such cell."""
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not closure or "func" not in code.co_freevars:
        return None
    cell = closure[code.co_freevars.index("func")]
    if cell.cell_contents is not _BODIES[name] and cell.cell_contents.__module__ != __name__:
        return None  # neither torch's body nor ours (installed before): not what we know
    return cell


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


def named_groups(params, module) -> list[dict]:
    """``ZeroOptimizer``'s ``params`` (a module, named parameters, or torch-style param
    groups naming their tensors, or listing them with ``module``) as a list of groups
    ``{"params": {name: parameter}, <options>}``; a TypeError or ValueError with the fix."""
    if isinstance(params, torch.nn.Module):
        return [{"params": {n: p for n, p in params.named_parameters() if p.requires_grad}}]
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params is a single tensor: pass the module, {name: tensor}, or param groups"
        )
    if isinstance(params, Mapping):
        raw = [{"params": params}]
    else:
        params = list(params)
        raw = (
            params
            if params and all(isinstance(g, Mapping) for g in params)
            else [{"params": params}]
        )
    names = None if module is None else {id(p): n for n, p in module.named_parameters()}
    groups: list[dict] = []
    seen: dict[int, str] = {}  # id(parameter) -> its name
    for index, group in enumerate(raw):
        members: Any = group.get("params")  # a mapping, (name, p) pairs or tensors
        if isinstance(members, Mapping):
            members = list(members.items())
        elif isinstance(members, torch.Tensor) or members is None:
            raise TypeError(
                f"param group {index}: 'params' must hold named parameters "
                "({name: p} or (name, p) pairs), or tensors with module="
            )
        named = {}
        for item in members:
            if isinstance(item, torch.Tensor):
                if names is None or id(item) not in names:
                    raise TypeError(
                        f"param group {index} lists a tensor without its name: "
                        "pass {name: p} (e.g. dict(model.named_parameters())), or "
                        "module=model to name it"
                        + ("" if names is None else " (it is not a parameter of that module)")
                    )
                item = (names[id(item)], item)
            name, p = item
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise TypeError(
                    f"parameter {name!r} must be a leaf tensor (an nn.Parameter), "
                    f"got {type(p).__name__}"
                )
            if not p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} does not require grad: leave it out, or "
                    "set requires_grad=True"
                )
            if id(p) in seen:
                raise ValueError(
                    f"the same tensor is given as {seen[id(p)]!r} and {name!r}: "
                    "pass a tied parameter once"
                )
            seen[id(p)] = name
            named[name] = p
        groups.append({**group, "params": named})
    return groups


def push_groups(groups: list, targets: list, rule, strict: bool) -> ValueError | None:
    """torch's ``param_groups`` into the core's ``targets``: the rule's options and the plain
    values beside them (``params.group_extras``), as ``torch.optim``'s ``state_dict()`` holds
    them; a value a checkpoint cannot hold is left out, or with ``strict`` the error."""
    problem = None
    for index, (group, target) in enumerate(zip(groups, targets)):
        target.update({key: group[key] for key in rule.options})
        try:
            extras = group_extras(group, rule, strict)
        except ValueError as exc:
            problem = problem or ValueError(f"param_groups[{index}]: {exc}")
            continue
        for key in [k for k in target if k != "names" and k not in rule.options]:
            del target[key]  # a value removed from torch's group since the last push
        target.update(extras)
    return problem


def pull_groups(groups: list, sources: list) -> None:
    """The core's param-group values (``sources``) into torch's ``groups``; a tensor (an
    ``lr`` a scheduler keeps so) filled in place."""
    for group, source in zip(groups, sources):
        for key, value in source.items():
            if key != "names" and torch.is_tensor(group.get(key)):
                group[key].fill_(value)
            elif key != "names":
                group[key] = value
