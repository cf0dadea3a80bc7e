"""Gradient sharding (ZeRO stage 2): gradients handed over tensor by tensor, reduced bucket by
bucket into this rank's gradient shard, so that no rank holds the full gradient.

``GradientShards.add(name, grad)`` copies a tensor's gradient into its bucket's staging slot
(a small pool); once every tensor of the bucket is in, ``BucketReduction`` reduces it over the
shard group (as stage 1 does) and adds its shard into this rank's gradient shard, which sums
the micro-batches of a step. Reductions start in the order buckets fill, so every rank must
hand the same tensors over in the same order; ``order_digest`` lets the step check that. Bad
hand-overs are kept as ``problem`` (the tensor counts as zeros) for the step to raise on every
rank. It is the ``gradients.GradientSource`` of ``shard_gradients=True``. Methods that start or
complete collectives must be called on all ranks.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..comm.watchdog import Watchdog
from ..flat.views import NoFullGradients
from ..kernels import backend
from ..wire.gradient_exchange import GradientWire

if TYPE_CHECKING:
    from ..comm.started import Request
    from ..flat.layout import Bucket

__all__ = [
    "GradientShards",
    "DEFAULT_STAGING",
    "check_shard_gradients",
    "check_grad_shard_dtype",
    "check_grad_staging",
]

FP32 = np.dtype(np.float32)


class GradientShards:
    """This rank's gradient shard of every bucket, filled through a pool of staging slots.

    Args:
        layout: the ``Layout`` of the flat parameters.
        xp: NumPy or CuPy (the parameters' array module).
        param_dtype: the gradients' dtype in the staging slots (the parameters').
        shard_dtype: the gradient shard's dtype (the parameters', or float32).
        topology: the shard groups (``topology.Topology``): reductions within ``shard_comm``,
            sums across ``replica_comm``; ``comm`` ends the job when a rank fails between them.
        exchange: an ``exchange.GroupExchange`` with ``slots`` receive slots (16-bit or 8-bit
            rows by ``Alltoall``, summed here in fp32 in rank order, as stage 1 does), or None
            (MPI's reduce-scatter in the gradients' dtype).
        across: an ``exchange.AcrossGroups`` summing the shards over the shard groups (None:
            one group).
        slots: the staging slots (at least 1).
        watch: the ``Watchdog`` told where this rank waits (phase, bucket).
    """

    #: No rank holds the full gradient to view: this rank's gradient shard.
    grads: Mapping = NoFullGradients()
    sharded = True
    # Set by _new_step, for each step:
    problem: str | None
    order_digest: int
    _filled: list[set[str]]
    _handed: list[set[str]]
    _slot_of: list[int | None]
    _reduced: list[int]
    _free: deque[int]
    _in_flight: deque[tuple[int, int, Request | None]]
    _waiting: deque[int]

    def __init__(
        self,
        layout,
        xp,
        param_dtype,
        shard_dtype,
        topology,
        exchange,
        across,
        slots: int,
        watch: Watchdog,
    ):
        self.layout, self.watch = layout, watch
        self._world = topology.comm
        self._comm = topology.shard_comm
        self._across_groups = across
        #: Both, for the ledger and the step (``exchange.GradientWire``).
        self.wire = GradientWire(exchange, across)
        #: This rank's gradient shard (the gradients it holds): ``buffer`` too.
        self.shard = self.buffer = backend.zeros(xp, layout.shard_total, shard_dtype)
        largest = max(b.size for b in layout.buckets)
        count = max(1, min(slots, len(layout.buckets)))
        self._slots = xp.zeros((count, largest), param_dtype)
        self._reduction = BucketReduction(
            xp, self.shard, self._slots, self._comm, exchange, layout.largest_shard, watch
        )
        self._tensors = {t.name: t for t in layout.tensors}
        self._bucket_tensors = [
            [t.name for t, _, _ in layout.pieces(b.offset, b.offset + b.used)]
            for b in layout.buckets
        ]
        # (an empty tensor: none)
        self._tensor_buckets: dict[str, list[Bucket]] = {t.name: [] for t in layout.tensors}
        for bucket, names in zip(layout.buckets, self._bucket_tensors):
            for name in names:
                self._tensor_buckets[name].append(bucket)
        self._new_step()
        # Persistent requests hold the slots: free them when this goes.
        held = [self._slots, *(exchange.buffers if exchange else ())]
        self._release = weakref.finalize(self, self._comm.close, held)

    def close(self) -> None:
        """Complete what is in flight (its gradients dropped) and free the persistent requests
        on the staging slots (what collection would do); idempotent. Must be called on all
        ranks."""
        self.zero()
        self._release()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the staging slots, the exchange and the sums: a few buckets, whatever Ψ."""
        return self._slots.nbytes + self._reduction.scratch_bytes + self.wire.scratch_bytes

    @property
    def feedback_bytes(self) -> int:
        return self.wire.feedback_bytes

    def rescale_feedback(self, factor: float) -> None:
        self.wire.rescale_feedback(factor)

    # -- hand-over -----------------------------------------------------------------------------

    def ready(self, names) -> None:
        """Stage 1's ``grads_ready``, refused: a bucket's reduction starts with its last
        hand-over."""
        raise ValueError(
            "grads_ready() is for the full gradient buffer: with "
            "shard_gradients=True each bucket's reduction starts when "
            "add_grad() hands its last tensor over"
        )

    def add(self, name: str, grad) -> None:
        """Hand over the gradient of tensor ``name`` for this micro-batch (once per tensor per
        micro-batch, in the same order on every rank); a bucket whose last tensor this is
        starts its reduction."""
        with self._world.abort_on_error("in add_grad()"):
            self._add(name, grad)

    def _add(self, name: str, grad) -> None:
        problem = self._check(name, grad)
        if problem:
            self.problem = self.problem or problem
            grad = None  # counted as handed (zeros), so that every rank reduces the same
        tensor = self._tensors.get(name)
        if tensor is None:
            return
        flat = None if grad is None else grad.reshape(-1)
        for bucket in self._tensor_buckets[name]:
            if name in self._handed[bucket.index]:
                self.problem = self.problem or (
                    f"the gradient of {name!r} was handed over twice in one micro-batch: hand "
                    "each tensor's gradient over once, after it is complete (accumulate "
                    "micro-batches by handing each one over)"
                )
                continue
            slot = self._slot_for(bucket.index)
            lo, hi = (
                max(bucket.offset, tensor.offset),
                min(bucket.offset + bucket.used, tensor.offset + tensor.numel),
            )
            target = slot[lo - bucket.offset : hi - bucket.offset]
            if flat is None:
                target.fill(0)
            else:
                target[...] = flat[lo - tensor.offset : hi - tensor.offset]
            self._filled[bucket.index].add(name)
            self._handed[bucket.index].add(name)
            if len(self._handed[bucket.index]) == len(self._bucket_tensors[bucket.index]):
                self._handed[bucket.index] = set()  # this micro-batch's part is all in
                self._start(bucket.index)

    def missing(self) -> list[str]:
        """The tensors still to be handed over to complete the buckets begun this micro-batch."""
        return [
            name
            for index, handed in enumerate(self._handed)
            if handed
            for name in self._bucket_tensors[index]
            if name not in handed
        ]

    # -- the step ------------------------------------------------------------------------------

    def reduce_all(self) -> list:
        """Complete every reduction and return each bucket's summed gradient shard (a view of
        ``shard``), summed across the groups too. A bucket begun but not complete (missing
        tensors) is reduced as it is and reported in ``problem``; one never begun this step
        is reduced as zeros, so that all ranks run the same collectives."""
        self.watch.phase = "reduce"
        missing = self.missing()
        if missing:
            self.problem = self.problem or (
                f"step() before the gradients of {missing[:5]}"
                f"{' and more' if len(missing) > 5 else ''} were handed over: hand every "
                "tensor's gradient over once per micro-batch (zeros for an unused one)"
            )
        for index, filled in enumerate(self._filled):
            if filled or not (
                self._reduced[index]
                or self._slot_of[index] is not None
                or any(entry[0] == index for entry in self._in_flight)
            ):
                self._slot_for(index)
                self._start(index)
        self._handed = [set() for _ in self.layout.buckets]
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        shards = [self.shard[b.state] for b in self.layout.buckets]
        if self._across_groups is not None:
            for bucket, shard in zip(self.layout.buckets, shards):
                self.watch.bucket = bucket.index
                self._across_groups.sum(shard, bucket.state.start)
        return shards

    def zero(self) -> None:
        """Forget this step's gradients: complete what is in flight, zero the shard, clear the
        problem and the order."""
        with self._world.abort_on_error("in zero_grad() while completing reductions"):
            while self._in_flight:
                request = self._in_flight.popleft()[2]
                if request is not None:  # None: a shard group of one rank reduces nothing
                    request.wait()
        self.shard.fill(0)
        self._new_step()

    # -- internals -----------------------------------------------------------------------------

    def _new_step(self) -> None:
        self._filled = [set() for _ in self.layout.buckets]  # tensors in the open fill
        self._handed = [set() for _ in self.layout.buckets]  # ... in this micro-batch
        self._slot_of = [None] * len(self.layout.buckets)  # its staging slot
        self._reduced = [0] * len(self.layout.buckets)  # reductions added this step
        self._free = deque(range(len(self._slots)))
        self._in_flight = deque()  # (bucket, slot, request)
        self._waiting = deque()  # open fills holding a slot
        #: A digest of the reductions started this step (buckets and how full), in order.
        self.order_digest = 0
        #: The first bad hand-over of this step (a message), raised by the step on every rank.
        self.problem = None

    def _check(self, name: str, grad) -> str | None:
        tensor = self._tensors.get(name)
        if tensor is None:
            return f"add_grad({name!r}): no parameter of that name"
        if backend.backend_name(grad) != backend.backend_name(self.shard):
            return (
                f"the gradient of {name!r} is a {type(grad).__name__}, the parameters "
                f"{type(self.shard).__name__}s: hand over arrays of the parameters' kind"
            )
        if tuple(grad.shape) != tensor.shape:
            return (
                f"the gradient of {name!r} has shape {tuple(grad.shape)}, its parameter "
                f"{tensor.shape}"
            )
        if grad.dtype != self._slots.dtype and grad.dtype != FP32:
            return (
                f"the gradient of {name!r} is {grad.dtype}: hand over the parameters' "
                f"dtype ({self._slots.dtype}) or float32"
            )
        return None

    def _slot_for(self, index: int):
        """Bucket ``index``'s staging slot (a row of ``_slots``), taking one if it has none:
        a free one, else the oldest reduction's once it completes, else (every slot held by
        a fill still waiting for tensors) the oldest waiting fill's, reduced as it is."""
        if self._slot_of[index] is None:
            if not self._free:
                if not self._in_flight:
                    self._start(self._waiting[0])  # out of order: one more reduction later
                self._finish(self._in_flight.popleft())
            self._slot_of[index] = self._free.popleft()
            self._waiting.append(index)
        return self._slots[self._slot_of[index]]

    def _start(self, index: int) -> None:
        """Start reducing bucket ``index``'s slot over the shard group."""
        bucket = self.layout.buckets[index]
        slot = cast(int, self._slot_of[index])  # a bucket started holds a slot (_slot_for)
        self._waiting.remove(index)
        self._slot_of[index] = None
        self.order_digest = (
            self.order_digest * 31 + 7919 * (index + 1) + len(self._filled[index])
        ) % (1 << 20)
        grads = self._slots[slot, : bucket.size]
        grads[bucket.used :] = 0
        for name in self._bucket_tensors[index]:  # a partial fill: zeros for the others
            if name not in self._filled[index]:
                tensor = self._tensors[name]
                grads[
                    max(bucket.offset, tensor.offset) - bucket.offset : min(
                        bucket.offset + bucket.used, tensor.offset + tensor.numel
                    )
                    - bucket.offset
                ] = 0
        self._filled[index] = set()
        self._in_flight.append((index, slot, self._reduction.start(bucket, slot)))

    def _finish(self, entry) -> None:
        """Complete a reduction and add its result into the shard; free its slot."""
        index, slot, request = entry
        first = not self._reduced[index]
        self._reduction.finish(self.layout.buckets[index], slot, request, first)
        self._reduced[index] += 1
        self._free.append(slot)


