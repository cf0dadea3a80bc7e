"""The sharded state: this rank's full copy of the parameters, and for its own shard the master
weights (``masters.py`` keeps them) and the rule's state, with the kernel that updates them.

``ShardedState`` keeps the shard with the parameters (the device, or the host for NumPy);
``HostState`` (``offload="cpu"``) keeps the share ``offload_fraction`` on the host, updated there
with ``offload``'s copies and threaded kernel; ``sharded_state`` builds one. Their interface is
all the rest of the package sees: ``params`` (views by name), ``rows``, ``views`` and ``write``
(what checkpoints and exports read and write, then ``publish()``), ``seed(arrays)`` (rank 0's
initial values), ``update(reduced, scalars, step)`` (the rule's kernel over each of ``parts``,
each bucket's all-gather started as its new shard lands in the parameter buffer) and ``wait()``
for those gathers. It knows no rule's math. Methods that start or complete collectives: all ranks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..flat.views import Views
from ..kernels import backend
from ..wire.param_gathers import ParamGathers, param_gathers
from .encodings import MIN_8BIT_SIZE, state_for
from .host import (
    DeviceHostRow,
    HostShard,
    ParamsAsMasters,
    ThreadedKernel,
    each_tensor_sums,
    host_start,
    keeps_host_share,
)
from .masters import Fp32Masters, masters_for

__all__ = ["ShardedState", "HostState", "ShardRange", "sharded_state", "FP32"]

FP32 = np.dtype(np.float32)


@dataclass(frozen=True)
class ShardRange:
    """``[a, b)`` of this rank's shard of ``bucket``, updated in one place (``on_host``);
    ``index``: its place in ``ShardedState.parts``."""

    bucket: Any
    a: int
    b: int
    index: int
    on_host: bool = False


class ShardedState:
    """The parameters and this rank's shard of the optimizer state, kept with the parameters.

    Args:
        layout, topology: the flat layout and the shard groups (``topology.Topology``).
        rule: the update rule (``zero1_mpi.rules.protocol.Rule``); its kernel runs here.
        xp: the parameters' array module (NumPy or CuPy).
        watch: the ``Watchdog`` told where this rank waits.
        before_read: called before a parameter view is handed out (completes the gathers).
        options: the checked ``EngineOptions`` (dtype, masters, state encoding, gathers,
            offload); ``kernels``: the ``KernelFamilies`` that run the update.
    """

    #: Where the master weights and the rule's state live: with the parameters.
    on_host = False

    def __init__(self, layout, topology, rule, xp, watch, before_read, options, kernels):
        dtype = options.param_dtype
        self.layout, self.topology, self.rule, self.dtype = layout, topology, rule, dtype
        self.shard_rank, self.watch, self._xp = topology.shard_rank, watch, xp
        self.options, self._kernels = options, kernels
        self.mixed = dtype != FP32
        self.masters_kind, self.state_dtype = options.masters, options.state_dtype
        #: The flat parameter buffer (every rank's full copy); ``params``: its views by name.
        self.flat = backend.zeros(xp, layout.total, dtype)  # 64-byte aligned on the host
        self.params: Mapping = Views(layout, self.flat, before_read)
        largest = layout.largest_shard
        #: Each bucket's tensor pieces on this rank: ``(tensor, group, a, b)``, ``[a, b)`` in
        #: the bucket's shard; a two-phase rule's calls, and the 8-bit state's segments.
        self._pieces = [layout.tensor_pieces(b, self.shard_rank) for b in layout.buckets]
        #: What the update runs over, in order: ranges of a bucket's shard (``ShardRange``).
        self.parts = self._split()
        #: Each part's tensor pieces, and its elementwise kernel calls: ``(param group, a, b)``,
        #: per group, or per tensor piece for the 8-bit state (whose blocks start at each).
        self._part_pieces = [
            [p for p in self._pieces[part.bucket.index] if part.a <= p[2] < part.b]
            for part in self.parts
        ]
        self._ranges = [
            [(g, a, b) for _, g, a, b in pieces]
            if self.state_dtype == "int8"
            else [(g, *self._group_range(part, g)) for g in range(len(layout.groups))]
            for part, pieces in zip(self.parts, self._part_pieces)
        ]
        self._allocate(layout.shard_total, largest)
        #: The most elements one kernel call takes (remainder masters: a cache-sized chunk).
        kept = [self.masters, *self.stored.values()]
        self._chunk = max(1, min([largest] + [k.chunk for k in kept if k is not None]))
        self._step = 0  # the step being updated (stochastic rounding draws by it)
        self.gathers: ParamGathers = param_gathers(
            options, layout, self.flat, topology.shard_comm, watch, xp, self.kernel_kind
        )

    def _allocate(self, n: int, largest: int) -> None:
        """The shard's arrays (the masters for 16-bit parameters, as ``masters_kind`` says; for
        fp32 ones the parameter buffer's own range is the master) and the kernel."""
        xp = self._xp
        self.kernel_kind = self._kernels.device
        self.masters: Any = (
            masters_for(
                self.masters_kind, n, largest, xp, self.kernel_kind, self.rule.tensor_sums > 0
            )
            if self.mixed
            else None
        )
        whole, segments = self.rule.tensor_sums > 0, self._segments()
        self.stored: dict = {
            name: state_for(self.state_dtype, n, largest, xp, self.kernel_kind, i, whole, segments)
            for i, name in enumerate(self.rule.state_names)
        }
        self.kernel = self.rule.kernel(self.kernel_kind, largest)

    def _segments(self) -> list:
        """The 8-bit state's segments: ``(start, stop, quantized)`` of each tensor piece in the
        shard's positions (tensors under ``MIN_8BIT_SIZE`` keep fp32)."""
        tensors = self.layout.tensors
        return [
            (bucket.state.start + a, bucket.state.start + b, tensors[t].numel >= MIN_8BIT_SIZE)
            for bucket, pieces in zip(self.layout.buckets, self._pieces)
            for t, _, a, b in pieces
        ]

    def _split(self) -> list[ShardRange]:
        """The parts: each bucket's shard whole."""
        return [ShardRange(b, 0, b.shard_size, b.index) for b in self.layout.buckets]

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
        self.masters.write(s, values["master"], param, values.get("param"))

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
        for part, grads in self._inputs(shards):
            self.watch.bucket = part.bucket.index
            self._update_part(part, grads, kernel_scalars)
            t1 = clock()
            for index in self._landed(part):
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

    def host_bytes(self, owned: int) -> tuple[int, int, float]:
        """``(held, real, share)``: the bytes of the masters and state kept on the host
        (offload), those of their real elements, and the share of this rank's ``owned`` real
        elements they hold."""
        return 0, 0, 0.0

    def wait(self) -> None:
        """Complete the all-gathers in flight."""
        self.gathers.wait()

    def close(self) -> None:
        """Complete the gathers in flight and free what they hold; idempotent; all ranks."""
        self.gathers.close()

    # -- where the shard lives: HostState overrides these -----------------------------------------

    def _inputs(self, reduced):
        """``(part, its reduced gradients where its kernel reads them)`` for each part in order
        (``reduced``: each bucket's summed shard); for ``reduced`` None, ``(part, None)`` (a
        second phase reads no gradients)."""
        if reduced is None:
            return ((part, None) for part in self.parts)
        return ((part, reduced[part.bucket.index][part.a : part.b]) for part in self.parts)

    def _landed(self, part) -> list[int]:
        """The buckets whose new shard is in the parameter buffer once ``part``'s update is
        done (None: after the last), so that their all-gathers may start."""
        return [] if part is None else [part.bucket.index]

    def _kernel_of(self, part):
        """The kernel that updates ``part``."""
        return self.kernel

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

    def _update_part(self, part, grads, scalars) -> None:
        """Update ``part`` (``grads`` from its start): per param group, or per tensor piece (a
        two-phase rule; the 8-bit state, whose blocks start at each piece)."""
        bucket, kernel = part.bucket, self._kernel_of(part)
        if self.rule.tensor_sums:
            for index, _, a, b in self._part_pieces[part.index]:
                for c, d in self._calls(a, b):
                    master, states, param = self._arrays(bucket, c, d)
                    kernel.apply(master, *states, param, scalars[index])
                    self._stored(bucket, c, d, master, param)
            return
        for group, a, b in self._ranges[part.index]:
            for c, d in self._calls(a, b):
                master, states, param = self._arrays(bucket, c, d)
                kernel(grads[c - part.a : d - part.a], master, *states, param, scalars[group])
                self._stored(bucket, c, d, master, param, states)

    def _group_range(self, part, group: int) -> tuple[int, int]:
        """``[a, b)``: param group ``group``'s range of ``part`` (empty: ``a >= b``), in
        positions of the bucket's shard."""
        lo = part.bucket.shard(self.shard_rank)[0]
        group_lo, group_hi = self.layout.groups[group]
        return max(lo + part.a, group_lo) - lo, min(lo + part.b, group_hi) - lo

    @property
    def _sums_xp(self):
        """Where a two-phase rule's partial sums are added."""
        return self._xp

    def _calls(self, a: int, b: int):
        """``[a, b)`` cut into the ranges of one elementwise kernel call each (the bits do
        not depend on the cut)."""
        return ((c, min(b, c + self._chunk)) for c in range(a, b, self._chunk))

    def _per_tensor_scalars(self, shards, scalars, step: int) -> dict:
        """Phase one of a two-phase rule: the kernel's partial sums over each tensor piece
        this rank owns (updating the rule's state), added per tensor, summed over the group in
        one ``Allreduce``; returns the scalars (``rule.tensor_scalars``) of each tensor this
        rank owns a piece of, by tensor index. ``shards``: as ``_inputs`` gives them."""
        all_pieces = self._pieces
        sums = self._sums_xp.zeros((len(self.layout.tensors), self.rule.tensor_sums), np.float64)
        for part, grads in shards:
            calls, bucket, pieces = [], part.bucket, self._part_pieces[part.index]
            for _, group, a, b in pieces:
                master, states, _ = self._arrays(bucket, a, b, at=a)  # whole: one sum a piece
                calls.append((grads[a - part.a : b - part.a], master, *states, scalars[group]))
            for (index, _, a, b), partial, call in zip(
                pieces, each_tensor_sums(self._kernel_of(part), calls), calls
            ):
                sums[index] += backend.like(sums, partial)
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
    """``ShardedState`` with the share ``fraction`` of this rank's master weights and rule state
    on the host (ZeRO-Offload; all of it for 1): the shard's positions from ``cut`` on, a
    tensor piece's start (``offload.host_start``). The device parts are updated first, by the
    device's kernel; then each host part's reduced gradients are copied to the host, updated
    there by ``threads`` threads of the CPU kernel, and its new parameters copied back, the
    copies of neighbouring parts overlapping the kernel (``offload.HostShard``). Each row is
    kept on both sides (``offload.DeviceHostRow``) as ``state_dtype`` says; the masters as
    ``masters`` says on the device, as fp32 on the host."""

    on_host = True

    def __init__(self, layout, topology, rule, xp, watch, before_read, options, kernels):
        self._threads, self._fraction = options.offload_threads, options.offload_fraction
        super().__init__(layout, topology, rule, xp, watch, before_read, options, kernels)

    def _split(self) -> list[ShardRange]:
        """Each bucket's shard cut at ``cut``: the device part, then the host part."""
        pieces = [
            (bucket.state.start + a, b - a)
            for bucket, found in zip(self.layout.buckets, self._pieces)
            for _, _, a, b in found
        ]
        self.cut = cut = host_start(pieces, self.layout.shard_total, self._fraction)
        #: The real elements of the host part.
        self.host_real = sum(size for position, size in pieces if position >= cut)
        parts: list[ShardRange] = []
        for bucket in self.layout.buckets:
            split = min(max(cut - bucket.state.start, 0), bucket.shard_size)
            for a, b, on_host in ((0, split, False), (split, bucket.shard_size, True)):
                if a < b:
                    parts.append(ShardRange(bucket, a, b, len(parts), on_host))
        return parts

    def _allocate(self, n: int, largest: int) -> None:
        xp, cut, whole = self._xp, self.cut, self.rule.tensor_sums > 0
        self.kernel_kind, device_kind = self._kernels.host, self._kernels.device
        #: Each bucket's host part (at most one), by bucket index.
        self._host_parts = {part.bucket.index: part for part in self.parts if part.on_host}
        #: The host arrays and the copies between them and the device (``offload.HostShard``).
        self.copies = HostShard(
            self.layout,
            self.shard_rank,
            self.flat,
            self.mixed,
            list(self._host_parts.values()),
            cut,
        )
        # A side that keeps nothing (the cut at either end) gets no decoding buffers.
        on_device_largest, on_host_largest = (largest if cut else 0), (largest if n > cut else 0)
        on_device = (
            masters_for(self.masters_kind, cut, on_device_largest, xp, device_kind, whole)
            if self.mixed
            else ParamsAsMasters()
        )
        self.masters = DeviceHostRow(
            on_device, Fp32Masters(self.copies.master), cut, self.host_real
        )
        segments = self._segments()  # (the cut is a piece's start: none is split)
        host_segments = [(a - cut, b - cut, q) for a, b, q in segments if a >= cut]
        device_segments = [s for s in segments if s[0] < cut]

        def row(i: int) -> DeviceHostRow:
            dtype = self.state_dtype
            return DeviceHostRow(
                state_for(
                    dtype, cut, on_device_largest, xp, device_kind, i, whole, device_segments
                ),
                state_for(
                    dtype, n - cut, on_host_largest, np, self.kernel_kind, i, whole, host_segments
                ),
                cut,
                self.host_real,
            )

        self.stored = {name: row(i) for i, name in enumerate(self.rule.state_names)}
        self.kernel = self.rule.kernel(device_kind, on_device_largest) if cut else None
        self.host_kernel = ThreadedKernel(
            lambda: self.rule.kernel(self.kernel_kind, on_host_largest),
            self._threads if n > cut else 1,
        )

    def close(self) -> None:
        self.host_kernel.close()
        super().close()

    def scratch_bytes(self) -> tuple[int, int]:
        rows = [self.masters, *self.stored.values()]  # (their codecs' decoding buffers)
        device = 0 if self.kernel is None else self.kernel.scratch_bytes
        device += self.gathers.scratch_bytes + sum(row.device.scratch_bytes for row in rows)
        host = self.copies.scratch_bytes + self.host_kernel.scratch_bytes
        return device, host + sum(row.host.scratch_bytes for row in rows)

    def host_bytes(self, owned: int) -> tuple[int, int, float]:
        kept = [self.masters, *self.stored.values()]
        share = self.host_real / owned if owned else float(self.cut == 0)
        return (
            sum(row.host.nbytes for row in kept),
            sum(row.host.real_bytes(self.host_real) for row in kept),
            share,
        )

    @property
    def _sums_xp(self):
        return np if self.cut == 0 else self._xp

    def _inputs(self, reduced):
        if reduced is None:
            return super()._inputs(None)
        on_device = super()._inputs(reduced)
        return itertools.chain(
            ((part, grads) for part, grads in on_device if not part.on_host),
            self.copies.fetched(reduced),
        )

    def _landed(self, part) -> list[int]:
        if part is None:
            return self.copies.drain()
        if part.on_host:
            return self.copies.push(part)
        return [part.bucket.index] if part.b == part.bucket.shard_size else []

    def _kernel_of(self, part):
        return self.host_kernel if part.on_host else self.kernel

    def _arrays(self, bucket, a: int, b: int, at: int = 0) -> tuple:
        """On the host: the fp32 master, the state (decoded where it is kept otherwise); the
        kernel's 16-bit output goes to the slot that ``push`` sends (fp32: the master is)."""
        first = bucket.state.start + a
        if first < self.cut:
            return super()._arrays(bucket, a, b, at)
        st, part = slice(first, first + b - a), self._host_parts[bucket.index]
        output = self.copies.output(part)
        return (
            self.copies.master[first - self.cut : first - self.cut + b - a],
            [kept.load(st, at) for kept in self.stored.values()],
            None if output is None else output[a - part.a : b - part.a],
        )


def sharded_state(options, layout, topology, rule, xp, watch, before_read, kernels) -> ShardedState:
    """The sharded state of the checked ``options`` (``options.EngineOptions``), updated by
    ``kernels`` (``KernelFamilies``)."""
    kind = (
        HostState if keeps_host_share(options.offload, options.offload_fraction) else ShardedState
    )
    return kind(layout, topology, rule, xp, watch, before_read, options, kernels)
