"""The sharded state: this rank's full copy of the parameters, and for its own shard the master
weights (``masters.py`` keeps them) and the rule's state, with the kernel that updates them.

``ShardedState`` keeps the shard with the parameters (the device, or the host for NumPy);
``HostState`` (``offload="cpu"``) keeps it on the host, updated there with ``offload``'s copies and
threaded kernel; ``sharded_state`` builds the one the options ask for. Their interface is all the
rest of the package sees: ``params`` (views by name), ``rows``, ``views`` and ``write`` (what
checkpoints and exports read and write, then ``publish()``), ``seed(arrays)`` (rank 0's initial
values), ``update(reduced, scalars, step)`` (the rule's kernel over the shard, each bucket's
all-gather started as its new shard lands in the parameter buffer) and ``wait()`` for those gathers.
It knows no rule's math. Methods that start or complete collectives: all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import backend
from .gathers import ParamGathers, param_gathers
from .masters import Fp32Masters, masters_for
from .offload import HostShard, ThreadedKernel, each_tensor_sums
from .reductions import resolve_cpu_kernel
from .state_dtypes import MIN_8BIT_SIZE, Fp32State, state_for
from .views import Views

__all__ = ["ShardedState", "HostState", "sharded_state", "FP32"]

FP32 = np.dtype(np.float32)


class ShardedState:
    """The parameters and this rank's shard of the optimizer state, kept with the parameters.

    Args:
        layout, topology: the flat layout and the shard groups (``topology.Topology``).
        rule: the update rule (``zero1_mpi.rule.Rule``); its kernel runs here.
        dtype, xp: the parameters' dtype and array module (NumPy or CuPy).
        watch: the ``Watchdog`` told where this rank waits.
        before_read: called before a parameter view is handed out (completes the gathers).
    """

    #: Where the master weights and the rule's state live: with the parameters.
    on_host = False

    def __init__(self, layout, topology, rule, dtype, xp, watch, before_read=None, options=None):
        self.layout, self.topology, self.rule, self.dtype = layout, topology, rule, dtype
        self.shard_rank, self.watch, self._xp = topology.shard_rank, watch, xp
        self.mixed = dtype != FP32
        self.masters_kind = "fp32" if options is None else options.masters
        self.state_dtype = "float32" if options is None else options.state_dtype
        #: The flat parameter buffer (every rank's full copy); ``params``: its views by name.
        self.flat = backend.zeros(xp, layout.total, dtype)  # 64-byte aligned on the host
        self.params: Mapping = Views(layout, self.flat, before_read)
        largest = max(b.shard_size for b in layout.buckets)
        #: Each bucket's tensor pieces on this rank: ``(tensor, group, a, b)``, ``[a, b)`` in
        #: the bucket's shard; a two-phase rule's calls, and the 8-bit state's segments.
        self._pieces = [layout.tensor_pieces(b, self.shard_rank) for b in layout.buckets]
        #: Each bucket's elementwise kernel calls: ``(param group, a, b)``, per group, or per
        #: tensor piece for the 8-bit state (whose blocks start at each piece).
        self._ranges = [
            [(g, a, b) for _, g, a, b in pieces]
            if self.state_dtype == "int8"
            else [(g, *self._group_range(bucket, g)) for g in range(len(layout.groups))]
            for bucket, pieces in zip(layout.buckets, self._pieces)
        ]
        self._allocate(layout.shard_total, largest)
        #: The most elements one kernel call takes (remainder masters: a cache-sized chunk).
        kept = [self.masters, *self.stored.values()]
        self._chunk = max(1, min([largest] + [k.chunk for k in kept if k is not None]))
        self._step = 0  # the step being updated (stochastic rounding draws by it)
        self.gathers: ParamGathers = (
            ParamGathers(layout, self.flat, topology.shard_comm, watch)
            if options is None
            else param_gathers(
                options, layout, self.flat, topology.shard_comm, watch, xp, self.kernel_kind
            )
        )

    def _allocate(self, n: int, largest: int) -> None:
        """The shard's arrays (the masters for 16-bit parameters, as ``masters_kind`` says; for
        fp32 ones the parameter buffer's own range is the master) and the kernel."""
        xp, tensors = self._xp, self.layout.tensors
        self.kernel_kind = "cupy" if xp is not np else resolve_cpu_kernel()
        self.masters: Any = (
            masters_for(
                self.masters_kind, n, largest, xp, self.kernel_kind, self.rule.tensor_sums > 0
            )
            if self.mixed
            else None
        )
        whole = self.rule.tensor_sums > 0
        segments = [
            (bucket.state.start + a, bucket.state.start + b, tensors[t].numel >= MIN_8BIT_SIZE)
            for bucket, pieces in zip(self.layout.buckets, self._pieces)
            for t, _, a, b in pieces
        ]
        self.stored: dict = {
            name: state_for(self.state_dtype, n, largest, xp, self.kernel_kind, i, whole, segments)
            for i, name in enumerate(self.rule.state_names)
        }
        self.state = {name: kept.held for name, kept in self.stored.items()}
        self.kernel = self.rule.kernel(self.kernel_kind, largest)

    # -- what checkpoints and exports read and write -------------------------------------------

    @property
    def rows(self) -> tuple[str, ...]:
        """The names of the views ``views`` gives, in order: ``"master"``, the rule's
        ``state_names``, and for 16-bit parameters ``"param"`` (what checkpoints store)."""
        return ("master", *self.rule.state_names) + (("param",) if self.mixed else ())

    @property
    def writes(self) -> bool:
        """Whether this rank writes its shard to a checkpoint (the first shard group does)."""
        return self.topology.replica == 0

    def views(self, lo: int, hi: int, state: int, names=None) -> dict:
        """This rank's state over the flat range ``[lo, hi)``, a range it owns that starts at
        ``state`` in its shard arrays (``layout.owned(shard_rank)`` lists them): by name for
        each of ``rows`` (or of ``names``), an fp32 array (a view, or a copy decoded where a
        row is kept otherwise) or the 16-bit ``param``. ``write`` changes them, then
        ``publish()``."""
        s, param = slice(state, state + hi - lo), self.flat[lo:hi]
        views = {}
        for name in self.rows if names is None else names:
            if name == "param":
                views[name] = param
            elif name == "master":
                views[name] = param if self.masters is None else self.masters.read(s, param)
            else:
                views[name] = self.stored[name].read(s)
        return views

    def write(self, lo: int, hi: int, state: int, values: dict) -> None:
        """Set the rows of ``values`` (by name, fp32 or wider values) over ``[lo, hi)`` as
        ``views`` names them; with ``"master"`` and no ``"param"``, the 16-bit parameters
        become the masters rounded (remainder masters always round them). Exact casts;
        ``publish()`` after."""
        s, param = slice(state, state + hi - lo), self.flat[lo:hi]
        for name, value in values.items():
            if name in self.stored:
                self.stored[name].write(s, value)
        if "master" not in values:
            return
        if self.masters is None:  # fp32 parameters: the parameter is the master
            param[...] = backend.like(param, values["master"])
            return
        self.masters.write(s, values["master"], param if self.mixed else None, values.get("param"))

    def publish(self) -> None:
        """All-gather the parameters, blocking, after ``views`` were written; all ranks."""
        self.gathers.gather_all()

    def seed(self, arrays: dict) -> None:
        """Broadcast rank 0's ``arrays`` (by name) into the parameters, bucket by bucket; fp32
        (or wider) values seed the fp32 masters at full precision. All ranks."""
        xp, layout, comm = self._xp, self.layout, self.topology.comm
        staging = xp.zeros(max(b.size for b in layout.buckets), FP32) if self.mixed else None
        for bucket in layout.buckets:
            span = slice(bucket.offset, bucket.offset + bucket.size)
            target = self.flat[span] if staging is None else staging[: bucket.size]
            target[bucket.used :] = 0  # the padding (the reused staging held the last bucket)
            if comm.rank == 0:
                for t, lo, hi in layout.pieces(bucket.offset, bucket.offset + bucket.size):
                    values = xp.asarray(arrays[t.name]).reshape(-1)
                    target[lo - bucket.offset : hi - bucket.offset] = values[
                        lo - t.offset : hi - t.offset
                    ]
            comm.bcast(target)
            if self.mixed:
                self.flat[span] = target.astype(self.dtype)
            if self.masters is not None:
                lo, hi = bucket.shard(self.shard_rank)
                piece = target[lo - bucket.offset : hi - bucket.offset]
                param = self.flat[lo:hi] if self.mixed else None  # (rounded above: again)
                self.masters.write(bucket.state, piece, param)

    # -- the update ------------------------------------------------------------------------------

    def update(self, reduced: list, scalars: list, step: int) -> tuple[float, float]:
        """Run the rule's kernel over this rank's shard of every bucket (``reduced``: the
        summed gradient shards; ``scalars``: each param group's, for ``step``), starting each
        bucket's all-gather as its new shard lands. Returns the seconds spent updating and
        starting gathers. A two-phase rule first sums over each tensor (one Allreduce)."""
        clock, update = time.perf_counter, 0.0
        self._step = step
        shards: list | None = reduced  # None: a second phase reads no gradients
        kernel_scalars: list | dict = scalars  # a two-phase rule's: by tensor
        if self.rule.tensor_sums:
            t0 = clock()
            kernel_scalars = self._per_tensor_scalars(self._inputs(reduced), scalars, step)
            update, shards = clock() - t0, None
        gather, t0 = 0.0, clock()  # (offloaded, the wait for a gradient's copy is update's)
        for bucket, grads in self._inputs(shards):
            self.watch.bucket = bucket.index
            self._update_bucket(bucket, grads, kernel_scalars)
            t1 = clock()
            for index in self._landed(bucket):
                self.gathers.start(index)
            t2 = clock()
            update, gather, t0 = update + t1 - t0, gather + t2 - t1, t2
        for index in self._landed(None):
            self.gathers.start(index)
        return update, gather + clock() - t0

    def scratch_bytes(self) -> tuple[int, int]:
        """Bytes held for the update beside the arrays: ``(with the parameters, on the host)``."""
        kept = sum(k.scratch_bytes for k in (self.masters, *self.stored.values()) if k is not None)
        return self.kernel.scratch_bytes + self.gathers.scratch_bytes + kept, 0

    def wait(self) -> None:
        """Complete the all-gathers in flight."""
        self.gathers.wait()

    def close(self) -> None:
        """Complete the gathers in flight and free what they hold; idempotent; all ranks."""
        self.gathers.close()

    # -- where the shard lives: HostState overrides these -----------------------------------------

    def _inputs(self, reduced):
        """``(bucket, its reduced gradient shard where the kernel reads it)`` in bucket order;
        for ``reduced`` None, ``(bucket, None)`` (a second phase reads no gradients)."""
        if reduced is None:
            return ((bucket, None) for bucket in self.layout.buckets)
        return zip(self.layout.buckets, reduced)

    def _landed(self, bucket) -> list[int]:
        """The buckets whose new shard is in the parameter buffer once ``bucket``'s update is
        done (None: after the last), so that their all-gathers may start."""
        return [] if bucket is None else [bucket.index]

    def _arrays(self, bucket, a: int, b: int, at: int = 0) -> tuple:
        """``(master, states, param or None)`` over ``[a, b)`` of this rank's shard of
        ``bucket``, where the kernel updates them (``_stored`` after); for fp32 parameters the
        master is the parameter range itself. ``at``: where decoded masters go in the
        scratch (ranges used together: apart)."""
        lo, _ = bucket.shard(self.shard_rank)
        st = slice(bucket.state.start + a, bucket.state.start + b)
        states = [kept.load(st, at) for kept in self.stored.values()]
        if self.mixed:
            master = self.masters.load(st, at, self.flat[lo + a : lo + b])
            return master, states, self.gathers.target(bucket)[a:b]
        return self.flat[lo + a : lo + b], states, None

    def _stored(self, bucket, a: int, b: int, master, param, states=None) -> None:
        """Keep what the kernel wrote over ``[a, b)`` of ``bucket`` (``_arrays``' arrays; the
        ``states`` where it wrote them)."""
        st = slice(bucket.state.start + a, bucket.state.start + b)
        if param is not None:
            self.masters.store(st, master, param)
        if states is not None:
            flat = bucket.shard(self.shard_rank)[0] + a
            for kept, values in zip(self.stored.values(), states):
                kept.store(st, values, flat, self._step)

    # -- internals ---------------------------------------------------------------------------

    def _update_bucket(self, bucket, grads, scalars) -> None:
        """Update this rank's shard of ``bucket``: per param group, or per tensor piece (a
        two-phase rule; the 8-bit state, whose blocks start at each piece)."""
        if self.rule.tensor_sums:
            for index, _, a, b in self._pieces[bucket.index]:
                for c, d in self._calls(a, b):
                    master, states, param = self._arrays(bucket, c, d)
                    self.kernel.apply(master, *states, param, scalars[index])
                    self._stored(bucket, c, d, master, param)
            return
        for group, a, b in self._ranges[bucket.index]:
            for c, d in self._calls(a, b):
                master, states, param = self._arrays(bucket, c, d)
                self.kernel(grads[c:d], master, *states, param, scalars[group])
                self._stored(bucket, c, d, master, param, states)

    def _group_range(self, bucket, group: int) -> tuple[int, int]:
        """``[a, b)``: param group ``group``'s part of this rank's shard of ``bucket`` (empty:
        ``a >= b``)."""
        lo, hi = bucket.shard(self.shard_rank)
        group_lo, group_hi = self.layout.groups[group]
        return max(lo, group_lo) - lo, min(hi, group_hi) - lo

    def _calls(self, a: int, b: int):
        """``[a, b)`` cut into the ranges of one elementwise kernel call each (the bits do
        not depend on the cut)."""
        return ((c, min(b, c + self._chunk)) for c in range(a, b, self._chunk))

    def _per_tensor_scalars(self, shards, scalars, step: int) -> dict:
        """Phase one of a two-phase rule: the kernel's partial sums over each tensor piece
        this rank owns (updating the rule's state), added per tensor, summed over the group in
        one ``Allreduce``; returns the scalars (``rule.tensor_scalars``) of each tensor this
        rank owns a piece of, by tensor index. ``shards``: as ``_inputs`` gives them."""
        xp = np if self.on_host else self._xp
        all_pieces = self._pieces
        sums = xp.zeros((len(self.layout.tensors), self.rule.tensor_sums), np.float64)
        for (bucket, grads), pieces in zip(shards, all_pieces):
            calls = []
            for _, group, a, b in pieces:
                master, states, _ = self._arrays(bucket, a, b, at=a)  # whole: one sum a piece
                calls.append((grads[a:b], master, *states, scalars[group]))
            for (index, _, a, b), partial, call in zip(
                pieces, each_tensor_sums(self.kernel, calls), calls
            ):
                sums[index] += partial
                self._stored(bucket, a, b, None, None, call[2:-1])  # the state it updated
        totals = backend.to_numpy(sums)
        if self.topology.group_size > 1:  # the group's shards cover every tensor once
            self.watch.arm(step, "update")
            totals = self.topology.shard_comm.allreduce_sum(totals)
            self.watch.disarm()
        return {
            index: self.rule.tensor_scalars(scalars[group], totals[index])
            for pieces in all_pieces
            for index, group, _, _ in pieces
        }


