"""The sharded engine: ZeRO stage 1 (and 2) for any update rule, composed of parts.

``ShardedOptimizer`` checks and agrees its inputs (``configure``), then builds, in order: the
shard groups (``topology``), the step's watchdog, the sharded state (``state``: parameters,
masters and the rule's state, with the parameters or offloaded), the gradient source
(``gradients``: stage 1's bucket pipeline or stage 2's gradient shards), persistence (saves,
exports, preemption) and the step (``step``). It delegates to them, has no branch on a feature
option, knows no rule's math, and closes the parts in reverse. ``with_engine_options`` gives
an optimizer of one rule the engine's options (declared once, in ``options``). The constructor
and ``step()`` must be called on all ranks; input errors are raised on every rank.
"""

from __future__ import annotations

import inspect
import signal
import weakref
from typing import Any, Literal, Protocol

from .comm.topology import Topology
from .comm.watchdog import Watchdog, watched
from .config import generated, options
from .config.configure import configure
from .flat.views import Closed, closed_error
from .gradients.source import gradient_source
from .kernels import backend
from .kernels.local_sums import KernelFamilies, reductions_for
from .memory import MemoryReport, ledger
from .persistence.on_disk import Persistence
from .state.sharded import sharded_state
from .step.pipeline import StepPipeline
from .step.records import Counters, StepInfo

__all__ = ["ShardedOptimizer", "StepInfo", "with_engine_options"]


