"""The sharded engine: ZeRO stage 1 for any elementwise update rule (``zero1_mpi.rules``).

Every rank holds the full parameters and gradients (flat buffers; the model sees named views)
and fp32 master weights plus the rule's state arrays for its own shard only. ``step()`` reduces
the gradients to each rank's shard (in the gradient buffer itself), agrees on the global
gradient norm and on overflow in one small ``Allreduce``, runs the rule's fused kernel on the
owned shard (unscaling and clipping folded into its gradient factor) and all-gathers the
updated parameters. The engine owns buffers, buckets, readiness (``grads_ready``), reductions,
gathers, agreement, loss scaling, clipping and the sharded-state interface that checkpoints
use; it knows nothing of any rule's math.

The constructor and ``step()`` must be called on all ranks of the communicator. Input errors
are detected before the first collective and raised on every rank.
"""

from __future__ import annotations

import hashlib
import math
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from . import backend, checkpoint, export
from .comm import CollectiveError, Communicator
from .layout import DEFAULT_BUCKET_ELEMENTS, build_layout
from .memory import MemoryReport
from .params import check_arrays, check_max_grad_norm, check_reduce_dtype, normalize_groups
from .reductions import CupyReductions, NumpyReductions, resolve_cpu_kernel
from .scaler import LossScaler

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