class HostState(ShardedState):
    """``ShardedState`` with the master weights and the rule's state on the host (ZeRO-Offload):
    each bucket's reduced gradient shard is copied to the host, updated there by ``threads``
    threads of the CPU kernel, and its new parameter shard copied back, the copies of
    neighbouring buckets overlapping the kernel (``offload.HostShard``)."""

    on_host = True

    def __init__(self, layout, topology, rule, dtype, xp, watch, before_read=None, *, threads: int):
        self._threads = threads  # (gather_dtype is refused with offload: plain gathers)
        super().__init__(layout, topology, rule, dtype, xp, watch, before_read)

    def _allocate(self, n: int, largest: int) -> None:
        self.kernel_kind = resolve_cpu_kernel()
        #: The host arrays and the copies between them and the device (``offload.HostShard``).
        self.copies = HostShard(
            self.layout, self.shard_rank, self.flat, self.rule.state_names, self.mixed
        )
        self.masters, self.state = Fp32Masters(self.copies.master), self.copies.state
        self.stored = {name: Fp32State(array) for name, array in self.state.items()}
        self.kernel = ThreadedKernel(
            lambda: self.rule.kernel(self.kernel_kind, largest), self._threads
        )

    def publish(self) -> None:
        self.gathers.wait()  # they write the buffer the masters are copied into
        if not self.mixed:  # the host masters are the parameters: to the device first
            self.copies.push_all()
        self.gathers.gather_all()

    def close(self) -> None:
        self.kernel.close()
        super().close()

    def scratch_bytes(self) -> tuple[int, int]:
        return 0, self.copies.scratch_bytes + self.kernel.scratch_bytes

    def _inputs(self, reduced):
        return super()._inputs(None) if reduced is None else self.copies.fetched(reduced)

    def _landed(self, bucket) -> list[int]:
        return self.copies.drain() if bucket is None else self.copies.push(bucket)

    def _arrays(self, bucket, a: int, b: int, at: int = 0) -> tuple:
        """The host arrays; the kernel's 16-bit output goes to the host copy that ``push``
        sends (fp32: the host master itself is sent)."""
        st = slice(bucket.state.start + a, bucket.state.start + b)
        params16 = self.copies.params16
        return (
            self.masters.array[st],
            [state[st] for state in self.state.values()],
            None if params16 is None else params16[st],
        )


def sharded_state(options, layout, topology, rule, xp, watch, before_read) -> ShardedState:
    """The sharded state of the checked ``options`` (``options.EngineOptions``)."""
    if options.offload is not None:
        return HostState(
            layout,
            topology,
            rule,
            options.param_dtype,
            xp,
            watch,
            before_read,
            threads=options.offload_threads,
        )
    return ShardedState(
        layout, topology, rule, options.param_dtype, xp, watch, before_read, options
    )