class BucketReduction:
    """A staged bucket reduced over the shard group and added into the gradient shard: by the
    exchange (rows summed here in fp32, as stage 1 sums them) or by MPI's reduce-scatter in the
    gradients' dtype; a shard group of one rank reduces nothing. ``GradientShards`` chooses the
    bucket, its staging slot (a row of ``slots``) and when; all ranks start the same ones."""

    def __init__(self, xp, shard, slots, comm, exchange, largest_shard: int, watch: Watchdog):
        self._xp, self._shard, self._slots = xp, shard, slots
        self._comm, self._exchange, self.watch = comm, exchange, watch
        # the exchange's fp32 sum of a bucket's shard, added into a 16-bit or later shard
        self._scratch: Any = xp.empty(largest_shard, FP32) if exchange else None

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.nbytes

    def start(self, bucket: Bucket, slot: int) -> Request | None:
        """Start reducing ``bucket`` from staging slot ``slot``; None: nothing to wait for."""
        grads = self._slots[slot, : bucket.size]
        if self._comm.size == 1:
            return None
        if self._exchange is not None:
            return self._exchange.start(slot, grads, bucket.offset)
        return self._comm.start_reduce_scatter(grads)

    def finish(self, bucket: Bucket, slot: int, request: Request | None, first: bool) -> None:
        """Complete ``request`` and add its result into ``bucket``'s shard (``first``: the
        step's first reduction of the bucket, which replaces what the shard holds)."""
        if request is not None:
            self.watch.phase, self.watch.bucket = "reduce", bucket.index
            request.wait()
        shard = self._shard[bucket.state]
        if self._exchange is not None:
            if first and shard.dtype == FP32:
                self._exchange.finish(slot, bucket.size, shard)  # stage 1's sum, bit for bit
            else:
                total = self._scratch[: bucket.shard_size]
                self._exchange.finish(slot, bucket.size, total)
                self._xp.add(total, shard, out=total, dtype=FP32)
                shard[...] = total
        else:
            block = (
                self._slots[slot, : bucket.size]
                if self._comm.size == 1
                else self._comm.reduced_block(self._slots[slot, : bucket.size])
            )
            if first:
                shard[...] = block
            else:
                self._xp.add(shard, block, out=shard, dtype=shard.dtype)