class ShardedOptimizer:
    """An update rule with its state sharded over MPI ranks (ZeRO stage 1).

    Args:
        params: mapping name -> NumPy or CuPy array (initial values; rank 0's are broadcast),
            or a list of param groups ``{"params": {name: array}, <rule options>...}``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None), or a
            ``zero1_mpi.Communicator`` built from one.
        rule: the update rule (``zero1_mpi.rules``); ``defaults``: its options for the groups.
        param_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; default: the arrays' dtype.
        loss_scale: None (no scaling), a number (fixed), ``"dynamic"``, or a ``LossScaler``.
            The loss must be multiplied by ``opt.loss_scale`` before backward.
        max_grad_norm: clip the averaged gradient to this global L2 norm (None: no clipping).
        reduce_dtype: precision of the gradient sum over ranks. ``"float32"`` (default) sums
            in fp32: fp32 gradients with ``Reduce_scatter_block``, 16-bit ones exchanged with
            ``Alltoall`` and summed locally in fp32 in rank order (deterministic; MPI has no
            bf16 type).
            ``"float16"`` (float16 gradients only) sums in MPI's float16 reduction.
        bucket_elements: size of a communication bucket, in elements.
        cuda_aware: whether MPI takes GPU buffers; None asks the environment and MPI.
        shard_group_size: shard the state over groups of this many consecutive ranks and
            replicate it across the groups (None: all ranks, one group; ``"node"``: the ranks
            that share memory). The gradients are reduce-scattered within a group, the shard
            summed across the groups, and the parameters all-gathered within the group.
    """

    def __init__(self, params, comm, rule, defaults: dict, *, param_dtype=None,
                 loss_scale=None, max_grad_norm=None, reduce_dtype="float32",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, cuda_aware=None,
                 shard_group_size=None):
        if isinstance(comm, Communicator):
            if cuda_aware is not None:
                raise ValueError("cuda_aware= applies to a communicator this optimizer builds: "
                                 "pass it to the Communicator you built instead")
            self.comm = comm
        else:
            self.comm = Communicator(comm, cuda_aware=cuda_aware)
        size = self.comm.size
        # "node" asks MPI (a collective): only once every rank is known to ask.
        self.comm.check_same(repr(shard_group_size), "shard_group_size",
                             "pass the same shard_group_size on every rank")
        node = self.comm.node_ranks() if shard_group_size == "node" else None

        self.rule = rule
        error = None
        try:
            group_size = resolve_shard_group_size(shard_group_size, size, node, self.comm)
            settings = rule.settings()
            groups, arrays = normalize_groups(params, defaults, rule)
            dtype, backend_name = check_arrays(arrays, param_dtype)
            reduce_dtype = check_reduce_dtype(reduce_dtype, dtype)
            max_grad_norm = check_max_grad_norm(max_grad_norm)
            scaler = LossScaler.from_option(loss_scale)
            kernel = "cupy" if backend_name == "cupy" else resolve_cpu_kernel()
            layout = build_layout({name: tuple(a.shape) for name, a in arrays.items()},
                                  group_size, dtype.name, bucket_elements=bucket_elements,
                                  group_sizes=[len(g["names"]) for g in groups])
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
        self.comm.agree(error)
        self.comm.check_same(
            {**settings, "backend": backend_name,
             "param group options": [self._options(g) for g in groups],
             "reduce_dtype": reduce_dtype,
             "max_grad_norm": max_grad_norm, "loss_scale": scaler,
             "bucket_elements": bucket_elements, "shard_group_size": group_size},
            "an option", "construct the optimizer with the same arguments on every rank")
        _check_layouts_agree(self.comm, layout)
        #: Ranks per shard group (K), this rank's position in its group (which shard of each
        #: bucket it owns), and how many groups hold a replica of the state (N / K).
        self.shard_group_size, self.shard_rank = group_size, self.rank % group_size
        self.replicas, self._replica = size // group_size, self.rank // group_size
        # Collectives within the group (reduce-scatter, all-gather) and across the groups (the
        # sum of a shard over its replicas): the whole communicator when there is one group.
        self.shard_comm = self.comm if self.replicas == 1 else self.comm.split(self._replica)
        self.replica_comm = None if self.replicas == 1 else self.comm.split(self.shard_rank)

        self.layout = layout
        self.param_dtype = dtype
        self.reduce_dtype = reduce_dtype
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.param_groups = groups
        self.step_count = 0
        #: Host seconds of the last completed step by phase: reduce (the gradient reduction),
        #: agree (sum of squares + the one Allreduce), update (the kernel), gather (all-gather).
        #: CuPy work is asynchronous: there the phases are the host's, not the device's.
        self.last_step_seconds = {}
        self.backend = backend_name
        self.kernel = kernel
        with self.comm.abort_on_error("while allocating and broadcasting the parameters"):
            self._allocate(layout, dtype, backend_name)
            self._load_initial_values(arrays)

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

    def grads_ready(self, names) -> None:
        """Declare the gradients of ``names`` (a name or an iterable of names) final for this
        step, so that communication starts during the backward pass: each bucket's reduction
        starts as soon as all its tensors are ready and every later bucket has started (the
        buckets go last to first, the order of a backward pass, the same on every rank).
        Optional: ``step()`` starts whatever has not started. Must be called on all ranks,
        with the same names before each ``step()``; do not write those gradients again before
        ``step()`` (MPI may be reading them).
        """
        names = [names] if isinstance(names, str) else list(names)
        for name in names:  # a usage error: raised before any collective starts
            if name not in self._tensor_buckets:
                raise KeyError(f"grads_ready({name!r}): no parameter of that name")
            if name in self._ready:
                raise ValueError(f"grads_ready({name!r}) again before step(): its reduction may "
                                 "have started, so later gradients would be lost; accumulate "
                                 "first, then call grads_ready once per step")
        with self.comm.abort_on_error("in grads_ready()"):
            for name in names:
                self._ready.add(name)
                for index in self._tensor_buckets[name]:
                    self._waiting[index] -= 1
            while self._next_start >= 0 and self._waiting[self._next_start] <= 0:
                self._start_reduction(self._next_start)
            for request, _ in self._started.values():
                request.test()  # let MPI progress what is in flight
            for request in self._across.values():
                request.test()

    def wait(self) -> None:
        """Complete the all-gathers that ``step(wait=False)`` left in flight. Reading
        ``opt.params[...]`` calls this; call it yourself before reading views kept elsewhere
        (for example a model's tensors that share the buffer)."""
        if self._gathers:
            with self.comm.abort_on_error("while gathering the parameters"):
                for request in self._gathers:
                    request.wait()
            self._gathers.clear()

    def zero_grad(self) -> None:
        """Set every gradient to zero (``step()`` also leaves them zeroed). Reductions that
        ``grads_ready`` started for this step are completed and forgotten first."""
        if self._started or self._reduced:
            with self.comm.abort_on_error("in zero_grad() while completing reductions"):
                for request, _ in self._started.values():
                    request.wait()
                for request in self._across.values():
                    request.wait()
            self._new_round()
        self._grads.fill(0)

    def step(self, wait: bool = True) -> StepInfo:
        """Average the gradients over ranks, update the owned shard, gather the parameters.

        With ``wait=False`` the all-gathers are left in flight until the parameters are next
        read (see ``wait()``). Must be called on all ranks. Consumes the gradients: the
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
            while self._next_start >= 0:
                self._start_reduction(self._next_start)
            reduced = [self._finish_reduction(b.index) for b in self.layout.buckets]
            for request in self._across.values():  # the sums across the groups, in flight
                request.wait()
            self._new_round()
            reduced_at = clock()
            # Replicas hold the same sums: the norm counts one of them.
            sum_sq = float(sum(self._reductions.sum_of_squares(r) for r in reduced)) \
                if self._replica == 0 else 0.0
            # One Allreduce: the norm (inf/nan if any rank overflowed), whether any rank found
            # a bad option, and whether all ranks hold the same options (sum h and sum h^2).
            totals = [sum_sq, 1.0 if group_error else 0.0, options, options * options]
            if self.world_size > 1:
                totals = self.comm.allreduce_sum(totals)
        agreed_at = clock()
        if totals[1]:
            self.zero_grad()
            self.comm.agree(group_error)
        if self.world_size * int(totals[3]) != int(totals[2]) ** 2:
            self.zero_grad()
            raise CollectiveError(f"param_groups options ({', '.join(self.rule.options)}) "
                                  "differ between ranks: set them to the same values on every "
                                  "rank (nothing was updated)")

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
            return StepInfo(grad_norm, True, scale, 1.0, self.step_count)

        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (grad_norm + CLIP_EPS))
        factor = clip / (self.world_size * scale)
        update = gather = 0.0
        with self.comm.abort_on_error("in step() while updating the parameters"):
            scalars = [self.rule.scalars(self.step_count + 1, self._options(g, dict), factor)
                       for g in self.param_groups]
            if self._tensor_sums:  # a two-phase rule: per-tensor sums first, then the update
                t0 = clock()
                scalars = self._per_tensor_scalars(reduced, scalars)
                update += clock() - t0
            for bucket, grads in zip(self.layout.buckets, reduced):
                t0 = clock()
                if self._tensor_sums:
                    self._apply_shard(bucket, scalars)
                else:
                    self._update_shard(bucket, grads, scalars)
                t1 = clock()
                self._gathers.append(self.shard_comm.start_allgather(
                    self._params[bucket.offset:bucket.offset + bucket.size]))
                update, gather = update + t1 - t0, gather + clock() - t1
            self.zero_grad()
        if wait:
            t0 = clock()
            self.wait()
            gather += clock() - t0
        self.last_step_seconds = {"reduce": reduced_at - started, "agree": agreed_at - reduced_at,
                                  "update": update, "gather": gather}
        self.step_count += 1
        self.scaler = self.scaler.update(overflow=False)
        return StepInfo(grad_norm, False, scale, clip, self.step_count)

    def shard_state(self, lo: int, hi: int, state: int) -> dict:
        """This rank's state over the flat parameter range ``[lo, hi)``, a range it owns that
        starts at ``state`` in its shard arrays (``layout.owned(shard_rank)`` lists them): views by
        name, ``"master"`` (fp32 parameters; for fp32 parameters the parameter buffer itself),
        each of the rule's ``state_names``, and for 16-bit parameters ``"param"``. Writing into
        them changes the optimizer; call ``gather_params()`` afterwards on all ranks."""
        s = slice(state, state + hi - lo)
        views = {"master": self._master[s] if self._mixed else self._params[lo:hi],
                 **{name: state[s] for name, state in self._state.items()}}
        if self._mixed:
            views["param"] = self._params[lo:hi]
        return views

    def gather_params(self) -> None:
        """All-gather every bucket of the parameters, blocking (after writing shard_state()).
        Must be called on all ranks."""
        for bucket in self.layout.buckets:
            self.shard_comm.allgather_inplace(
                self._params[bucket.offset:bucket.offset + bucket.size])

    def save(self, path, keep: int | None = None):
        """Write a sharded checkpoint under the directory ``path`` (each rank writes its own
        shard; the previous checkpoint stays loadable until this one is complete); keep the
        newest ``keep`` checkpoints there (None: all). Must be called on all ranks. Returns
        the new checkpoint's directory."""
        self.wait()
        return checkpoint.save(self, path, keep)

    def load(self, path):
        """Load the checkpoint at ``path`` (the directory given to ``save``, or one checkpoint
        in it), saved at any world size. Must be called on all ranks. Nothing changes if the
        checkpoint is bad: the error is raised on every rank."""
        self.wait()
        return checkpoint.load(self, path)

    def save_consolidated(self, path):
        """Write the full fp32 master weights and the rule's state, by parameter name, to one
        safetensors file, streaming through rank 0. Must be called on all ranks."""
        self.wait()
        return export.save_consolidated(self, path)

    def load_consolidated(self, path):
        """Load a file written by ``save_consolidated``, at any world size. Must be called
        on all ranks."""
        self.wait()
        return export.load_consolidated(self, path)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category, measured from the arrays it allocated."""
        layout, psi = self.layout, self.layout.numel
        owned = layout.owned_real(self.shard_rank)
        arrays = [self._master, *self._state.values()]
        held = self._params.nbytes + self._grads.nbytes + sum(a.nbytes for a in arrays
                                                              if a is not None)
        state = {name: owned * FP32.itemsize for name in self._state}
        real = {"parameters": psi * self.param_dtype.itemsize,
                "gradients": psi * self.param_dtype.itemsize,
                "master_weights": owned * FP32.itemsize if self._mixed else 0}
        scratch = (0 if self._received is None else self._received.nbytes) \
            + self.comm.staging_bytes + self._kernel.scratch_bytes \
            + self._reductions.scratch_bytes
        return MemoryReport(**real, state=state,
                            padding=held - sum(real.values()) - sum(state.values()),
                            comm_scratch=scratch, psi=psi, world_size=self.shard_group_size,
                            rank=self.shard_rank, param_dtype=self.param_dtype.name,
                            rule=self.rule.name)

    # -- internals ---------------------------------------------------------------------------

    def _allocate(self, layout, dtype, backend_name) -> None:
        xp = self._xp = backend.xp_for(backend_name)
        self._params = backend.zeros(xp, layout.total, dtype)  # 64-byte aligned on the host
        self._grads = backend.zeros(xp, layout.total, dtype)
        shard = layout.shard_total
        self._mixed = dtype != FP32
        self._master = xp.zeros(shard, FP32) if self._mixed else None
        self._state = {name: xp.zeros(shard, FP32) for name in self.rule.state_names}
        self.params = _Views(self._views(self._params), before_read=self.wait)
        self.grads = _Views(self._views(self._grads))
        self._exchange_16bit = (self._mixed and self.reduce_dtype == "float32"
                                and self.shard_group_size > 1)
        # 16-bit exchanges land in receive slots; two let one bucket's sum run while the next
        # bucket's exchange is in flight.
        slots = min(2, len(layout.buckets)) if self._exchange_16bit else 0
        self._received = xp.empty((slots, max(b.size for b in layout.buckets)), dtype) \
            if slots else None
        self._tensor_buckets = {t.name: [b.index for b in layout.buckets
                                         if b.offset < t.offset + t.numel
                                         and t.offset < b.offset + b.used]
                                for t in layout.tensors}
        self._bucket_tensors = [sum(b.index in ids for ids in self._tensor_buckets.values())
                                for b in layout.buckets]
        self._gathers = []
        self._new_round()
        # Persistent requests hold these buffers: free them when the optimizer goes.
        weakref.finalize(self, self.shard_comm.close,
                         [self._params, self._grads, self._received])
        largest = max(b.shard_size for b in layout.buckets)
        self._kernel = self.rule.kernel(self.kernel, largest)
        self._tensor_sums = getattr(self.rule, "tensor_sums", 0)
        self._pieces = [self._tensor_pieces(b) for b in layout.buckets] \
            if self._tensor_sums else None
        self._reductions = _reductions(self.kernel, largest)

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
                lo, hi = bucket.shard(self.shard_rank)
                self._master[bucket.state] = target[lo - bucket.offset:hi - bucket.offset]

    def _check_param_groups(self) -> tuple[str | None, int]:
        """``(problem, digest)``: a message if a group's options were set to invalid values
        since the last step, and a 20-bit digest of all options, to compare across ranks."""
        problem = None
        for index, group in enumerate(self.param_groups):
            try:  # valid options are stored back as plain floats (NumPy scalars are accepted)
                group.update(self.rule.check_options(**self._options(group, dict)))
            except Exception as exc:  # noqa: BLE001 - reported on every rank by step()
                problem = problem or f"param_groups[{index}]: {exc}"
        text = repr([self._options(g) for g in self.param_groups]).encode()
        return problem, int(hashlib.sha256(text).hexdigest()[:5], 16)

    def _new_round(self) -> None:
        """Forget the last step's readiness: no bucket started, every tensor pending."""
        self._ready = set()
        self._waiting = list(self._bucket_tensors)
        self._next_start = len(self.layout.buckets) - 1
        self._started = {}    # bucket index -> (request, receive slot or None)
        self._reduced = {}    # bucket index -> this rank's summed shard, once finished
        self._across = {}     # bucket index -> its sum across the shard groups, in flight
        self._slot_owner = [None] * (0 if self._received is None else len(self._received))

    def _start_reduction(self, index: int) -> None:
        """Start summing bucket ``index``'s gradients over ranks (in place, see below)."""
        bucket = self.layout.buckets[index]
        grads = self._grads[bucket.offset:bucket.offset + bucket.size]
        self._next_start = index - 1
        if self.shard_group_size == 1:
            self._reduced[index] = grads
        elif not self._exchange_16bit:
            self._started[index] = (self.shard_comm.start_reduce_scatter(grads), None)
        else:
            slot = index % len(self._received)
            if self._slot_owner[slot] is not None:
                self._finish_reduction(self._slot_owner[slot])
            self._slot_owner[slot] = index
            received = self._received[slot, :bucket.size]
            self._started[index] = (self.shard_comm.start_alltoall(grads, received), slot)

    def _finish_reduction(self, index: int):
        """This rank's shard of bucket ``index``'s gradients, summed over ranks.

        The sum lives at the start of the bucket's range of the gradient buffer: the gradients
        there have been sent by then, so the sum needs no buffer of its own.
        """
        if index in self._reduced:
            return self._reduced[index]
        request, slot = self._started.pop(index)
        request.wait()
        bucket = self.layout.buckets[index]
        grads = self._grads[bucket.offset:bucket.offset + bucket.size]
        if slot is None:
            reduced = self.shard_comm.reduced_block(grads)
        else:
            reduced = grads.view(FP32)[:bucket.shard_size]  # 2 x size bytes >= 4 x size / K
            blocks = self._received[slot, :bucket.size].reshape(self.shard_group_size, -1)
            self._reductions.sum_blocks(blocks, reduced)
            self._slot_owner[slot] = None
        if self.replicas > 1:  # the group's sum, summed over the groups that replicate it
            self._across[index] = self.replica_comm.start_allreduce(reduced)
        self._reduced[index] = reduced
        return reduced

    def _update_shard(self, bucket, grads, scalars) -> None:
        """The fused kernel over this rank's shard of ``bucket``, one launch per param group."""
        lo, hi = bucket.shard(self.shard_rank)
        for (group_lo, group_hi), s in zip(self.layout.groups, scalars):
            a, b = max(lo, group_lo) - lo, min(hi, group_hi) - lo
            if a < b:
                master, states, param = self._shard_arrays(bucket, a, b)
                self._kernel(grads[a:b], master, *states, param, s)

    def _tensor_pieces(self, bucket) -> list[tuple[int, int, int, int]]:
        """``(tensor index, group index, a, b)`` for each piece ``[a, b)`` of a tensor in this
        rank's shard of ``bucket`` (positions within the shard; padding left out)."""
        lo, hi = bucket.shard(self.shard_rank)
        starts = [group_lo for group_lo, _ in self.layout.groups]
        pieces = []
        for index, t in enumerate(self.layout.tensors):
            a, b = max(lo, t.offset), min(hi, t.offset + t.numel)
            if a < b:
                group = sum(start <= t.offset for start in starts) - 1
                pieces.append((index, group, a - lo, b - lo))
        return pieces

    def _shard_arrays(self, bucket, a: int, b: int) -> tuple:
        """``(master, states, param or None)`` over ``[a, b)`` of this rank's shard of
        ``bucket``; for fp32 parameters the master is the parameter range itself."""
        lo, _ = bucket.shard(self.shard_rank)
        st = slice(bucket.state.start + a, bucket.state.start + b)
        states = [state[st] for state in self._state.values()]
        if self._mixed:
            return self._master[st], states, self._params[lo + a:lo + b]
        return self._params[lo + a:lo + b], states, None

    def _per_tensor_scalars(self, reduced, scalars) -> dict:
        """Phase one of a two-phase rule: the kernel's partial sums over each tensor piece
        this rank owns (updating the rule's state), added per tensor, summed over ranks in
        one ``Allreduce``; returns the scalars (``rule.tensor_scalars``) of each tensor this
        rank owns a piece of, by tensor index."""
        sums = self._xp.zeros((len(self.layout.tensors), self._tensor_sums), np.float64)
        for bucket, grads, pieces in zip(self.layout.buckets, reduced, self._pieces):
            for index, group, a, b in pieces:
                master, states, _ = self._shard_arrays(bucket, a, b)
                sums[index] += self._kernel.tensor_sums(grads[a:b], master, *states,
                                                        scalars[group])
        totals = backend.to_numpy(sums)
        if self.shard_group_size > 1:  # the group's shards cover every tensor once
            totals = self.shard_comm.allreduce_sum(totals)
        return {index: self.rule.tensor_scalars(scalars[group], totals[index])
                for pieces in self._pieces for index, group, _, _ in pieces}

    def _apply_shard(self, bucket, tensor_scalars) -> None:
        """Phase two of a two-phase rule over this rank's shard of ``bucket``."""
        for index, _, a, b in self._pieces[bucket.index]:
            master, states, param = self._shard_arrays(bucket, a, b)
            self._kernel.apply(master, *states, param, tensor_scalars[index])

    def _options(self, group: dict, kind=list):
        """A group's rule options, as a list of (key, value) pairs or as a dict."""
        pairs = [(key, group.get(key)) for key in self.rule.options]
        return dict(pairs) if kind is dict else pairs


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


def resolve_shard_group_size(value, size: int, node_ranks, comm) -> int:
    """K, the ranks per shard group, for ``shard_group_size=value`` on ``size`` ranks
    (``node_ranks``: the ranks sharing this rank's node, for ``"node"``), or a ValueError
    naming the value and the fix."""
    if value is None:
        return size
    if type(comm) is not Communicator and value != size:
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


def _reductions(kind: str, largest: int):
    """The engine's reductions for the kernel family ``kind``: cupy, numba or numpy."""
    if kind == "cupy":
        return CupyReductions()
    if kind == "numba":
        from .kernels_numba import NumbaReductions
        return NumbaReductions(largest)
    return NumpyReductions(largest)


def _check_layouts_agree(comm: Communicator, layout) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built one layout."""
    try:
        comm.check_same(layout.fingerprint, "the parameter layout", "")
    except CollectiveError:
        described = comm.comm.allgather(([(t.name, t.shape) for t in layout.tensors],
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
