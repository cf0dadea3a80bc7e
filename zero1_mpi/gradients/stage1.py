"""The stage-1 gradient source: the full gradient buffer, each bucket of it reduced to this
rank's shard as collectives in flight (in the spirit of Megatron-LM's bucket groups).

``BucketPipeline`` holds the flat gradient buffer (the model writes ``grads[name]``, views of
it) and a step's reductions: which tensors are ready, the reductions started (an in-place
reduce-scatter, or an ``Alltoall`` of 16-bit or 8-bit rows summed here in fp32: ``exchange``),
the reduced shards and their sums across shard groups (hierarchical sharding). Reductions start
last bucket first, the order of a backward pass and the same on every rank. It is the
``gradients.GradientSource`` of ``shard_gradients=False``. Methods that start or complete
collectives must be called on all ranks, with the same arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm.watchdog import Watchdog
from ..flat.views import Views
from ..kernels import backend
from ..wire.gradient_exchange import GradientWire

if TYPE_CHECKING:
    from ..comm.started import Request

__all__ = ["BucketPipeline"]

FP32 = np.dtype(np.float32)


class BucketPipeline:
    """The full gradient buffer of ``layout`` and its reductions to this rank's shard.

    Args:
        layout: the ``Layout`` of the flat buffers.
        xp, dtype: the array module (NumPy or CuPy) and the gradients' dtype (the parameters').
        topology: the shard groups (``topology.Topology``): reductions within ``shard_comm``,
            sums across ``replica_comm``; ``comm`` ends the job when a rank fails between them.
        exchange: an ``exchange.GroupExchange`` (16-bit or 8-bit rows by ``Alltoall``, summed
            here in fp32), or None (MPI's reduce-scatter in the gradients' dtype).
        across: an ``exchange.AcrossGroups`` summing the reduced shards over the shard groups
            (None: one group).
        watch: the ``Watchdog`` told where this rank waits (phase, bucket).
    """

    #: The full gradient buffer (not a shard).
    sharded = False
    #: Stage 1 finds no bad hand-over, and starts its reductions in one order on every rank.
    problem: str | None = None
    order_digest = 0

    def __init__(self, layout, xp, dtype, topology, exchange, across, watch: Watchdog):
        self.layout, self.watch = layout, watch
        #: The flat gradient buffer; ``grads``: its views by name (what the model writes).
        self.buffer = grads = backend.zeros(xp, layout.total, dtype)
        self.grads: Mapping = Views(layout, grads)
        self._grads = grads
        self._comm, self._shard_comm = topology.comm, topology.shard_comm
        self._exchange, self._across_groups = exchange, across
        #: Both, for the ledger and the step (``exchange.GradientWire``).
        self.wire = GradientWire(exchange, across)
        self._tensor_buckets = {
            t.name: [
                b.index
                for b in layout.buckets
                if b.offset < t.offset + t.numel and t.offset < b.offset + b.used
            ]
            for t in layout.tensors
        }
        self._bucket_tensors = [
            sum(b.index in ids for ids in self._tensor_buckets.values()) for b in layout.buckets
        ]
        self._new_round()
        # Persistent requests hold these buffers: free them when the pipeline goes.
        held = [grads, *(exchange.buffers if exchange else ())]
        self._release = weakref.finalize(self, self._shard_comm.close, held)

    @property
    def started(self) -> tuple[int, ...]:
        """The buckets whose reduction started this round (in flight or done), in order."""
        return tuple(self._started_order)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the exchange's slots and of the sums across groups."""
        return self.wire.scratch_bytes

    @property
    def feedback_bytes(self) -> int:
        return self.wire.feedback_bytes

    def rescale_feedback(self, factor: float) -> None:
        self.wire.rescale_feedback(factor)

    def ready(self, names) -> None:
        """``grads_ready``: check ``names`` (a usage error raises before any collective
        starts), then declare them final (``mark_ready``)."""
        names = self.check_ready(names)
        with self._comm.abort_on_error("in grads_ready()"):
            self.mark_ready(names)

    def add(self, name: str, grad) -> None:
        """Stage 2's hand-over, refused: the model writes ``grads[name]`` instead."""
        raise ValueError(
            "add_grad() hands gradients over with shard_gradients=True; "
            "without it, write them into opt.grads[name]"
        )

    def missing(self) -> list[str]:
        """Stage 2's tensors not yet handed over: none here."""
        return []

    def zero(self) -> None:
        """Set every gradient to zero, the reductions started this round completed and
        forgotten first."""
        if self._started_order:
            with self._comm.abort_on_error("in zero_grad() while completing reductions"):
                self.discard()
        self._grads.fill(0)

    def close(self) -> None:
        """Complete what is in flight (its gradients dropped) and free the persistent requests
        on this pipeline's buffers (what its collection would do); idempotent. Must be
        called on all ranks."""
        with self._comm.abort_on_error("in close() while completing the reductions in flight"):
            self.discard()
        self._release()

    def check_ready(self, names) -> list[str]:
        """Return ``names`` (a name or an iterable of names) as a list, or raise KeyError for
        an unknown name and ValueError for one already declared this round."""
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self._tensor_buckets:
                raise KeyError(f"grads_ready({name!r}): no parameter of that name")
            if name in self._ready:
                raise ValueError(
                    f"grads_ready({name!r}) again before step(): its reduction may "
                    "have started, so later gradients would be lost; accumulate "
                    "first, then call grads_ready once per step"
                )
        return names

    def mark_ready(self, names: list[str]) -> None:
        """Declare the gradients of ``names`` (checked by ``check_ready``) final; start each
        bucket whose tensors are all ready once every later bucket has started, and let MPI
        progress what is in flight."""
        for name in names:
            self._ready.add(name)
            for index in self._tensor_buckets[name]:
                self._waiting[index] -= 1
        while self._next_start >= 0 and self._waiting[self._next_start] <= 0:
            self._start_reduction(self._next_start)
        for request, _ in self._in_flight.values():
            request.test()
        for request in self._across.values():
            request.test()

    def reduce_all(self) -> list:
        """Start whatever has not started, complete every reduction (and every sum across the
        groups) and begin a new round. Returns each bucket's summed shard, in bucket order: a
        view of the gradient buffer, valid until the gradients are written again."""
        self.watch.phase = "reduce"
        while self._next_start >= 0:
            self._start_reduction(self._next_start)
        reduced = [self._finish_reduction(b.index) for b in self.layout.buckets]
        for index, request in self._across.items():
            self.watch.bucket = index
            request.wait()
        self._new_round()
        return reduced

    def discard(self) -> None:
        """Complete this round's reductions and forget them (their results go unused)."""
        for request, _ in self._in_flight.values():
            request.wait()
        for request in self._across.values():
            request.wait()
        self._new_round()

    # -- internals ---------------------------------------------------------------------------

    def _new_round(self) -> None:
        """No tensor ready, no bucket started."""
        self._ready: set[str] = set()
        self._waiting = list(self._bucket_tensors)
        self._next_start = len(self.layout.buckets) - 1
        self._started_order: list[int] = []
        # bucket index -> (request, receive slot or None)
        self._in_flight: dict[int, tuple[Request, int | None]] = {}
        # bucket index -> this rank's summed shard, once finished
        self._reduced: dict[int, Any] = {}
        # bucket index -> its sum across the shard groups, in flight
        self._across: dict[int, Request] = {}
        self._slot_owner: list[int | None] = [None] * (
            0 if self._exchange is None else self._exchange.slots
        )

    def _start_reduction(self, index: int) -> None:
        """Start summing bucket ``index``'s gradients over the group (in place, see below)."""
        bucket = self.layout.buckets[index]
        grads = self._grads[bucket.offset : bucket.offset + bucket.size]
        self.watch.bucket = index
        self._next_start = index - 1
        self._started_order.append(index)
        if self._shard_comm.size == 1:
            self._reduced[index] = grads
        elif self._exchange is None:
            self._in_flight[index] = (self._shard_comm.start_reduce_scatter(grads), None)
        else:
            slot = index % self._exchange.slots
            owner = self._slot_owner[slot]
            if owner is not None:
                self._finish_reduction(owner)
            self._slot_owner[slot] = index
            self._in_flight[index] = (self._exchange.start(slot, grads, bucket.offset), slot)

    def _finish_reduction(self, index: int):
        """This rank's shard of bucket ``index``'s gradients, summed over ranks.

        The sum lives at the start of the bucket's range of the gradient buffer: the gradients
        there have been sent by then, so the sum needs no buffer of its own.
        """
        if index in self._reduced:
            return self._reduced[index]
        request, slot = self._in_flight.pop(index)
        self.watch.bucket = index
        request.wait()
        bucket = self.layout.buckets[index]
        grads = self._grads[bucket.offset : bucket.offset + bucket.size]
        if slot is None:
            reduced = self._shard_comm.reduced_block(grads)
        else:
            reduced = grads.view(FP32)[: bucket.shard_size]  # 2 x size bytes >= 4 x size / K
            self._exchange.finish(slot, bucket.size, reduced)
            self._slot_owner[slot] = None
        if self._across_groups is not None:  # the group's sum, summed over its replicas
            self._across[index] = self._across_groups.start(reduced, bucket.state.start)
        self._reduced[index] = reduced
        return reduced
