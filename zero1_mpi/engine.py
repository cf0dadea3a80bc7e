"""The sharded engine: ZeRO stage 1 (and 2) for any update rule (``zero1_mpi.rules.Rule``).

Every rank holds the full parameters and gradients (flat buffers; the model sees named views;
``shard_gradients``: a gradient shard, fed by ``grad_shards.GradientShards``) and, for its own
shard only, fp32 master weights and the rule's state. ``step()`` reduces the gradients to each
rank's shard (``buckets.BucketPipeline``), agrees on the global norm, overflow and options in
one small ``Allreduce``, runs the rule's kernel on the shard (unscaling and clipping folded into
its gradient factor) and all-gathers the parameters. The engine knows no rule's math. The
constructor and ``step()`` must be called on all ranks; input errors are raised on every rank.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import signal
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import backend, checkpoint, export, preemption
from .buckets import BucketPipeline
from .comm import CollectiveError, Communicator
from .grad_shards import DEFAULT_SLOTS, GradientShards
from .layout import DEFAULT_BUCKET_ELEMENTS, build_layout
from .memory import MemoryReport
from .offload import HostShard, ThreadedKernel, check_offload, each_tensor_sums, resolve_threads
from .params import (check_arrays, check_max_grad_norm, check_reduce_dtype, check_stage2,
                     group_options, normalize_groups)
from .reductions import reductions_for, resolve_cpu_kernel
from .rules import missing_members
from .scaler import LossScaler
from .watchdog import Watchdog, check_step_timeout, watched

__all__ = ["ShardedOptimizer", "StepInfo", "with_engine_options", "resolve_shard_group_size"]

FP32 = np.dtype(np.float32)
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6)


@dataclass(frozen=True)
class StepInfo:
    """What one ``step()`` did."""

    grad_norm: float       # global L2 norm of the averaged, unscaled gradient, before clipping
    skipped: bool          # True when the gradients overflowed and nothing was updated
    loss_scale: float      # the scale the gradients of this step were multiplied by
    clip_coef: float       # the factor clipping applied (1.0 when it did not clip)
    step: int              # optimizer steps taken so far (skipped ones not counted)
    stop: bool = False     # a signal of checkpoint_on_signal arrived: checkpoint saved, stop
    checkpoint: Path | None = None  # the checkpoint saved after this step, when ``stop``


class ShardedOptimizer:
    """An update rule with its state sharded over MPI ranks (ZeRO stage 1).

    Args:
        params: mapping name -> NumPy or CuPy array (initial values; rank 0's are broadcast),
            or a list of param groups ``{"params": {name: array}, <rule options>...}``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None), or a
            ``zero1_mpi.Communicator`` built from one.
        rule: the update rule (a ``zero1_mpi.rules.Rule``); ``defaults``: its group options.

    Engine options (keyword-only):
        param_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; default: the arrays' dtype.
        loss_scale: None (no scaling), a number (fixed), ``"dynamic"``, or a ``LossScaler``.
            The loss must be multiplied by ``opt.loss_scale`` before backward.
        max_grad_norm: clip the averaged gradient to this global L2 norm (None: no clipping).
        reduce_dtype: precision of the gradient sum over ranks. ``"float32"`` (default) sums
            in fp32: fp32 gradients with ``Reduce_scatter_block``, 16-bit ones exchanged with
            ``Alltoall`` and summed locally in fp32 in rank order (deterministic; MPI has no
            bf16 type). ``"float16"`` (float16 gradients only) sums in MPI's float16.
        bucket_elements: size of a communication bucket, in elements.
        cuda_aware: whether MPI takes GPU buffers; None asks the environment and MPI.
        shard_group_size: shard the state over groups of this many consecutive ranks and
            replicate it across the groups (None: all ranks, one group; ``"node"``: the ranks
            that share memory). The gradients are reduce-scattered within a group, the shard
            summed across the groups, and the parameters all-gathered within the group.
        offload: ``"cpu"``: keep the fp32 master weights and the rule's state of this rank's
            shard on the host and update them there with the CPU kernel (ZeRO-Offload), the
            device holding the parameters, gradients and communication scratch; the copies
            and the host kernel of neighbouring buckets overlap. None: all on the device.
        offload_threads: the host kernel's threads (None: the cores this rank may use).
        shard_gradients: ZeRO stage 2: no rank holds the full gradient. Hand each tensor's
            gradient over with ``add_grad(name, grad)`` (once per micro-batch, in the same
            order on every rank) instead of writing ``grads``; a bucket is reduced into this
            rank's gradient shard as soon as its last tensor is in, through a few staging
            buckets (``grad_staging`` of them); the shard sums the micro-batches of a step.
        grad_shard_dtype: the gradient shard's dtype with ``shard_gradients``: None (the
            parameters') or ``"float32"`` (16-bit parameters: the exact fp32 sums, 2 bytes a
            parameter more per rank over N).
        grad_staging: staging buckets with ``shard_gradients`` (default 2; at least 1).
        step_timeout: seconds a ``step()`` may wait for its collectives (the reduction and
            agreement; then the gathers, and ``wait()``'s; stage 2 reductions in ``add_grad``)
            before the job is ended with a line naming the rank, step, phase and bucket, then
            MPI Abort (``zero1_mpi.watchdog``; docs/clusters.md). None: no watchdog.
    """

    def __init__(self, params, comm, rule, defaults: dict, *, param_dtype=None,
                 loss_scale=None, max_grad_norm=None, reduce_dtype="float32",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, cuda_aware=None,
                 shard_group_size=None, offload=None, offload_threads=None,
                 shard_gradients=False, grad_shard_dtype=None, grad_staging=DEFAULT_SLOTS,
                 step_timeout=None):
        # close() frees a communicator built here; one passed in stays its caller's.
        self._owns_comm, self.closed = not isinstance(comm, Communicator), False
        setup = _configure(params, comm, rule, defaults, param_dtype, loss_scale,
                           max_grad_norm, reduce_dtype, bucket_elements, cuda_aware,
                           shard_group_size, offload, offload_threads,
                           (shard_gradients, grad_shard_dtype, grad_staging), step_timeout)
        self.comm, self.rule, self.layout, k = setup.comm, rule, setup.layout, setup.group_size
        #: Ranks per shard group (K), this rank's position in its group (which shard of each
        #: bucket it owns), and how many groups hold a replica of the state (N / K).
        self.shard_group_size, self.shard_rank = k, self.rank % k
        self.replicas, self._replica = self.world_size // k, self.rank // k
        self.param_dtype, self.backend, self.kernel = setup.dtype, setup.backend, setup.kernel
        self.reduce_dtype, self.max_grad_norm = setup.reduce_dtype, setup.max_grad_norm
        self.scaler, self.param_groups = setup.scaler, setup.groups
        #: Where the master weights and the rule's state live ("cpu": the host), or None.
        self.offload, self.offload_threads = setup.offload, setup.threads
        #: The gradient shard's dtype with ``shard_gradients`` (stage 2), else None.
        self.grad_shard_dtype = setup.grad_shard_dtype
        self.step_count = 0
        self._pending_save = self._snapshot = None
        self._on_signal = None  # the SignalCheckpoint of checkpoint_on_signal, once called
        #: Host seconds of the last completed step by phase: reduce (the gradient reduction),
        #: agree (sum of squares + the one Allreduce), update (the kernel), gather (all-gather).
        #: CuPy work is asynchronous: there the phases are the host's, not the device's.
        self.last_step_seconds = {}
        with self.comm.abort_on_error("while allocating and broadcasting the parameters"):
            self._allocate(setup.layout, setup.dtype, setup.backend, setup.threads,
                           setup.staging)
            self._load_initial_values(setup.arrays)
        #: Ends the job when a step's collectives hang (``step_timeout``); marks where it is.
        self.watchdog = Watchdog(setup.step_timeout, self.rank, self.comm.abort)
        self.buckets.watch = self.watchdog
        if self._grad_shards is not None:
            self._grad_shards.watch = self.watchdog
        weakref.finalize(self, self.watchdog.close)

    # -- public API --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without loss scaling)."""
        return self.scaler.scale

    @property
    def state_rows(self) -> tuple[str, ...]:
        """The names of the views ``shard_state`` gives, in order: ``"master"``, the rule's
        ``state_names``, and for 16-bit parameters ``"param"`` (what checkpoints store)."""
        return ("master", *self.rule.state_names) + (("param",) if self._mixed else ())

    @watched("reduce", 1)
    def grads_ready(self, names) -> None:
        """Declare the gradients of ``names`` (a name or an iterable of names) final for this
        step, so that communication starts during the backward pass: each bucket's reduction
        starts as soon as all its tensors are ready and every later bucket has started (the
        buckets go last to first, the order of a backward pass, the same on every rank).
        Optional: ``step()`` starts whatever has not started. Must be called on all ranks,
        with the same names before each ``step()``; do not write those gradients again before
        ``step()`` (MPI may be reading them).
        """
        if self._grad_shards is not None:
            raise ValueError("grads_ready() is for the full gradient buffer: with "
                             "shard_gradients=True each bucket's reduction starts when "
                             "add_grad() hands its last tensor over")
        names = self.buckets.check_ready(names)  # a usage error: before any collective starts
        with self.comm.abort_on_error("in grads_ready()"):
            self.buckets.mark_ready(names)

    @watched("reduce", 1)
    def add_grad(self, name: str, grad) -> None:
        """With ``shard_gradients``: hand over tensor ``name``'s gradient for this micro-batch
        (an array of the parameter's shape, in its dtype or float32, NumPy or CuPy as the
        parameters), once per micro-batch, in the same order on every rank; the array may be
        reused or freed on return. A bucket whose last tensor this is starts its reduction
        into the gradient shard. Must be called on all ranks. A wrong name, shape, dtype or a
        second hand-over in one micro-batch is raised by the next ``step()`` on every rank."""
        if self._grad_shards is None:
            raise ValueError("add_grad() hands gradients over with shard_gradients=True; "
                             "without it, write them into opt.grads[name]")
        with self.comm.abort_on_error("in add_grad()"):
            self._grad_shards.add(name, grad)

    def missing_grads(self) -> list[str]:
        """With ``shard_gradients``: the tensors not yet handed over in the buckets that this
        micro-batch has begun (an unused parameter's: hand it over as zeros)."""
        return [] if self._grad_shards is None else self._grad_shards.missing()

    def add_grads(self, grads) -> None:
        """``add_grad`` for each ``name: grad`` of the mapping ``grads``, in its order."""
        for name, grad in grads.items():
            self.add_grad(name, grad)

    @watched("gather", 0)
    def wait(self) -> None:
        """Complete the all-gathers that ``step(wait=False)`` left in flight. Reading
        ``opt.params[...]`` calls this; call it yourself before reading views kept elsewhere
        (for example a model's tensors that share the buffer)."""
        if self.buckets.gathers_in_flight:
            with self.comm.abort_on_error("while gathering the parameters"):
                self.buckets.wait_gathers()

    @watched("reduce", 1)
    def zero_grad(self) -> None:
        """Set every gradient to zero (``step()`` also leaves them zeroed). Reductions that
        ``grads_ready`` started for this step are completed and forgotten first."""
        if self._grad_shards is not None:
            with self.comm.abort_on_error("in zero_grad() while completing reductions"):
                self._grad_shards.zero()
            return
        if self.buckets.started:
            with self.comm.abort_on_error("in zero_grad() while completing reductions"):
                self.buckets.discard()
        self._grads.fill(0)

    @watched("reduce", 1)
    def step(self, wait: bool = True, *, problem: str | None = None) -> StepInfo:
        """Average the gradients over ranks, update the owned shard, gather the parameters.

        With ``wait=False`` the all-gathers are left in flight until the parameters are next
        read (see ``wait()``). ``problem``: a usage error the caller found on this rank (a
        framework adapter's check), raised as ValueError on every rank with nothing updated,
        agreed in the step's one Allreduce. Must be called on all ranks. Consumes the gradients: the
        buffer is zero afterwards, ready for the next accumulation. When the gradients
        overflow (inf/nan on any rank), nothing is updated on any rank: with dynamic loss
        scaling the scale backs off and the step reports ``skipped=True``; at the minimum
        scale, or without dynamic scaling, ``FloatingPointError`` is raised on every rank.
        """
        self.wait()
        clock = time.perf_counter
        started = clock()
        group_error, options = self._check_param_groups()
        with self.comm.abort_on_error("in step() while reducing the gradients"):
            if self._grad_shards is None:
                reduced, order = self.buckets.reduce_all(), 0
            else:
                reduced = self._grad_shards.reduce_all()
                order = self._grad_shards.order_digest
                group_error = self._grad_shards.problem or group_error
            group_error = problem or group_error
            reduced_at = clock()
            self.watchdog.phase, self.watchdog.bucket = "agree", None
            # Replicas hold the same sums: the norm counts one of them.
            sum_sq = float(sum(self._reductions.sum_of_squares(r) for r in reduced)) \
                if self._replica == 0 else 0.0
            # One Allreduce: the norm (inf/nan if any rank overflowed), whether any rank found
            # a bad option or hand-over, and whether all ranks hold the same options and (stage
            # 2) reduced the buckets in the same order (sums of h and h^2 of a digest).
            # Then: whether a signal of checkpoint_on_signal is pending on this rank, and
            # whether its part of a non-blocking save is still being written.
            asked = self._on_signal.poll() if self._on_signal is not None else 0
            pending = self._pending_save
            pending = None if pending is None or pending.done else pending
            writing = 0.0 if pending is None or pending.written else 1.0
            totals = [sum_sq, 1.0 if group_error else 0.0, options, options * options,
                      order, order * order, 1.0 if asked else 0.0, writing]
            if self.world_size > 1:
                totals = self.comm.allreduce_sum(totals)
            if pending is not None and not totals[7]:  # every rank's file is on disk
                self.watchdog.disarm()  # publishing is file work (rank 0's syncs), not a hang
                pending.finish()  # publishes; a failure is the handle's (and the next save's)
        agreed_at = clock()
        if totals[1]:
            self.zero_grad()
            self.comm.agree(group_error)
        if self.world_size * int(totals[3]) != int(totals[2]) ** 2:
            self.zero_grad()
            raise CollectiveError(f"param_groups options ({', '.join(self.rule.options)}) "
                                  "differ between ranks: set them to the same values on every "
                                  "rank (nothing was updated)")
        if self.world_size * int(totals[5]) != int(totals[4]) ** 2:
            self.zero_grad()
            raise CollectiveError("the ranks handed their gradients over in different orders, "
                                  "so their reductions did not match: hand the same tensors "
                                  "over in the same order on every rank (nothing was updated)")

        scale = self.scaler.scale
        grad_norm = math.sqrt(totals[0]) / (self.world_size * scale)
        if not math.isfinite(grad_norm):
            self.zero_grad()
            if self.scaler.at_minimum:
                raise FloatingPointError(
                    f"the gradients hold inf or nan (grad_norm={grad_norm}) at loss scale "
                    f"{scale:g}, which cannot back off further, after {self.step_count} steps: "
                    "nothing was updated. Check the loss for divergence, lower the learning "
                    "rate, or use loss_scale='dynamic' (fp16)")
            self.scaler = self.scaler.update(overflow=True)
            return self._stop_if_asked(StepInfo(grad_norm, True, scale, 1.0, self.step_count),
                                       totals[6], asked)

        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (grad_norm + CLIP_EPS))
        factor = clip / (self.world_size * scale)
        update = gather = 0.0
        self.watchdog.disarm()  # the update is this rank's own work (the first may compile)
        with self.comm.abort_on_error("in step() while updating the parameters"):
            scalars = [self.rule.scalars(self.step_count + 1, group_options(g, self.rule, dict),
                                         factor) for g in self.param_groups]
            if self.rule.tensor_sums:  # a two-phase rule: per-tensor sums first, then update
                t0 = clock()
                scalars = self._per_tensor_scalars(self._shards(reduced), scalars)
                update += clock() - t0
            t0 = clock()  # (offloaded, the wait for a bucket's gradient copy counts as update)
            for bucket, grads in self._shards(None if self.rule.tensor_sums else reduced):
                self.watchdog.bucket = bucket.index
                self._update_shard(bucket, grads, scalars)
                t1 = clock()
                for index in self._published(bucket):  # whose new shard has landed
                    self.buckets.start_gather(index)
                t2 = clock()
                update, gather, t0 = update + t1 - t0, gather + t2 - t1, t2
            for index in self._published(None):
                self.buckets.start_gather(index)
            gather += clock() - t0
            self.zero_grad()
        if wait:
            t0 = clock()
            self.watchdog.arm(self.step_count + 1, "gather")
            self.wait()
            gather += clock() - t0
        self.last_step_seconds = {"reduce": reduced_at - started, "agree": agreed_at - reduced_at,
                                  "update": update, "gather": gather}
        self.step_count += 1
        self.scaler = self.scaler.update(overflow=False)
        return self._stop_if_asked(StepInfo(grad_norm, False, scale, clip, self.step_count),
                                   totals[6], asked)

    def checkpoint_on_signal(self, path, signals=(signal.SIGTERM,), keep: int | None = None
                             ) -> preemption.SignalCheckpoint:
        """Turn ``signals`` (default SIGTERM, which Slurm sends before it kills a job; a
        signal, its name, or a tuple) received on any rank into a checkpoint at the next step
        boundary: the first ``step()`` whose ``Allreduce`` follows the signal updates (or
        skips) as usual, then saves ``save(path, keep)`` on every rank and returns
        ``StepInfo(stop=True, checkpoint=<the new directory>)``: ``if info.stop: break``.
        Must be called on all ranks, from the main thread; returns a ``SignalCheckpoint``
        whose ``close()`` (or ``with`` block) restores the previous handlers. A bad argument
        (an unknown or uncatchable signal, ``keep``, another thread) raises on every rank."""
        error = None
        try:
            if self._on_signal is not None and self._on_signal.active:
                raise ValueError(f"checkpoint_on_signal() is already active "
                                 f"({self._on_signal!r}): close() it first")
            path, signals = preemption.check_arguments(path, signals, keep)
        except ValueError as exc:
            error = exc
        self.comm.agree(error)
        self.comm.check_same({"path": path, "signals": [s.name for s in signals], "keep": keep},
                             "checkpoint_on_signal's", "pass the same arguments on every rank")
        self._on_signal = preemption.SignalCheckpoint(path, signals, keep)
        return self._on_signal

    def _stop_if_asked(self, info: StepInfo, asked_anywhere: float, asked: int) -> StepInfo:
        """``info``, or once a signal reached any rank: the checkpoint saved, ``stop=True``."""
        if not asked_anywhere:
            return info
        self.watchdog.disarm()  # a save takes as long as the file system does: not a hang
        pending = self._pending_save
        if pending is not None and pending.error is not None:  # printed when it failed: it
            self._pending_save = None  # must not stop this checkpoint, the job is about to end
        where = self.save(self._on_signal.path, self._on_signal.keep)
        self._on_signal.answered(asked)
        return replace(info, stop=True, checkpoint=where)

    # -- the sharded state, as checkpoints and exports read and write it ---------------------

    def shard_state(self, lo: int, hi: int, state: int) -> dict:
        """This rank's state over the flat parameter range ``[lo, hi)``, a range it owns that
        starts at ``state`` in its shard arrays (``layout.owned(shard_rank)`` lists them): views
        by name, one per ``state_rows`` (``"master"``: for fp32 parameters the parameter buffer
        itself; the rule's state arrays; ``"param"``: the 16-bit parameters). Writing into them
        changes the optimizer; call ``gather_params()`` afterwards on all ranks."""
        s = slice(state, state + hi - lo)
        views = {"master": self._params[lo:hi] if self._master is None else self._master[s],
                 **{name: state[s] for name, state in self._state.items()}}
        if self._mixed:
            views["param"] = self._params[lo:hi]
        return views

    def gather_params(self) -> None:
        """All-gather the parameters, blocking (after writing ``shard_state()``); all ranks."""
        self.wait()  # gathers that step(wait=False) left in flight write the same buffer
        if self._offload is not None and not self._mixed:  # the masters are the parameters
            self._offload.push_all()
        self.buckets.gather_all()

    def restore_counters(self, step: int, scaler: LossScaler, group_options: list) -> None:
        """Set the step count, the loss scaler and each param group's rule options, as a
        checkpoint or export saved them (checked by ``checkpoint.read_counters``)."""
        self.step_count, self.scaler = step, scaler
        for group, saved in zip(self.param_groups, group_options):
            group.update(saved)

    def save(self, path, keep: int | None = None, *, blocking: bool = True):
        """Write a sharded checkpoint under the directory ``path`` (each rank writes its own
        shard; the previous checkpoint stays loadable until this one is complete); keep the
        newest ``keep`` checkpoints there (None: all). Must be called on all ranks. Returns
        the new checkpoint's directory.

        ``blocking=False``: copy this rank's shard into a host buffer (kept for the next
        non-blocking save, counted in ``memory_report().checkpoint_buffer``), write it from a
        background thread while training goes on, and publish it as a blocking save does at
        the first ``step()`` after every rank's write has finished (agreed in that step's one
        Allreduce). Returns a ``checkpoint.PendingSave``: ``.wait()`` (all ranks) finishes it
        and returns the directory or raises its ``CheckpointError``. A save, ``load`` or
        ``close`` first finishes the one in flight, raising its error if it failed."""
        if blocking not in (True, False):
            raise ValueError(f"blocking={blocking!r} must be True or False")
        self.wait()
        self.finish_save()  # raises the error of one that failed, also when a step finished it
        if blocking:
            return checkpoint.save(self, path, keep)
        shape = checkpoint.snapshot_shape(self)
        if shape is not None and (self._snapshot is None or self._snapshot.shape != shape):
            self._snapshot = np.empty(shape, FP32)
        self._pending_save = checkpoint.start_save(self, path, keep, self._snapshot)
        return self._pending_save

    def finish_save(self):
        """Finish the last non-blocking save, if any and not yet finished by a step: wait for
        every rank's write and publish it. Returns its directory (None if there was none), or
        raises its ``CheckpointError`` on every rank. Must be called on all ranks."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.wait()

    def load(self, path):
        """Load the checkpoint at ``path`` (the directory given to ``save``, or one checkpoint
        in it), saved at any world size. Must be called on all ranks. Nothing changes if the
        checkpoint is bad: the error is raised on every rank."""
        self.wait()
        if self._pending_save is not None and not self._pending_save.done:
            self.finish_save()  # (one a step finished and that failed: the next save raises)
        return checkpoint.load(self, path)

    def save_consolidated(self, path):
        """Write the full fp32 state by parameter name to one safetensors file; all ranks."""
        self.wait()
        return export.save_consolidated(self, path)

    def load_consolidated(self, path):
        """Load a file of ``save_consolidated``'s, saved at any world size; all ranks."""
        self.wait()
        return export.load_consolidated(self, path)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category, measured from the arrays it allocated; with
        ``offload``, split between the device and the host."""
        psi, owned = self.layout.numel, self.layout.owned_real(self.shard_rank)
        state = {name: owned * FP32.itemsize for name in self._state}
        shards = self._grad_shards
        grads = self._grads if shards is None else shards.shard
        real = {"parameters": psi * self.param_dtype.itemsize,
                "gradients": (psi if shards is None else owned) * grads.dtype.itemsize,
                "master_weights": 0 if self._master is None else owned * FP32.itemsize}
        sharded = [a for a in (self._master, *self._state.values()) if a is not None]
        sharded_real = real["master_weights"] + sum(state.values())
        device = [self._params, grads] + ([] if self._offload else sharded)
        padding = sum(a.nbytes for a in device) - real["parameters"] - real["gradients"]
        scratch = self.buckets.scratch_bytes + self._reductions.scratch_bytes
        if shards is not None:
            scratch += shards.scratch_bytes
        # Page-locked MPI staging (CuPy parameters) and the offloaded shard are the host's.
        host_scratch = self.comm.staging_bytes if self.backend == "cupy" else 0
        scratch += self.comm.staging_bytes - host_scratch
        host_padding = 0
        if self._offload is None:
            padding -= sharded_real
            scratch += self._kernel.scratch_bytes
        else:
            host_padding = sum(a.nbytes for a in sharded) - sharded_real
            host_scratch += self._offload.scratch_bytes + self._kernel.scratch_bytes
        return MemoryReport(**real, state=state, padding=padding, comm_scratch=scratch,
                            psi=psi, group_size=self.shard_group_size, rank=self.shard_rank,
                            param_dtype=self.param_dtype.name, rule=self.rule.name,
                            offloaded=self._offload is not None, host_padding=host_padding,
                            host_scratch=host_scratch,
                            grad_shard_dtype=None if shards is None else grads.dtype.name,
                            checkpoint_buffer=0 if self._snapshot is None
                            else self._snapshot.nbytes)

    def close(self) -> None:
        """Release what this optimizer holds, for long runs that build many: complete the
        collectives in flight (the all-gathers ``step(wait=False)`` left; reductions that
        ``grads_ready``/``add_grad`` started, whose gradients are dropped), free the persistent
        requests on its buffers, the two sub-communicators of hierarchical sharding
        (``shard_group_size`` < N), the ``Communicator`` it built (one passed in stays the
        caller's, for the caller to ``free()``) and the offload threads, finish a non-blocking
        save in flight, restore ``checkpoint_on_signal``'s signal handlers, and drop its
        buffers (views of them kept elsewhere keep only their memory alive). Afterwards every public
        method (``step``, ``add_grad``, ``save``, ...) and ``params``/``grads`` raise
        RuntimeError naming ``close()``. Idempotent. Must be called on all ranks, like
        ``step()``. ``with ZeroAdamW(...) as opt:`` calls it when the block ends, also on an
        exception (one raised on every rank, as this package's are)."""
        if self.closed:
            return
        pending, self._pending_save = self._pending_save, None
        if pending is not None:  # published, or its failure printed and left in the handle
            pending.finish()
        if self._on_signal is not None:  # the previous signal handlers come back
            self._on_signal.close()
        self.watchdog.close()
        self._snapshot = None
        with self.comm.abort_on_error("in close() while completing the collectives in flight"):
            self.wait()
            if self._grad_shards is not None:
                self._grad_shards.zero()
            elif self.buckets.started:
                self.buckets.discard()
            self.buckets.close()
            if self._grad_shards is not None:
                self._grad_shards.close()
            if isinstance(self._kernel, ThreadedKernel):
                self._kernel.close()
        for sub in () if self.replicas == 1 else (self.shard_comm, self.replica_comm):
            sub.free()
        if self._owns_comm:
            self.comm.free()
        self.closed = True
        name = type(self).__name__
        for method, _ in inspect.getmembers(type(self), inspect.isfunction):
            if not method.startswith("_") and method != "close":
                setattr(self, method, _closed_method(name, method))  # shadows the method
        self.params = self.grads = _ClosedViews(name)
        self.buckets = self._grad_shards = self._kernel = self._offload = self._pieces = None
        self._params = self._grads = self._master = self._reductions = None
        self._state = {}

    def __enter__(self):
        if self.closed:
            _closed_method(type(self).__name__, "__enter__")()
        return self

    def __exit__(self, *exc_info) -> bool:
        self.close()
        return False

    # -- internals ---------------------------------------------------------------------------

    def _allocate(self, layout, dtype, backend_name, threads, staging) -> None:
        xp = self._xp = backend.xp_for(backend_name)
        self._params = backend.zeros(xp, layout.total, dtype)  # 64-byte aligned on the host
        stage2 = self.grad_shard_dtype is not None
        self._grads = None if stage2 else backend.zeros(xp, layout.total, dtype)
        self._mixed = dtype != FP32
        largest = max(b.shard_size for b in layout.buckets)
        if self.offload:
            self._offload = HostShard(layout, self.shard_rank, self._params,
                                      self.rule.state_names, self._mixed)
            self._master, self._state = self._offload.master, self._offload.state
            self._kernel = ThreadedKernel(lambda: self.rule.kernel(self.kernel, largest),
                                          threads)
        else:
            self._offload = None
            self._master = xp.zeros(layout.shard_total, FP32) if self._mixed else None
            self._state = {name: xp.zeros(layout.shard_total, FP32)
                           for name in self.rule.state_names}
            self._kernel = self.rule.kernel(self.kernel, largest)
        self.params = _Views(self._views(self._params), before_read=self.wait)
        self.grads = _Views(self._views(self._grads)) if not stage2 else _NoFullGradients()
        self._reductions = reductions_for("cupy" if backend_name == "cupy" else self.kernel,
                                          largest)
        # Collectives within the group (reduce-scatter, all-gather) and across the groups (the
        # sum of a shard over its replicas): the whole communicator when there is one group.
        self.shard_comm = self.comm if self.replicas == 1 else self.comm.split(self._replica)
        self.replica_comm = None if self.replicas == 1 else self.comm.split(self.shard_rank)
        exchange = self._mixed and self.reduce_dtype == "float32" and self.shard_group_size > 1
        #: The bucket pipeline: readiness, reductions and gathers in flight (stage 2: the
        #: gathers; ``GradientShards`` reduces).
        self.buckets = BucketPipeline(
            layout, self._params, self._grads, self.shard_comm, self.replica_comm,
            exchange_16bit=exchange and not stage2, reductions=self._reductions)
        self._grad_shards = None if not stage2 else GradientShards(
            layout, xp, dtype, self.grad_shard_dtype, self.shard_comm, self.replica_comm,
            exchange, self._reductions, slots=staging)
        self._pieces = [layout.tensor_pieces(b, self.shard_rank) for b in layout.buckets] \
            if self.rule.tensor_sums else None

    def _views(self, flat) -> dict:
        return {t.name: flat[t.offset:t.offset + t.numel].reshape(t.shape)
                for t in self.layout.tensors}

    def _load_initial_values(self, arrays) -> None:
        """Broadcast rank 0's values bucket by bucket; fp32 masters keep their full precision."""
        xp, layout = self._xp, self.layout
        staging = xp.zeros(max(b.size for b in layout.buckets), FP32) if self._mixed else None
        for bucket in layout.buckets:
            span = slice(bucket.offset, bucket.offset + bucket.size)
            target = staging[:bucket.size] if self._mixed else self._params[span]
            target[bucket.used:] = 0  # the padding (the reused staging held the last bucket)
            if self.rank == 0:
                for t, lo, hi in layout.pieces(bucket.offset, bucket.offset + bucket.size):
                    values = xp.asarray(arrays[t.name]).reshape(-1)
                    target[lo - bucket.offset:hi - bucket.offset] = values[lo - t.offset:
                                                                           hi - t.offset]
            self.comm.bcast(target)
            if self._mixed:
                self._params[span] = target.astype(self.param_dtype)
            if self._master is not None:
                lo, hi = bucket.shard(self.shard_rank)
                self._master[bucket.state] = backend.like(
                    self._master, target[lo - bucket.offset:hi - bucket.offset])

    def _check_param_groups(self) -> tuple[str | None, int]:
        """``(problem, digest)``: a message if a group's options were set to invalid values
        since the last step, and a 20-bit digest of all options, to compare across ranks."""
        problem = None
        for index, group in enumerate(self.param_groups):
            try:  # valid options are stored back as plain floats (NumPy scalars are accepted)
                group.update(self.rule.check_options(**group_options(group, self.rule, dict)))
            except Exception as exc:  # noqa: BLE001 - reported on every rank by step()
                problem = problem or f"param_groups[{index}]: {exc}"
        text = repr([group_options(g, self.rule) for g in self.param_groups]).encode()
        return problem, int(hashlib.sha256(text).hexdigest()[:5], 16)

    def _shards(self, reduced):
        """``(bucket, its reduced gradient shard where the kernel reads it)`` in bucket order:
        ``reduced`` itself, or offloaded, host copies fetched one bucket ahead; for None,
        ``(bucket, None)`` (a two-phase rule's second phase reads no gradients)."""
        if reduced is None:
            return ((bucket, None) for bucket in self.layout.buckets)
        if self._offload is None:
            return zip(self.layout.buckets, reduced)
        return self._offload.fetched(reduced)

    def _published(self, bucket) -> list[int]:
        """The buckets whose new shard is in the parameter buffer once ``bucket``'s update is
        done (None: after the last), so that their all-gathers may start."""
        if self._offload is None:
            return [] if bucket is None else [bucket.index]
        return self._offload.drain() if bucket is None else self._offload.push(bucket)

    def _update_shard(self, bucket, grads, scalars) -> None:
        """Update this rank's shard of ``bucket``: per param group, or per tensor piece."""
        if self.rule.tensor_sums:
            for index, _, a, b in self._pieces[bucket.index]:
                master, states, param = self._shard_arrays(bucket, a, b)
                self._kernel.apply(master, *states, param, scalars[index])
            return
        lo, hi = bucket.shard(self.shard_rank)
        for (group_lo, group_hi), s in zip(self.layout.groups, scalars):
            a, b = max(lo, group_lo) - lo, min(hi, group_hi) - lo
            if a < b:
                master, states, param = self._shard_arrays(bucket, a, b)
                self._kernel(grads[a:b], master, *states, param, s)

    def _shard_arrays(self, bucket, a: int, b: int) -> tuple:
        """``(master, states, param or None)`` over ``[a, b)`` of this rank's shard of
        ``bucket``, where the kernel updates them; for fp32 parameters the master is the
        parameter range itself (offloaded: the host master, which ``push`` sends)."""
        lo, _ = bucket.shard(self.shard_rank)
        st = slice(bucket.state.start + a, bucket.state.start + b)
        states = [state[st] for state in self._state.values()]
        if self._offload is not None:
            params16 = self._offload.params16
            return self._master[st], states, None if params16 is None else params16[st]
        if self._mixed:
            return self._master[st], states, self._params[lo + a:lo + b]
        return self._params[lo + a:lo + b], states, None

    def _per_tensor_scalars(self, shards, scalars) -> dict:
        """Phase one of a two-phase rule: the kernel's partial sums over each tensor piece
        this rank owns (updating the rule's state), added per tensor, summed over the group in
        one ``Allreduce``; returns the scalars (``rule.tensor_scalars``) of each tensor this
        rank owns a piece of, by tensor index. ``shards``: as ``_shards`` gives them."""
        xp = np if self._offload is not None else self._xp
        sums = xp.zeros((len(self.layout.tensors), self.rule.tensor_sums), np.float64)
        for (bucket, grads), pieces in zip(shards, self._pieces):
            calls = []
            for _, group, a, b in pieces:
                master, states, _ = self._shard_arrays(bucket, a, b)
                calls.append((grads[a:b], master, *states, scalars[group]))
            for (index, *_), partial in zip(pieces, each_tensor_sums(self._kernel, calls)):
                sums[index] += partial
        totals = backend.to_numpy(sums)
        if self.shard_group_size > 1:  # the group's shards cover every tensor once
            self.watchdog.arm(self.step_count + 1, "update")
            totals = self.shard_comm.allreduce_sum(totals)
            self.watchdog.disarm()
        return {index: self.rule.tensor_scalars(scalars[group], totals[index])
                for pieces in self._pieces for index, group, _, _ in pieces}


class _Views(Mapping):
    """A read-only mapping of name -> view; ``before_read`` runs before each lookup."""

    def __init__(self, views: dict, before_read=None):
        self._views, self._before_read = views, before_read

    def __getitem__(self, name):
        if self._before_read is not None:
            self._before_read()
        return self._views[name]

    def __iter__(self):
        return iter(self._views)

    def __len__(self):
        return len(self._views)


class _NoFullGradients(Mapping):
    """``grads`` with ``shard_gradients``: no rank holds the full gradient to view."""

    def __getitem__(self, name):
        raise KeyError(f"opt.grads[{name!r}]: with shard_gradients=True no rank holds the full "
                       "gradient: hand it over with opt.add_grad(name, grad)")

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


def _closed_error(owner: str, what: str) -> RuntimeError:
    return RuntimeError(f"{owner}.{what}: this optimizer was closed (close(), or the end of its "
                        "with-block), which released its buffers and communicators: build a "
                        "new optimizer (a checkpoint saved before close() loads into it)")


def _closed_method(owner: str, method: str):
    """What a closed optimizer's ``method`` becomes: a callable raising ``_closed_error``."""
    def closed(*args, **kwargs):
        raise _closed_error(owner, f"{method}()")
    return closed


class _ClosedViews(Mapping):
    """``params`` and ``grads`` of a closed optimizer: any lookup raises ``_closed_error``."""

    def __init__(self, owner: str):
        self._owner = owner

    def __getitem__(self, name):
        raise _closed_error(self._owner, f"params/grads[{name!r}]")

    def __iter__(self):
        raise _closed_error(self._owner, "params/grads")

    def __len__(self):
        raise _closed_error(self._owner, "params/grads")


def with_engine_options(cls):
    """Class decorator for an optimizer of one rule whose ``__init__`` passes ``**engine`` on
    to ``ShardedOptimizer``: its signature (``help()``, ``inspect.signature``) lists the
    engine's keyword-only options after its own, and its docstring gains their descriptions,
    both taken from ``ShardedOptimizer`` (where they are declared once)."""
    own = inspect.signature(cls.__init__)
    kept = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    engine = [p for p in inspect.signature(ShardedOptimizer.__init__).parameters.values()
              if p.kind is p.KEYWORD_ONLY]
    cls.__init__.__signature__ = own.replace(parameters=kept + engine)
    section = ShardedOptimizer.__doc__[ShardedOptimizer.__doc__.index("Engine options"):]
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n    {section.rstrip()}\n    "
    return cls


@dataclass(frozen=True)
class _Setup:
    """The optimizer's inputs, checked and agreed on every rank."""

    comm: Communicator
    group_size: int
    groups: list
    arrays: dict
    dtype: np.dtype
    backend: str
    kernel: str
    reduce_dtype: str
    max_grad_norm: float | None
    scaler: LossScaler
    layout: object
    offload: str | None
    threads: int | None
    grad_shard_dtype: np.dtype | None
    staging: int
    step_timeout: float | None


def _configure(params, comm, rule, defaults, param_dtype, loss_scale, max_grad_norm,
               reduce_dtype, bucket_elements, cuda_aware, shard_group_size, offload,
               offload_threads, stage2, step_timeout) -> _Setup:
    """Check every input, raise any error on every rank, and check that all ranks passed the
    same options and parameters (collectives: on all ranks, before any other)."""
    if isinstance(comm, Communicator):
        if cuda_aware is not None:
            raise ValueError("cuda_aware= applies to a communicator this optimizer builds: "
                             "pass it to the Communicator you built instead")
    else:
        comm = Communicator(comm, cuda_aware=cuda_aware)
    # "node" asks MPI (a collective): only once every rank is known to ask.
    comm.check_same({"shard_group_size": _plain(shard_group_size), "offload": _plain(offload)},
                    "an option", "construct the optimizer with the same arguments on every rank")
    node = comm.node_ranks() if shard_group_size == "node" or offload is not None else None
    error = None
    try:
        if missing_members(rule):
            raise TypeError(f"rule={rule!r} lacks {', '.join(missing_members(rule))}: "
                            "subclass zero1_mpi.rules.Rule and define them")
        group_size = resolve_shard_group_size(shard_group_size, comm.size, node, comm)
        settings = rule.settings()
        groups, arrays = normalize_groups(params, defaults, rule)
        dtype, backend_name = check_arrays(arrays, param_dtype)
        reduce_dtype = check_reduce_dtype(reduce_dtype, dtype)
        max_grad_norm = check_max_grad_norm(max_grad_norm)
        scaler = LossScaler.from_option(loss_scale)
        offload = check_offload(offload, offload_threads)
        grad_shard_dtype, staging = check_stage2(*stage2, dtype, offload)
        step_timeout = check_step_timeout(step_timeout)
        threads = resolve_threads(offload_threads, len(node)) if offload else None
        kernel = "cupy" if backend_name == "cupy" and not offload else resolve_cpu_kernel()
        layout = build_layout({name: tuple(a.shape) for name, a in arrays.items()},
                              group_size, dtype.name, bucket_elements=bucket_elements,
                              param_group_tensors=[len(g["names"]) for g in groups])
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    comm.agree(error)
    comm.check_same(
        {**settings, "backend": backend_name,
         "param group options": [group_options(g, rule) for g in groups],
         "reduce_dtype": reduce_dtype, "max_grad_norm": max_grad_norm, "loss_scale": scaler,
         "bucket_elements": bucket_elements, "shard_group_size": group_size,
         "grad_shard_dtype": _plain(grad_shard_dtype), "grad_staging": staging,
         "step_timeout": step_timeout},
        "an option", "construct the optimizer with the same arguments on every rank")
    _check_layouts_agree(comm, layout)
    return _Setup(comm, group_size, groups, arrays, dtype, backend_name, kernel, reduce_dtype,
                  max_grad_norm, scaler, layout, offload, threads, grad_shard_dtype, staging,
                  step_timeout)


def _plain(value):
    """``value`` if it pickles the same everywhere (None, str, int), else its repr."""
    return value if value is None or isinstance(value, (str, int)) else repr(value)


def resolve_shard_group_size(value, size: int, node_ranks, comm) -> int:
    """K, the ranks per shard group, for ``shard_group_size=value`` on ``size`` ranks
    (``node_ranks``: the ranks sharing this rank's node, for ``"node"``), or a ValueError
    naming the value and the fix."""
    if value is None:
        return size
    if not comm.supports_split and value != size:
        raise ValueError(f"shard_group_size={value!r} needs sub-communicators, which "
                         f"{type(comm).__name__} cannot make yet: use zero1_mpi.Communicator "
                         "(MPI) or shard over all ranks")
    if value == "node":
        k = len(node_ranks)
        if node_ranks != list(range(node_ranks[0], node_ranks[0] + k)) or node_ranks[0] % k:
            raise ValueError(f"shard_group_size='node': this node holds ranks {node_ranks}, "
                             "not a block of consecutive ranks starting at a multiple of its "
                             "size: place ranks by node (mpiexec -ppn K, srun "
                             "--distribution=block) or pass an integer")
        value = k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or size % value:
        raise ValueError(f"shard_group_size={value!r} must divide the {size} ranks (or be None "
                         "for all of them, or 'node')")
    if value == 1 and size > 1:
        raise ValueError("shard_group_size=1 keeps the whole state on every rank (plain data "
                         "parallelism): use 2 or more")
    return value


def _check_layouts_agree(comm: Communicator, layout) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built one layout."""
    try:
        comm.check_same(layout.fingerprint, "the parameter layout", "")
    except CollectiveError:
        described = comm.allgather_objects(([(t.name, t.shape) for t in layout.tensors],
                                            ("param_dtype", layout.dtype)))
        mine = described[0]
        for other, theirs in enumerate(described):
            if theirs == mine:
                continue
            if len(theirs[0]) != len(mine[0]):
                diff = (f"{len(mine[0])} tensors", f"{len(theirs[0])} tensors")
            else:
                diff = next(((a, b) for a, b in zip(mine[0] + [mine[1]],
                                                    theirs[0] + [theirs[1]]) if a != b),
                            ("one grouping of the tensors", "another"))
            raise CollectiveError(
                f"ranks passed different parameters: rank 0 has {diff[0]}, rank {other} "
                f"has {diff[1]}: every rank must pass the same names, shapes and dtypes "
                "in the same order") from None
        raise
