"""PyTorch binding: a ``torch.optim.Optimizer`` whose parameters live in zero1_mpi's buffers.

``ZeroOptimizer(model, rule, **options)`` builds the sharded optimizer over a module's (or named)
parameters and rebinds every parameter's ``.data`` and ``.grad`` as views of its flat buffers:
autograd accumulates into the gradient buffer and ``step()`` writes the parameters the model
reads, with no copies. LR schedulers drive it through ``param_groups``. Imported only by torch
users: ``import zero1_mpi`` does not import torch. Construction and ``step()`` must be called
on all ranks; moving the model or replacing a parameter after binding is an error at the next
step on every rank.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, cast

import torch

from .bindings.common import PassThrough, optimizer_class
from .bindings.torch_binding import (
    Binding,
    as_array,
    as_tensor,
    binding_problem,
    check_unbound,
    install_hooks,
    repair_grad,
    repair_grads,
    use_device_of,
)
from .bindings.torch_compat import (
    BOUND,
    OWNER,
    check_norm_type,
    install_clipping,
    named_groups,
    nonfinite_error,
    pull_groups,
    push_groups,
    torch_options,
)
from .bindings.torch_units import NoUnits, UnitHooks, plan_units
from .engine import ShardedOptimizer

__all__ = ["ZeroOptimizer", "as_array", "as_tensor"]

install_clipping()  # torch.nn.utils.clip_grad_norm_ on bound parameters: the global norm

STATE_DICT_HELP = (
    "a sharded optimizer has no single state_dict: each rank holds 1/N of it. "
    "Use opt.save(directory) / opt.load(directory) (sharded, loads at any world "
    "size; all ranks), or opt.save_consolidated(file) / opt.load_consolidated(file)"
    " (the full fp32 state by parameter name in one safetensors file; all ranks)"
)


class ZeroOptimizer(PassThrough, torch.optim.Optimizer):
    """A zero1_mpi sharded optimizer as a ``torch.optim.Optimizer``.

    Build it last, after the model is on its device and in its dtype: from then on every
    parameter and its ``.grad`` are views of the flat buffers of ``opt.sharded`` (the core
    ``ShardedOptimizer``). ``step()`` averages the gradients over the ranks, clips, updates
    this rank's shard, gathers the parameters and zeroes the gradients (they are consumed:
    read the norm from ``opt.last_step.grad_norm``). ``param_groups`` are torch's: an LR
    scheduler's ``lr`` (or any rule option) set there is applied at the next step.

    Args:
        params: an ``nn.Module`` (its parameters that require grad, named as in
            ``named_parameters()``); or named parameters (``{name: p}`` or ``(name, p)``
            pairs); or param groups ``[{"params": {name: p}, "weight_decay": 0.0}, ...]``
            (``zero1_mpi.decay_groups(dict(model.named_parameters()), wd)`` builds them;
            with ``module=``, a group may list the tensors alone).
        rule: the update rule: an optimizer class (``zero1_mpi.ZeroAdamW``, ``ZeroAdam``,
            ``ZeroSGD``, ``ZeroLion``, ``ZeroLAMB`` or your own) or one of the names
            ``"adamw"``, ``"adam"``, ``"sgd"``, ``"lion"``, ``"lamb"``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None).
        overlap: start each bucket's reduction from post-accumulate-grad hooks during
            backward and leave the all-gather in flight until the module's next forward
            (needs the module). Accumulating over micro-batches, run all but the last
            backward inside ``with opt.no_sync():``.
        module: the module whose forward completes the all-gather (``overlap``), whose
            parameters name the tensors of param groups, and which is checked for replaced
            parameters at each step; defaults to ``params`` when that is a module.
        **options: the rule's options (``lr``, ``betas``, ``weight_decay``, ...) and the
            engine's (``max_grad_norm``, ``param_dtype``, ``loss_scale``, ``offload``, ...).
            A ``param_dtype`` other than the model's changes the model's parameters to it.
            ``shard_gradients=True`` (ZeRO stage 2): ``.grad`` is not a view; a hook on each
            parameter hands it over to its bucket and sets it to None (a parameter without a
            gradient in a backward is handed over as zeros when that backward ends), and every
            micro-batch's backward reduces its buckets (``no_sync()`` changes nothing).
            ``shard_params=True`` (stage 3, docs/stage3.md; needs the module): each unit
            (``units=[blocks]``, else each module owning parameters) gathered for its module's
            forward and backward, freed between (``reshard_after_forward=False``: kept).
    """

    def __init__(
        self,
        params,
        rule="adamw",
        comm=None,
        *,
        overlap: bool = False,
        module: torch.nn.Module | None = None,
        **options,
    ):
        if isinstance(params, torch.nn.Module):
            module = params if module is None else module
        groups = named_groups(params, module)
        if overlap and module is None:
            raise ValueError(
                "overlap=True needs the module, whose forward completes the "
                "all-gather: pass the nn.Module itself, or module=model"
            )
        named = {name: p for group in groups for name, p in group["params"].items()}
        check_unbound(named)
        cls = optimizer_class(rule)
        units = plan_units(module, named, options, overlap)  # (stage 3's; options["units"])
        options = torch_options(cls, options)
        use_device_of(named)
        arrays = [
            {**group, "params": {name: as_array(p) for name, p in group["params"].items()}}
            for group in groups
        ]
        sharded = cls(arrays, comm, **options)
        self.sharded, self.overlap, self.module, self._sync = sharded, overlap, module, True
        #: The ``StepInfo`` of the last ``step()`` (None before the first).
        self.last_step = None
        #: Stage 2 (``shard_gradients=True``): each ``.grad`` is handed over and dropped.
        self.sharded_gradients = sharded.grad_shard_dtype is not None
        self._end_queued = False  # the end-of-backward callback (stage 2)
        self._shapes = {name: tuple(p.shape) for name, p in named.items()}
        # name -> (parameter, its data pointer (None: stage 3's moves), its .grad view, pointer)
        self._binding: Binding = {}
        for name, p in named.items():  # from here on the model reads and writes the buffers
            if not sharded.options.shard_params:
                p.data = as_tensor(sharded.params[name])
            grad = None if self.sharded_gradients else as_tensor(sharded.grads[name])
            p.grad = grad
            ptr = None if sharded.options.shard_params else p.data_ptr()
            self._binding[name] = (p, ptr, grad, grad is not None and grad.data_ptr())
            setattr(p, OWNER, weakref.ref(self))
        BOUND.add(self)
        self._hooks = install_hooks(self, named, module, overlap, self.sharded_gradients)
        #: Stage 3's hooks that gather and free each unit (``NoUnits`` in stages 1 and 2).
        self.unit_hooks = NoUnits() if units is None else UnitHooks(self, module, named, *units)
        self._hooks += self.unit_hooks.handles
        rule_options = sharded.rule.options
        self._building = True
        super().__init__(
            [
                {
                    "params": [named[name] for name in group["names"]],
                    **{key: group[key] for key in rule_options},
                }
                for group in sharded.param_groups
            ],
            _defaults(cls, rule_options, options),
        )
        self._building = False

    # -- torch.optim.Optimizer ---------------------------------------------------------------

    def step(self, closure=None):
        """Average the gradients over ranks, clip, update the shard, gather the parameters and
        zero the gradients; all ranks. Returns the closure's loss if one is given (computed
        first, with grad enabled), else the ``StepInfo`` (also kept as ``last_step``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        problem = self._sync_problem()
        self.last_step = self.sharded.step(wait=not self.overlap, problem=problem)
        return self.last_step if closure is None else loss

    def clip_grad_norm_(
        self, max_norm, norm_type=2.0, error_if_nonfinite: bool = False, foreach=None
    ) -> torch.Tensor:
        """Complete this step's gradient reduction now and return the global L2 norm of the
        gradients averaged over the ranks (a 0-d float32 tensor, the same on every rank); the
        coming ``step()`` clips them to ``max_norm`` (None: the norm only), as FSDP's and
        DeepSpeed's ``clip_grad_norm_``, and ``torch.nn.utils.clip_grad_norm_`` on these
        parameters. All ranks, after the step's last backward (a later gradient is an error of
        the step). ``norm_type`` must be 2; ``foreach`` is ignored."""
        problem = check_norm_type(norm_type) or self._sync_problem()
        norm = self.sharded.clip_grad_norm_(max_norm, problem=problem)
        error = nonfinite_error(norm) if error_if_nonfinite else None
        if error is not None:
            raise error
        device = next(iter(self._binding.values()))[0].device
        return torch.tensor(norm, dtype=torch.float32, device=device)

    def reduced_grads(self, *, problem: str | None = None) -> dict:
        """``{name: tensor}`` on every rank: the step's gradients as the coming ``step()`` will
        take them (the mean over the ranks, unscaled, clipped), as DDP's ``.grad`` holds them
        after ``clip_grad_norm_``; for gradient logging. ``.grad`` does not hold them (before
        the reduction it is this rank's own gradient; after it, the reduction's scratch;
        docs/pytorch.md). All ranks, after the step's last
        backward: reduces now, as ``clip_grad_norm_``, and all-gathers (float32 tensors).
        ``problem``: as ``step``'s."""
        found = self._sync_problem()  # (.grad put back, param_groups pushed: always)
        return {
            name: as_tensor(array)
            for name, array in self.sharded.reduced_grads(problem=problem or found).items()
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer (``step()`` leaves it zeroed already). ``set_to_none`` is
        accepted and ignored: the buffer is the gradients' storage, so they stay tensors."""
        self.sharded.zero_grad()
        for p, _, grad, _ in self._binding.values():
            p.grad = grad  # (None with shard_gradients)

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise NotImplementedError(
                "the flat buffers are laid out when ZeroOptimizer is "
                "built: pass every param group to it then"
            )
        super().add_param_group(param_group)

    def state_dict(self):
        raise RuntimeError(f"ZeroOptimizer.state_dict(): {STATE_DICT_HELP}")

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError(f"ZeroOptimizer.load_state_dict(): {STATE_DICT_HELP}")

    # -- zero1_mpi ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """With ``overlap``: backward passes inside only accumulate (no reduction starts), as
        in ``DistributedDataParallel.no_sync``; the last micro-batch's backward, outside,
        starts them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def save(self, path, keep: int | None = None, *, blocking: bool = True):
        """``ShardedOptimizer.save``, with ``param_groups`` as they are now (an LR scheduler's
        ``lr`` for the next step, its ``initial_lr``), as ``torch.optim``'s ``state_dict()``
        holds them; all ranks."""
        self._push_groups()
        return self.sharded.save(path, keep, blocking=blocking)

    def save_consolidated(self, path):
        """``ShardedOptimizer.save_consolidated``, with ``param_groups`` as they are now."""
        self._push_groups()
        return self.sharded.save_consolidated(path)

    def load(self, path):
        """``ShardedOptimizer.load`` into the model's parameters, in place, and the saved
        ``param_groups`` values (``lr``, ``initial_lr``, ...) into ``param_groups``; all
        ranks. Then load an LR scheduler's state as usual (``scheduler.load_state_dict``), or
        build it with ``last_epoch=opt.step_count - 1``."""
        loaded = super().load(path)
        self._pull_options()
        return loaded

    def load_consolidated(self, path):
        """``ShardedOptimizer.load_consolidated``, and the saved ``param_groups`` values into
        ``param_groups``; all ranks."""
        loaded = super().load_consolidated(path)
        self._pull_options()
        return loaded

    def unbind(self) -> None:
        """Give the parameters back: each becomes an independent tensor holding its current
        values (``.grad`` None), the hooks are removed, and this optimizer can no longer
        step. Another ``ZeroOptimizer`` may then bind them. The core's communicators and
        buffers stay until it is collected: ``close()`` unbinds and frees them."""
        self.wait()
        held = self.unit_hooks.gather_all()
        for handle in self._hooks:
            handle.remove()
        for p, _, _, _ in self._binding.values():
            p.data = p.data.clone()
            p.grad = None
            delattr(p, OWNER)
        for unit in held:  # (the parameters hold their copies now)
            self.unit_hooks.release(unit, free=False)
        unbound: Any = None  # no more steps: close() takes the core from _unbound
        self._hooks, self._binding = [], {}
        BOUND.discard(self)
        self._unbound, self.sharded = self.sharded, unbound

    def close(self) -> None:
        """Give the parameters back (``unbind``) and close the core optimizer
        (``ShardedOptimizer.close``: communicators, requests, threads and buffers freed);
        later steps raise naming close(). Idempotent; must be called on all ranks.
        ``with ZeroOptimizer(...) as opt:`` calls it when the block ends."""
        # bound, or unbound (and _unbound holds it)
        sharded = cast(ShardedOptimizer, self.sharded or getattr(self, "_unbound", None))
        if self._binding:
            self.unbind()
        self.sharded = sharded  # closed: its methods raise, naming close()
        sharded.close()

    # -- the binding -------------------------------------------------------------------------

    def _sync_problem(self) -> str | None:
        """Before the step's collectives: ``.grad`` put back into the buffers and
        ``param_groups`` handed to the core (values a checkpoint cannot hold left out: a
        signal's checkpoint goes without them); a problem found, for the step to raise on
        every rank."""
        problem = None if self.sharded_gradients else repair_grads(self._binding)
        self._push_groups(strict=False)
        return problem or binding_problem(self._binding, self.module)

    def _push_groups(self, strict: bool = True) -> None:
        """``push_groups`` to the core; ``strict``: what a checkpoint cannot hold raises on
        every rank (a collective)."""
        problem = push_groups(
            self.param_groups, self.sharded.param_groups, self.sharded.rule, strict
        )
        if strict:
            self.sharded.comm.agree(problem)

    def _pull_options(self) -> None:
        pull_groups(self.param_groups, self.sharded.param_groups)

    def _hand_over(self, name: str) -> None:
        """The post-accumulate-grad hook (``shard_gradients``): hand the gradient of ``name``
        over to its bucket and drop it, so torch's gradients do not pile up; at the end of
        this backward, parameters it gave no gradient are handed over as zeros."""
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        p = self._binding[name][0]
        self.sharded.add_grad(name, as_array(p.grad))
        p.grad = None
        self.unit_hooks.handed(name)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        for name in self.sharded.missing_grads():
            p = self._binding[name][0]
            self.sharded.add_grad(name, as_array(p.new_zeros(self._shapes[name])))
        self.unit_hooks.end_of_backward()

    def _grad_ready(self, name: str) -> None:
        """The post-accumulate-grad hook (``overlap``): the gradient of ``name`` is final for
        this backward; start its bucket's reduction unless inside ``no_sync()``."""
        if not self._sync:
            return
        p, _, grad, _ = self._binding[name]
        if p.grad is not grad:
            repair_grad(self._binding, name)
        try:
            self.sharded.grads_ready([name])
        except ValueError as exc:
            raise ValueError(
                f"{exc}. With overlap=True, run every backward before the last "
                "of a step inside `with opt.no_sync():`"
            ) from None


def _defaults(cls, keys, options: dict) -> dict:
    """The rule options each new group would take: the given ones, else the class's."""
    signature = inspect.signature(cls).parameters
    return {
        key: options[key] if key in options else signature[key].default
        for key in keys
        if key in options or key in signature
    }