class ShardedOptimizer:
    """An update rule with its state sharded over MPI ranks (ZeRO stage 1; stage 2 with
    ``shard_gradients``, stage 3 with ``shard_params``).

    Args:
        params: mapping name -> NumPy or CuPy array (initial values; rank 0's are broadcast),
            or a list of param groups ``{"params": {name: array}, <rule options>...}``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None), or a
            ``zero1_mpi.Communicator`` built from one.
        rule: the update rule (a ``zero1_mpi.Rule``); ``defaults``: its group options.

    The engine options are attributes too (``opt.shard_group_size``, ...; ``opt.options``).
    """

    def __init__(self, params, comm, rule, defaults: dict, **engine_options):
        setup = configure(params, comm, rule, defaults, engine_options)
        o, layout, xp = setup.options, setup.layout, backend.xp_for(setup.backend)
        self.comm, self.rule, self.layout, self.options = setup.comm, rule, layout, o
        self.param_groups, self.backend, self.closed = setup.groups, setup.backend, False
        self.counters = counters = Counters(setup.groups, o.loss_scale, o.max_grad_norm)
        kernels = KernelFamilies(setup.backend)  # decided once, for every part
        self._reductions = reductions = reductions_for(kernels.device, layout.largest_shard)
        with self.comm.abort_on_error("while allocating and broadcasting the parameters"):
            self.topology = topology = Topology(setup.comm, o.shard_group_size, setup.owns_comm)
            #: Ends the job when a step's collectives hang (``step_timeout``); marks where.
            self.watchdog = watch = Watchdog(o.step_timeout, self.rank, self.comm.abort)
            self.state = sharded_state(o, layout, topology, rule, xp, watch, counters, kernels)
            self.state.seed(setup.arrays)
            self.gradients = gradient_source(o, layout, xp, topology, reductions, watch, kernels)
        state, grads = self.state, self.gradients
        self.persistence = Persistence(self.comm, state, counters, watch)
        self._steps = StepPipeline(rule, state, grads, self.persistence, counters, reductions)
        #: Closed in reverse order by ``close()``.
        self._parts: list[_Part] = [topology, watch, state, grads, self.persistence]
        self.params, self.grads = state.params, grads.grads
        weakref.finalize(self, watch.close)

    def __getattr__(self, name: str):
        """The engine options and the shard groups' facts, as attributes."""
        for part in ("options", "topology"):
            found = vars(self).get(part)
            if found is not None and name in _ATTRIBUTES[part]:
                return getattr(found, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- public API --------------------------------------------------------------------------

    rank = property(lambda self: self.comm.rank, doc="This rank in ``comm``.")
    world_size = property(lambda self: self.comm.size, doc="The ranks of ``comm``.")
    scaler = property(lambda self: self.counters.scaler, doc="The next step's ``LossScaler``.")
    kernel = property(lambda self: self.state.kernel_kind, doc="The update's kernel family.")

    loss_scale = property(
        lambda self: self.counters.scaler.scale,
        doc="Multiply the loss by this before backward (1.0 without loss scaling).",
    )
    step_count = property(lambda self: self.counters.step, doc="Steps taken (not skipped).")

    @property
    def last_step_seconds(self) -> dict:
        """Host seconds of the last completed step by phase: reduce, agree (sum of squares +
        the one Allreduce), update (the kernel), gather (CuPy: the host's time)."""
        return self._steps.last_step_seconds

    @property
    def state_rows(self) -> tuple[str, ...]:
        """``shard_state``'s rows: "master", the rule's ``state_names``, "param" (16-bit)."""
        return self.state.rows

    @watched("reduce", 1)
    def grads_ready(self, names) -> None:
        """Declare the gradients of ``names`` (a name or an iterable of names) final for this
        step, so that communication starts during the backward pass: each bucket's reduction
        starts as soon as all its tensors are ready and every later bucket has started (the
        buckets go last to first, the order of a backward pass, the same on every rank).
        Optional: ``step()`` starts whatever has not started. Must be called on all ranks,
        with the same names before each ``step()``; do not write those gradients again before
        ``step()`` (MPI may be reading them)."""
        self._steps.ready(names)

    @watched("reduce", 1)
    def add_grad(self, name: str, grad) -> None:
        """With ``shard_gradients``: hand over tensor ``name``'s gradient for this micro-batch
        (an array of the parameter's shape, in its dtype or float32, NumPy or CuPy as the
        parameters), once per micro-batch, in the same order on every rank; the array may be
        reused or freed on return. A bucket whose last tensor this is starts its reduction
        into the gradient shard. Must be called on all ranks. A wrong name, shape, dtype or a
        second hand-over in one micro-batch is raised by the next ``step()`` on every rank."""
        self._steps.add(name, grad)

    def add_grads(self, grads) -> None:
        """``add_grad`` for each ``name: grad`` of the mapping ``grads``, in its order."""
        for name, grad in grads.items():
            self.add_grad(name, grad)

    def missing_grads(self) -> list[str]:
        """With ``shard_gradients``: the tensors not yet handed over in the buckets that this
        micro-batch has begun (an unused parameter's: hand it over as zeros)."""
        return self.gradients.missing()

    def wait(self) -> None:
        """Complete the gathers ``step(wait=False)`` left in flight (``opt.params[...]`` does)."""
        self.state.wait()

    def gathered(self, unit: str):
        """``with opt.gathered("block3") as p:``: the unit's tensors by name (``shard_params``:
        gathered into a working buffer for the block, read-only). All ranks, in one order."""
        return self.state.gathered(unit)

    @watched("reduce", 1)
    def zero_grad(self) -> None:
        """Set every gradient to zero (``step()`` also leaves them zeroed). Reductions that
        ``grads_ready`` started for this step are completed and forgotten first."""
        self._steps.zero_grad()

    @watched("reduce", 1)
    def clip_grad_norm_(self, max_norm, *, problem: str | None = None) -> float:
        """Reduce this step's gradients now and return their global L2 norm (of the mean over
        the ranks, unscaled; inf or nan on overflow); the coming ``step()`` clips them to
        ``max_norm`` (and to ``max_grad_norm``; None: the norm only), as FSDP's and
        DeepSpeed's ``clip_grad_norm_`` do. All ranks, after the step's last backward; a later
        gradient is an error of the step. ``problem``: as ``step``'s (a bad ``max_norm`` too)."""
        return self._steps.clip_grad_norm(max_norm, problem)

    @watched("reduce", 1)
    def reduced_grads(self, *, problem: str | None = None) -> dict:
        """``{name: fp32 array}`` on every rank: the step's gradients as its update will take
        them (the mean over the ranks, unscaled, clipped), for logging. All ranks, after the
        step's last backward: reduces them now (as ``clip_grad_norm_``; a later gradient is
        an error of the step), then all-gathers them (new arrays, 4 bytes a parameter)."""
        return self._steps.reduced_grads(problem)

    @watched("reduce", 1)
    def step(self, wait: bool = True, *, problem: str | None = None) -> StepInfo:
        """Average the gradients over ranks, update the owned shard, gather the parameters.

        With ``wait=False`` the all-gathers are left in flight until the parameters are next
        read (see ``wait()``). ``problem``: a usage error the caller found on this rank (a
        framework adapter's check), raised as ValueError on every rank with nothing updated,
        agreed in the step's one Allreduce. Must be called on all ranks. Consumes the
        gradients: the buffer is zero afterwards, ready for the next accumulation. When the
        gradients overflow (inf/nan on any rank), nothing is updated on any rank: with dynamic
        loss scaling the scale backs off and the step reports ``skipped=True``; at the minimum
        scale, or without dynamic scaling, ``FloatingPointError`` is raised on every rank."""
        return self._steps.run(wait, problem)

    def checkpoint_on_signal(self, path, signals=(signal.SIGTERM,), keep: int | None = None):
        """Turn ``signals`` (default SIGTERM, which Slurm sends before it kills a job; a
        signal, its name, or a tuple) on any rank into a checkpoint: the first ``step()``
        whose ``Allreduce`` follows it updates (or skips) as usual, saves ``save(path, keep)``
        and returns ``StepInfo(stop=True, checkpoint=<dir>)``: ``if info.stop: break``. All
        ranks, main thread; a bad argument raises on every rank. Returns a
        ``SignalCheckpoint`` whose ``close()`` (or ``with`` block) restores the handlers."""
        return self.persistence.checkpoint_on_signal(path, signals, keep)

    def save(self, path, keep: int | None = None, *, blocking: bool = True):
        """Write a sharded checkpoint under the directory ``path`` (each rank its own shard;
        the previous one stays loadable until this one is complete), keeping the newest
        ``keep`` there (None: all); return its directory. All ranks. ``blocking=False``: copy
        the shard into a host buffer (``memory_report().checkpoint_buffer``), write it from a
        thread while training goes on, publish it at the first ``step()`` after every rank's
        write has finished (agreed in its Allreduce); return a ``checkpoint.PendingSave``
        whose ``wait()`` (all ranks) finishes it. A save, ``load`` or ``close`` first
        finishes the one in flight, raising its error if it failed."""
        return self.persistence.save(path, keep, blocking)

    def finish_save(self):
        """Finish the last non-blocking save, if any and not yet finished by a step: wait for
        every rank's write and publish it. Returns its directory (None if there was none), or
        raises its ``CheckpointError`` on every rank. Must be called on all ranks."""
        return self.persistence.finish_save()

    def load(self, path):
        """Load the checkpoint at ``path`` (the directory given to ``save``, or one checkpoint
        in it), saved at any world size. Must be called on all ranks. Nothing changes if the
        checkpoint is bad: the error is raised on every rank. Error-feedback residuals, which
        checkpoints do not hold, start again from zero."""
        self.gradients.rescale_feedback(0.0)
        return self.persistence.load(path)

    def save_consolidated(self, path):
        """Write the full fp32 state by parameter name to one safetensors file; all ranks."""
        return self.persistence.save_consolidated(path)

    def load_consolidated(self, path):
        """Load a file of ``save_consolidated``'s, saved at any world size; all ranks."""
        self.gradients.rescale_feedback(0.0)
        return self.persistence.load_consolidated(path)

    def shard_state(self, lo: int, hi: int, state: int) -> dict:
        """This rank's state over a flat range ``[lo, hi)`` it owns, from ``state`` in its shard
        arrays (``layout.owned(shard_rank)``): an array per name of ``state_rows`` (fp32; a
        copy where a row is kept otherwise). To change them: ``write_shard_state``."""
        return self.state.views(lo, hi, state)

    def write_shard_state(self, lo: int, hi: int, state: int, values: dict) -> None:
        """Set rows of ``shard_state`` over ``[lo, hi)`` (by name; fp32 values; no "param":
        the masters rounded); then ``gather_params()`` on all ranks."""
        self.state.write(lo, hi, state, values)

    def gather_params(self) -> None:
        """All-gather the parameters, blocking (after writing ``shard_state()``); all ranks."""
        self.wait()
        self.state.publish()

    def restore_counters(self, step: int, scaler, group_options: list) -> None:
        """Set the step count, the loss scaler and each param group's rule options, as a
        checkpoint or export saved them (checked by ``checkpoint.read_counters``)."""
        self.counters.restore(step, scaler, group_options)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category, measured from the arrays it allocated; with
        ``offload``, split between the device and the host."""
        return ledger.memory_report(
            self.state, self.gradients, self._reductions, self.persistence, self.backend
        )

    def close(self) -> None:
        """Release what this optimizer holds (for long runs that build many), its parts in
        reverse order: finish a non-blocking save, restore the signal handlers; complete the
        collectives in flight (started reductions' gradients are dropped) and free their
        persistent requests, the offload threads, the watchdog's thread, the sub-communicators
        of hierarchical sharding and a ``Communicator`` it built (one passed in stays yours);
        drop the buffers. Afterwards every public method and ``params``/``grads`` raise
        RuntimeError naming ``close()``. Idempotent; all ranks. ``with ZeroAdamW(...) as
        opt:`` calls it when the block ends, also on an exception."""
        if self.closed:
            return
        for part in reversed(self._parts):
            part.close()
        self.closed, name = True, type(self).__name__
        for method, _ in inspect.getmembers(type(self), inspect.isfunction):
            if not method.startswith("_") and method != "close":
                setattr(self, method, _closed_method(name, method))  # shadows the method
        self.params = self.grads = Closed(name)
        dropped: Any = None  # no method reads them once closed (each raises instead)
        self.state = self.gradients = self.persistence = self._steps = dropped
        self._parts = self._reductions = dropped

    def __enter__(self):
        if self.closed:
            _closed_method(type(self).__name__, "__enter__")()
        return self

    def __exit__(self, *exc_info) -> Literal[False]:
        self.close()
        return False

    def __repr__(self) -> str:
        return generated.describe(self)


class _Part(Protocol):
    """What the engine asks of each of its parts at the end."""

    def close(self) -> None: ...


#: The attributes ``ShardedOptimizer.__getattr__`` finds on its parts.
_ATTRIBUTES = {
    "options": frozenset(o.name for o in options.OPTIONS),
    "topology": frozenset({"shard_rank", "replicas", "shard_comm", "replica_comm"}),
}


def _closed_method(owner: str, method: str):
    """What a closed optimizer's ``method`` becomes: a callable raising ``closed_error``."""

    def closed(*args, **kwargs):
        raise closed_error(owner, f"{method}()")

    return closed


def with_engine_options(cls):
    """Class decorator for an optimizer of one rule whose ``__init__`` passes ``**engine`` on
    to ``ShardedOptimizer``: its signature (``help()``, ``inspect.signature``) lists the
    engine's keyword-only options after its own, and its docstring gains their descriptions,
    both from ``options.OPTIONS`` (where they are declared once)."""
    own = inspect.signature(cls.__init__)
    kept = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    cls.__init__.__signature__ = own.replace(parameters=kept + generated.signature_parameters())
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n{generated.docstring_section()}\n    "
    return cls


with_engine_options(ShardedOptimizer)