# -- the engine options this module owns (declared in config/options.py) ---------------

#: Staging buckets of stage 2: one bucket filling while the one before it is reduced (the
#: order of a backward pass); a bucket waiting for a late tensor holds one the while.
DEFAULT_STAGING = 2


def check_shard_gradients(value, checked):
    if value is None:
        return checked["shard_params"]
    if not isinstance(value, bool):
        raise ValueError(
            f"shard_gradients={value!r} must be True (ZeRO stage 2: gradients sharded too), "
            "False, or None (as shard_params)"
        )
    if checked["shard_params"] and not value:
        raise ValueError(
            "shard_gradients=False with shard_params=True: stage 3 shards the gradients "
            "too (no rank holds the full parameters to hold full gradients beside): drop it"
        )
    return value


def check_grad_shard_dtype(value, checked):
    if not checked["shard_gradients"]:
        if value is not None:
            raise ValueError(
                f"grad_shard_dtype={value!r} sets the gradient shard of "
                "shard_gradients=True: pass that too, or drop it"
            )
        return None
    if value is None:
        return checked["param_dtype"]
    if value not in ("float32", np.float32) and getattr(value, "name", None) != "float32":
        raise ValueError(
            f"grad_shard_dtype={value!r} is not supported: None (the "
            "parameters' dtype) or 'float32'"
        )
    return np.dtype(np.float32)


def check_grad_staging(value, checked):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"grad_staging={value!r} must be an integer >= 1 (staging buckets of "
            f"gradients; default {DEFAULT_STAGING})"
        )
    if value != DEFAULT_STAGING and not checked["shard_gradients"]:
        raise ValueError(
            f"grad_staging={value!r} sets the staging buckets of shard_gradients=True: "
            "pass that too, or drop it"
        )
    return value
