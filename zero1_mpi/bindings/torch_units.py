"""ZeRO stage 3 for torch modules: each unit's parameters gathered while its module runs.

``module_units`` finds the units: each module owning parameters (or each of ``units=``'s
blocks, with all it holds) and ``"(root)"`` for parameters of no unit or of two (tied ones),
gathered from the model's forward to the end of its backward, as FSDP2's parent keeps them.
``UnitHooks``: a module's forward pre-hook gathers its unit, its parameters' ``.data`` pointed at
the working buffer; its forward hook frees it (``.data`` an empty tensor) and hooks the outputs,
whose first gradient gathers it again for the backward; once each of its gradients is handed
over (``handed``), it is freed. The core records the order and prefetches along it;
``state_dict()`` gathers all and gives copies. All ranks run the same modules in one order.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._pytree import tree_flatten

from .torch_binding import as_tensor

__all__ = ["ROOT", "module_units", "plan_units", "UnitHooks", "NoUnits"]

#: The unit of the parameters no other unit holds, and of those two units would share.
ROOT = "(root)"


def plan_units(module, named: dict, options: dict, overlap: bool) -> tuple | None:
    """With ``options["shard_params"]``: ``module_units`` of ``options``' ``units`` (blocks),
    which it replaces by the units' names for the core, and ``reshard_after_forward`` (taken
    out of ``options``); else None."""
    reshard = options.pop("reshard_after_forward", True)
    if not options.get("shard_params"):
        if reshard is not True:
            raise ValueError(
                f"reshard_after_forward={reshard!r} is stage 3's: pass shard_params=True too, "
                "or drop it"
            )
        return None
    if not isinstance(reshard, bool):
        raise ValueError(
            f"reshard_after_forward={reshard!r} must be True (free each unit after its "
            "forward, gather it again for its backward) or False (keep it until its backward)"
        )
    if module is None or overlap:
        raise ValueError(
            "shard_params=True needs the module (its forward gathers each unit) and hands the "
            "gradients over as the backward goes (no overlap=True): pass the nn.Module "
            "itself, or module=model, without overlap"
        )
    units, users = module_units(module, named, options.get("units"))
    options["units"] = units
    return units, users, reshard


def module_units(module, named: dict, blocks=None) -> tuple[dict, dict]:
    """``(units, users)``: unit name -> its parameters' names (``named``: name -> parameter,
    the optimizer's), and module -> the units its forward reads. ``blocks``: the modules that
    are units (each with all it holds), else every module owning a parameter."""
    name_of = {id(p): name for name, p in named.items()}
    modules = dict(module.named_modules())
    chosen = _chosen(modules, blocks)
    owners: dict[str, set] = defaultdict(set)  # parameter name -> the units whose modules hold it
    for qualified, held in modules.items():
        unit = _unit_of(qualified, chosen)
        for p in held._parameters.values():
            if p is not None and id(p) in name_of:
                owners[name_of[id(p)]].add(unit)
    units: dict[str, list] = {}
    for name in named:
        using = owners.get(name, set())
        unit = next(iter(using)) if len(using) == 1 else ROOT
        units.setdefault(unit, []).append(name)
    users = {modules[q]: [q or ROOT] for q in chosen if (q or ROOT) in units}
    if ROOT in units:
        users.setdefault(module, [])
        if ROOT not in users[module]:
            users[module].insert(0, ROOT)
    return units, users


def _unit_of(qualified: str, chosen: list[str]) -> str:
    """The unit of the module ``qualified``: the innermost chosen module holding it (itself
    too), else the root."""
    holding = [q for q in chosen if q == qualified or qualified.startswith(q + ".") or q == ""]
    return max(holding, key=len, default="") or ROOT


def _chosen(modules: dict, blocks) -> list[str]:
    if blocks is None:
        return [q for q, m in modules.items() if any(p is not None for p in m._parameters.values())]
    by_id = {id(m): q for q, m in modules.items()}
    chosen = []
    for block in blocks:
        if id(block) not in by_id:
            raise ValueError(
                f"units: {type(block).__name__} is not a submodule of the model: pass the "
                "modules (blocks) of the model whose parameters are each a unit"
            )
        chosen.append(by_id[id(block)])
    return chosen


class UnitHooks:
    """The hooks that gather, free and hand over the units of ``opt`` (a ``ZeroOptimizer``
    with ``shard_params``) on ``module``; ``units``, ``users`` as ``module_units`` gives;
    ``reshard``: free a unit after its forward (else keep it gathered until its backward)."""

    def __init__(self, opt, module, named: dict, units: dict, users: dict, reshard=True):
        self._ref, self._named, self._units = weakref.ref(opt), named, units
        self._reshard = reshard
        self._gathers = opt.sharded.state.gathers
        self._unit_of = {name: unit for unit, names in units.items() for name in names}
        self._empty: dict = {}  # dtype -> a 0-element tensor: what a freed parameter holds
        self._pending: dict[str, set] = {}  # unit -> names not yet handed in this backward
        self._backward: list[str] = []  # the acquires the backward holds
        self.handles = []
        for owner, unit_names in users.items():
            self.handles.append(owner.register_forward_pre_hook(self._pre_forward(unit_names)))
            self.handles.append(owner.register_forward_hook(self._post_forward(unit_names)))
        # (functions: torch marks the hooks it is given with an attribute)
        self.handles.append(
            module.register_state_dict_pre_hook(lambda *args: self._before_state_dict(*args))
        )
        self.handles.append(
            module.register_state_dict_post_hook(lambda *args: self._after_state_dict(*args))
        )
        for name in named:
            self._free(name)

    # -- gathering and freeing --------------------------------------------------------------

    def acquire(self, unit: str) -> None:
        for name, view in self._gathers.acquire(unit, writable=True).items():
            self._named[name].data = as_tensor(view)

    def release(self, unit: str, free: bool = True) -> None:
        """One user of ``unit`` done; the last frees its parameters (unless ``free`` is False:
        they were given other storage)."""
        self._gathers.release(unit)
        if free and self._gathers.is_open(self._units[unit][0]) is None:
            for name in self._units[unit]:
                self._free(name)

    def _free(self, name: str) -> None:
        p = self._named[name]
        if p.dtype not in self._empty:
            self._empty[p.dtype] = torch.empty(0, dtype=p.dtype, device=p.device)
        p.data = self._empty[p.dtype]

    def _pre_forward(self, unit_names):
        def hook(module, args):
            if self._ref() is not None:
                for unit in unit_names:
                    if unit == ROOT and self._holds_root():
                        continue  # (a second forward before the backward: still gathered)
                    self.acquire(unit)
                    if unit == ROOT:
                        self._backward.append(ROOT)

        return hook

    def _post_forward(self, unit_names):
        def hook(module, args, output):
            if self._ref() is None:
                return
            backward = torch.is_grad_enabled() and _grad_outputs(output)
            for unit in unit_names:
                if unit == ROOT:
                    if not torch.is_grad_enabled():  # no backward will come to free it
                        self._drop_backward(ROOT)
                    continue
                if self._reshard or not backward:
                    self.release(unit)
                else:  # kept gathered for its backward, freed once its gradients are in
                    self._backward.append(unit)
                    self._pending[unit] = set(self._units[unit])
            if backward and self._reshard:
                others = [u for u in unit_names if u != ROOT]
                if others:
                    torch.autograd.graph.register_multi_grad_hook(
                        backward, lambda grads: self._pre_backward(others), mode="any"
                    )

        return hook

    def _pre_backward(self, unit_names) -> None:
        """A unit's outputs got their first gradient: gather it for its backward."""
        for unit in unit_names:
            self.acquire(unit)
            self._backward.append(unit)
            self._pending[unit] = set(self._units[unit])

    def handed(self, name: str) -> None:
        """``name``'s gradient was handed over: its unit is freed once all of them are."""
        unit = self._unit_of[name]
        pending = self._pending.get(unit)
        if pending is None or unit == ROOT:
            return
        pending.discard(name)
        if not pending:
            del self._pending[unit]
            self._drop_backward(unit)

    def end_of_backward(self) -> None:
        """Free what the backward still holds (the root unit, units with unused tensors)."""
        self._pending.clear()
        while self._backward:
            self.release(self._backward.pop())

    def gather_all(self) -> list[str]:
        """Every unit gathered (for a full copy of the parameters); returns them to release."""
        for unit in self._units:
            self.acquire(unit)
        return list(self._units)

    def _holds_root(self) -> bool:
        return ROOT in self._backward

    def _drop_backward(self, unit: str) -> None:
        if unit in self._backward:
            self._backward.remove(unit)
            self.release(unit)

    # -- state_dict: full parameters, copied -------------------------------------------------

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        if self._ref() is not None:
            self._held = self.gather_all()

    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        held, self._held = getattr(self, "_held", []), []
        if not held:
            return
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor):
                state_dict[key] = value.clone()  # (the working buffers are reused)
        for unit in held:
            self.release(unit)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _grad_outputs(output) -> list:
    """The tensors of ``output`` (any nesting) that a backward will reach."""
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class NoUnits:
    """``UnitHooks`` of stages 1 and 2: no unit to gather or free."""

    handles: tuple = ()

    def handed(self, name: str) -> None:
        pass

    def end_of_backward(self) -> None:
        pass

    def gather_all(self) -> list[str]:
        return []

    def release(self, unit: str, free: bool = True) -> None:
        raise RuntimeError(f"release({unit!r}): no units without shard_params")
