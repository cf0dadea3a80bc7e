"""JAX binding: pytrees in and out of a ZeRO stage 1 optimizer (``ZeroOptimizer``).

``ZeroOptimizer(params, "adamw", lr=...)`` takes a pytree of arrays (leaves named by their tree
paths, e.g. ``"params/Dense_0/kernel"``); ``opt.params()`` gives the same pytree of JAX arrays
viewing the flat parameter buffer; ``opt.step(grads)`` takes the gradients as a like pytree.
``step()`` rewrites what the views show, which JAX assumes never happens; three rules keep that
safe: (1) every computation that reads the views is finished before ``step()`` (``step(grads)``
waits for ``grads``; wait for anything else yourself); (2) call ``params()`` again after each
``step()`` / ``load()`` (an older pytree shows the new values; ``jnp.copy`` keeps a snapshot);
(3) pass the parameters to jit-compiled functions as arguments, never close over them (a
captured array is a constant). Imports JAX, which ``import zero1_mpi`` does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .bindings import jax_params
from .bindings.common import CORE_INTERFACE, PassThrough, optimizer_class
from .bindings.jax_params import ALIGNMENT, core_inputs, is_tracer
from .bindings.schedules import Schedules
from .comm.communicator import Communicator
from .engine import ShardedOptimizer, StepInfo

_JAX_MISSING: ImportError | None
try:
    import jax
except ImportError as exc:  # the module still imports (tools, docs); ZeroOptimizer needs JAX
    jax, _JAX_MISSING = None, exc
else:
    _JAX_MISSING = None

__all__ = ["ALIGNMENT", "ZeroOptimizer", "leaf_names"]


@functools.wraps(jax_params.leaf_names)
def leaf_names(tree) -> list[str]:
    _require_jax()
    return jax_params.leaf_names(tree)


def _around_schedules(name: str):
    """The core's method ``name`` for ``ZeroOptimizer``, with the schedules' numbers for the
    step count given to the param groups before it and after it."""
    core = CORE_INTERFACE[name]

    @functools.wraps(core)  # the core's signature (through __wrapped__)
    def method(self, *args, **kwargs):
        self._next_lr()
        try:
            return getattr(self.sharded, name)(*args, **kwargs)
        finally:
            self._schedules.rewritten(self.sharded.param_groups)
            self._next_lr()

    method.__doc__ = f"{core.__doc__} A schedule given as ``lr`` goes on from the step count."
    return method


class ZeroOptimizer(PassThrough):
    """A zero1_mpi sharded optimizer over a pytree of JAX (or NumPy) arrays.

    Args:
        params: a pytree of floating-point arrays (dicts, lists, tuples, Flax's variable
            dicts, a ``flax.nnx`` State of parameters): the initial values (rank 0's are
            broadcast). A leaf is named by its path (``leaf_names``). Any other leaf (an
            integer, bool or PRNG key array, a Python number) is refused, naming it.
        rule: an optimizer class (``zero1_mpi.ZeroAdamW``, ``ZeroAdam``, ``ZeroSGD``,
            ``ZeroLion``, ``ZeroLAMB`` or your own) or one of ``"adamw"``, ``"adam"``,
            ``"sgd"``, ``"lion"``, ``"lamb"``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None) or a
            ``zero1_mpi.Communicator``.
        groups: param groups, a list of ``{"params": selector, <rule options>}``; a selector
            is ``f(name, leaf) -> bool`` or a collection of leaf names. A leaf joins the first
            group that selects it; the leaves no group selects form a group with the
            optimizer's options, first. ``[{"params": lambda name, leaf: name.rsplit("/",
            1)[-1] in ("bias", "scale"), "weight_decay": 0.0}]`` exempts biases and norm
            scales from weight decay.
        mask: optax's ``mask`` of weight decay: a pytree of bools like ``params`` (or a
            prefix of it: one bool for a subtree), or a function ``params -> such a pytree``
            (called once, here), matched to the leaves by name; a leaf with False gets
            ``weight_decay=0.0`` and keeps its group's other options (a group holding both
            kinds becomes two in ``param_groups``: its decayed leaves', then the others').
        **options: the rule's options (``lr``, ``betas``, ``weight_decay``, ...) and the
            engine's (``param_dtype``, ``max_grad_norm``, ``loss_scale``, ...). optax's
            names are taken where they mean the same (``learning_rate``, ``b1``, ``b2``,
            here and in groups; ``zero1_mpi.bindings.optax_names``); its defaults are not.

    ``lr`` may be a schedule (here, in a group, or set later as ``opt.param_groups[i]["lr"]``):
    a function of the step count such as an optax schedule. A step uses ``schedule(count)``,
    ``count`` being optax's: the updates applied before it (``step_count``). The group's
    ``lr`` shows the number the next step uses; setting a number there ends the schedule. A
    skipped step (dynamic loss scaling) does not count: the next one uses the same value.
    Checkpoints record the number and the count; after ``load`` / ``load_consolidated`` (at
    any world size) of an optimizer built with the same schedule, the steps go on bit for
    bit. A schedule that raises, or gives no finite number, fails the step on every rank.

    The core ``ShardedOptimizer`` is ``opt.sharded``. In its flat buffer each group's leaves
    whose size is a whole number of 64-byte lines come first (in tree order), then the others,
    so that those start on 64 bytes (in the first group always, in a later one where the
    groups before it fill whole lines) and ``params()`` hands them out without a copy.

    Measured on XLA:CPU (``unsafe_buffer_pointer()`` against ``.ctypes.data``; ``zero_copy()``
    records what happened in a run): ``jax.device_put`` of a NumPy array is a view of it when
    it starts on a multiple of 64 bytes, a copy otherwise (JAX 0.5 to 0.10; 0.4.30 also
    aliased some unaligned ones; ``jnp.from_dlpack`` does the same). That holds for bfloat16
    too, so bfloat16 parameters come out as bfloat16 JAX arrays (NumPy's DLPack export has no
    bfloat16; ``device_put`` needs none).
    ``params()`` costs 40-60 us a leaf (one batched ``device_put``, a loaded 2-core machine);
    ``step(grads)`` adds about 0.1 ms plus 5 us a leaf to the core's step. Gradients: ``np.asarray``
    of a JAX array is a read-only view of its buffer; the copy into the flat gradient buffer is
    the one copy a step makes (XLA writes outputs to buffers it allocates; donating a view as
    an input does not make it receive them). JAX 0.4.30 ran jit calls on the CPU synchronously
    (rule 1 held by itself there); from 0.5 on they run asynchronously.
    """

    def __init__(self, params, rule="adamw", comm=None, *, groups=None, mask=None, **options):
        _require_jax()
        if not isinstance(comm, Communicator):
            comm = Communicator(comm, cuda_aware=options.pop("cuda_aware", None))
        error = None  # the try binds cls and found, or agree() raises on every rank
        try:  # checked on every rank before the core's own checks and collectives
            cls = optimizer_class(rule)
            found = core_inputs(params, cls, groups, mask, options)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
        comm.agree(error)
        self._names, self._treedef = found.names, found.treedef
        #: The core optimizer: buffers, layout, param groups, checkpoints.
        self.sharded: ShardedOptimizer = cls(found.params, comm, **found.options)
        self.sharded.persistence.old_names = found.old_names  # 0.1.0's checkpoints load
        self._schedules = Schedules(found.schedules, self.sharded.param_groups, 0)
        #: The ``StepInfo`` of the last ``step()`` (None before the first).
        self.last_step: StepInfo | None = None
        self._param_views = [self.sharded.params[n] for n in self._names]
        self._grad_views = (
            []
            if self.sharded.grad_shard_dtype is not None
            else [self.sharded.grads[n] for n in self._names]
        )
        self._dtype = self.sharded.param_dtype
        self._problem: str | None = None  # found by accumulate(), raised by step()
        self._accumulated = False  # gradients added since the last step
        self._params_copied: set[str] = set()
        self._grads_copied: set[str] = set()

    # -- pytrees in and out ------------------------------------------------------------------

    def params(self):
        """The parameters as a pytree of ``params``' structure: JAX arrays on the flat buffer
        (views where 64-byte aligned, copies elsewhere), valid until the next ``step()`` or
        ``load()`` (the module's rules). Completes an all-gather in flight first."""
        self.sharded.wait()
        arrays = jax.device_put(self._param_views)
        for name, view, array in zip(self._names, self._param_views, arrays):
            if _pointer(array) != view.ctypes.data:
                self._params_copied.add(name)
        return jax.tree_util.tree_unflatten(self._treedef, arrays)

    def accumulate(self, grads) -> None:
        """Add ``grads`` (a pytree like ``params()``) to the gradient buffer, for gradient
        accumulation over micro-batches; then ``step()``. Waits for JAX to finish computing
        them. Local (no communication): a wrong pytree adds nothing and is raised by the next
        ``step()`` on every rank. 16-bit parameters accumulate in their own dtype. With
        ``shard_gradients`` it hands them over (a micro-batch, reduced as its buckets fill;
        all ranks)."""
        self._take(grads, "accumulate()")

    def step(self, grads=None) -> StepInfo:
        """Average the gradients over ranks, update this rank's shard and gather the
        parameters; all ranks. ``grads``: this step's gradients (a pytree like ``params()``,
        of the parameters' dtype or float32), added to any ``accumulate()`` gave; None: just
        those. Waits for JAX to finish computing ``grads``. A wrong pytree, shape or dtype on
        any rank raises ValueError on every rank, naming the leaf; nothing is updated and the
        gradients are dropped. Returns (and keeps as ``last_step``) the core's ``StepInfo``."""
        if grads is not None:
            self._take(grads, "step()")
        problem, self._problem, self._accumulated = self._problem, None, False
        groups, schedules = self.sharded.param_groups, self._schedules
        failed = schedules.apply(groups, self.sharded.step_count)  # (always: no callable left)
        problem = problem or failed
        try:
            self.last_step = self.sharded.step(problem=problem)
        except BaseException:
            schedules.restore(groups)  # nothing updated: the numbers as they were
            raise
        finally:
            schedules.settle(groups)
        self._next_lr()
        return self.last_step

    def zero_copy(self) -> dict[str, list[str]]:
        """What the transfers did so far, as leaf names in tree order: ``"aligned"``, the
        leaves whose view starts on 64 bytes; ``"params"``, those every ``params()`` handed out
        without a copy; ``"grads"``, those whose every gradient was read without a copy."""
        return {
            "aligned": [
                n for n, v in zip(self._names, self._param_views) if v.ctypes.data % ALIGNMENT == 0
            ],
            "params": [n for n in self._names if n not in self._params_copied],
            "grads": [n for n in self._names if n not in self._grads_copied],
        }

    @property
    def names(self) -> list[str]:
        """The leaf names, in tree order."""
        return list(self._names)

    # -- the core's, passed through -----------------------------------------------------------

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (and an error ``accumulate()`` found)."""
        self.sharded.zero_grad()
        self._problem, self._accumulated = None, False

    @property
    def param_groups(self) -> list[dict]:
        """The core's param groups (``"names"`` and the rule's options; set ``lr`` there, a
        number or a schedule)."""
        return self.sharded.param_groups

    @property
    def lr_schedules(self) -> dict[int, Callable]:
        """The schedule of each param group whose ``lr`` has one, by the group's index."""
        return self._schedules.scheduled()

    def _next_lr(self) -> None:
        """Give the scheduled groups the next step's ``lr`` (a schedule that fails keeps its
        group's number, and fails the next step on every rank)."""
        self._schedules.apply(self.sharded.param_groups, self.sharded.step_count)
        self._schedules.settle(self.sharded.param_groups)

    # The core's methods that read or write the param groups: the next step's lr before them
    # (no callable reaches the core), and again after them (a load restores the count).
    save = _around_schedules("save")
    save_consolidated = _around_schedules("save_consolidated")
    load = _around_schedules("load")
    load_consolidated = _around_schedules("load_consolidated")
    restore_counters = _around_schedules("restore_counters")
    clip_grad_norm_ = _around_schedules("clip_grad_norm_")

    # -- gradients in ------------------------------------------------------------------------

    def _take(self, grads, where: str) -> None:
        """Check ``grads``, wait for them and add them to the gradient buffer (with
        ``shard_gradients``: hand them over); a problem is kept for ``step()`` (nothing
        added; handed over as zeros, so that every rank reduces the same buckets)."""
        stage2 = self.sharded.grad_shard_dtype is not None
        if self._problem is not None and not stage2:
            return
        try:
            hosts = None if self._problem else self._host_grads(grads)
        except (TypeError, ValueError) as exc:
            self._problem, hosts = f"{where}: {exc}", None
        if stage2:
            hosts = hosts or [np.zeros(v.shape, v.dtype) for v in self._param_views]
            for name, host in zip(self._names, hosts):
                self.sharded.add_grad(name, host)
            return
        if hosts is None:
            return
        for _name, view, host in zip(self._names, self._grad_views, hosts):
            if self._accumulated:
                view += host
            else:
                view[...] = host  # the step's one copy
        self._accumulated = True

    def _host_grads(self, grads) -> list[np.ndarray]:
        """``grads``' leaves as NumPy arrays (views of JAX's buffers), in tree order, once JAX
        has computed them; ValueError naming the first wrong leaf and the fix."""
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        if treedef != self._treedef:
            names = leaf_names(grads)
            if names != self._names:
                raise ValueError(_structure_problem(names, self._names))
        for name, leaf, view in zip(self._names, leaves, self._param_views):
            if is_tracer(leaf):
                raise TypeError(
                    f"grads[{name!r}] is a tracer: call step() outside jax.jit "
                    "(return the gradients from the jit-compiled function)"
                )
            shape = np.shape(leaf)
            dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.result_type(leaf)
            if shape != view.shape:
                raise ValueError(
                    f"grads[{name!r}] has shape {shape}, its parameter "
                    f"{view.shape}: pass the gradient of each leaf of params()"
                )
            if dtype != self._dtype and dtype != np.float32:
                raise ValueError(
                    f"grads[{name!r}] has dtype {dtype}: pass the parameters' "
                    f"dtype ({self._dtype.name}) or float32 (cast with .astype)"
                )
        jax.block_until_ready([x for x in leaves if isinstance(x, jax.Array)])
        hosts = []
        for name, leaf in zip(self._names, leaves):
            host = np.asarray(leaf)
            if isinstance(leaf, jax.Array) and _pointer(leaf) != host.ctypes.data:
                self._grads_copied.add(name)
            hosts.append(host)
        return hosts


def _require_jax() -> None:
    if jax is None:
        raise ImportError(f"zero1_mpi.jax needs JAX: pip install 'zero1-mpi[jax]' ({_JAX_MISSING})")


def _pointer(array) -> int | None:
    """The address of a single-device JAX array's buffer (None where it has none)."""
    try:
        return array.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - sharded or deleted arrays: not a view
        return None


def _structure_problem(got: list[str], want: list[str]) -> str:
    missing = [n for n in want if n not in set(got)]
    extra = [n for n in got if n not in set(want)]
    if missing or extra:
        what = "; ".join(
            part
            for part in (
                missing and f"it lacks {missing[:3]}",
                extra and f"it has {extra[:3]} that params lacks",
            )
            if part
        )
    else:
        what = "its leaves come in another order"
    return (
        f"grads is not a pytree like the parameters: {what}: pass jax.grad's result for "
        "opt.params() (same structure, one gradient per leaf)"
    )
