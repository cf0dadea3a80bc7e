"""How ``zero1_mpi.torch.ZeroOptimizer`` binds torch parameters to its buffers, apart from the
binding itself: tensors and arrays sharing memory (``as_array``, ``as_tensor``), the checks
before it (each parameter bound to no other optimizer, all on one device, CUDA made CuPy's
current one), the autograd and module hooks (weak: a dropped optimizer does not live on in its
model), and the checks at each step (a ``.grad`` set to None or replaced put back; a parameter
that left the buffers found, for the step to raise on every rank)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from .torch_compat import OWNER

__all__ = [
    "Binding",
    "as_array",
    "as_tensor",
    "check_unbound",
    "use_device_of",
    "install_hooks",
    "repair_grads",
    "repair_grad",
    "binding_problem",
]


def as_array(tensor):
    """A NumPy (CPU; bfloat16 through ``ml_dtypes``) or CuPy (CUDA, DLPack) array sharing
    ``tensor``'s memory."""
    tensor = tensor.detach()
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor)
    if tensor.dtype == torch.bfloat16:  # NumPy knows bf16 only through ml_dtypes
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def as_tensor(array):
    """A torch tensor sharing the NumPy or CuPy ``array``'s memory (DLPack for CuPy)."""
    if not isinstance(array, np.ndarray):
        return torch.from_dlpack(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


#: name -> (the parameter, its data pointer, its ``.grad`` view or None, that view's pointer).
Binding = dict[str, tuple[Any, int | None, Any, Any]]


def check_unbound(named: dict) -> None:
    """A ValueError if one of the ``named`` parameters is bound to another live optimizer."""
    for name, p in named.items():
        owner = getattr(p, OWNER, lambda: None)()
        if owner is not None and owner.sharded is not None:
            raise ValueError(
                f"parameter {name!r} is already bound to another ZeroOptimizer: "
                "call its unbind() (or drop it) first"
            )


def use_device_of(named: dict) -> None:
    """Check that the parameters share one device; make a CUDA one CuPy's current device."""
    devices = {p.device for p in named.values()}
    if len(devices) > 1:
        raise ValueError(
            f"the parameters are on several devices {sorted(map(str, devices))}: "
            "move the model to one device before building ZeroOptimizer"
        )
    (device,) = devices
    if device.type == "cuda":
        import cupy

        cupy.cuda.Device(device.index).use()
    elif device.type != "cpu":
        raise ValueError(
            f"parameters on {device}: zero1_mpi keeps them on the CPU (NumPy) or "
            "a CUDA device (CuPy)"
        )


def install_hooks(opt, named: dict, module, overlap: bool, sharded_gradients: bool) -> list:
    """The hooks that tie autograd and ``module`` to ``opt`` (removable handles): each named
    parameter's post-accumulate-grad hook calls ``opt._hand_over`` (``sharded_gradients``) or,
    with ``overlap``, ``opt._grad_ready``; with ``overlap``, the module's forward and
    ``state_dict`` first call ``opt.wait()``."""
    hooks = []
    ref = weakref.ref(opt)
    if overlap or sharded_gradients:
        method = "_hand_over" if sharded_gradients else "_grad_ready"
        for name, p in named.items():
            hooks.append(
                p.register_post_accumulate_grad_hook(lambda p, name=name: _call(ref, method, name))
            )
    if overlap and module is not None:  # (overlap without a module raised in ZeroOptimizer)
        hooks.append(module.register_forward_pre_hook(lambda *_: _call(ref, "wait")))
        if hasattr(module, "register_state_dict_pre_hook"):
            hooks.append(module.register_state_dict_pre_hook(lambda *_, **__: _call(ref, "wait")))
    return hooks


def _call(ref, method: str, *args):
    """Call ``method`` of the optimizer ``ref`` refers to, if it is alive and bound (hooks hold
    no strong reference: a dropped optimizer does not live on in its model)."""
    opt = ref()
    if opt is not None and opt.sharded is not None:
        getattr(opt, method)(*args)


def repair_grads(binding: Binding) -> str | None:
    """``repair_grad`` for each parameter whose ``.grad`` is not its view; the first problem."""
    for name, (p, _, grad, _) in binding.items():
        if p.grad is not grad:
            problem = repair_grad(binding, name)
            if problem:
                return problem
    return None


def repair_grad(binding: Binding, name: str) -> str | None:
    """Put a ``.grad`` that was set to None (``model.zero_grad()``) or replaced back into the
    buffer: its values (zeros for None) go into the view, which becomes ``.grad``."""
    p, _, grad, _ = binding[name]
    if p.grad is None:
        grad.zero_()
    elif p.grad.shape != grad.shape or p.grad.dtype != grad.dtype or p.grad.device != grad.device:
        return (
            f"the .grad of parameter {name!r} was replaced by a {p.grad.dtype} tensor "
            f"of shape {tuple(p.grad.shape)} on {p.grad.device}, unlike the parameter "
            f"({grad.dtype}, {tuple(grad.shape)}, {grad.device}): leave .grad to "
            "autograd and opt.zero_grad()"
        )
    else:
        grad.copy_(p.grad)
    p.grad = grad
    return None


def binding_problem(binding: Binding, module: torch.nn.Module | None) -> str | None:
    """A message if a bound parameter no longer lives in the flat buffers, or ``module`` holds
    a new tensor in its place."""
    for name, (p, data_ptr, grad, grad_ptr) in binding.items():
        if (data_ptr is not None and p.data_ptr() != data_ptr) or (
            grad is not None
            and (p.dtype != grad.dtype or p.device != grad.device or grad.data_ptr() != grad_ptr)
        ):
            return (
                f"parameter {name!r} no longer lives in the optimizer's buffers (it is "
                f"now {p.dtype} on {p.device}: the module was moved with .to(), "
                ".cuda(), .half(), ..., or p.data was replaced, after ZeroOptimizer "
                "bound it), so training would update a copy: move the model first, "
                "then build the optimizer (opt.unbind() and a new ZeroOptimizer to "
                "change device or dtype later)"
            )
    if module is not None:
        current = dict(module.named_parameters())
        for name, (p, _, _, _) in binding.items():
            if name in current and current[name] is not p:
                return (
                    f"parameter {name!r} of the module was replaced by a new tensor "
                    "after ZeroOptimizer bound the old one, which it would go on "
                    "training: assign values in place (with torch.no_grad(): "
                    "p.copy_(...)) or build the optimizer after replacing it"
                )
    return None
