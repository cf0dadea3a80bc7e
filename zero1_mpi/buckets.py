"""The bucket pipeline: each bucket's gradients reduced to this rank's shard, and its parameters
all-gathered, as collectives in flight (in the spirit of Megatron-LM's bucket groups).

``BucketPipeline`` owns a step's communication: which tensors are ready, the reductions started
(an in-place reduce-scatter, or for 16-bit gradients an ``Alltoall`` into a receive slot summed
here in fp32), the reduced shards, their sums across shard groups (hierarchical sharding) and
the parameters' all-gathers. Reductions start last bucket first, the order of a backward pass
and the same on every rank. Methods that start or complete collectives must be called on all
ranks, with the same arguments.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import backend
from .watchdog import Watchdog

__all__ = ["BucketPipeline"]

FP32 = np.dtype(np.float32)


class BucketPipeline:
    """The collectives of one optimizer's buckets, over the flat ``params`` and ``grads``.

    Args:
        layout: the ``Layout`` of both buffers.
        params, grads: the flat parameter and gradient buffers (NumPy or CuPy); ``grads``
            None with gradient sharding, which reduces elsewhere (``grad_shards``): then this
            runs the gathers only.
        shard_comm: the ``Communicator`` of this rank's shard group.
        replica_comm: the ``Communicator`` of the ranks holding the same shard in the other
            groups, or None when there is one group.
        exchange_16bit: reduce 16-bit gradients by ``Alltoall`` and an fp32 sum here (else by
            MPI's reduce-scatter in the gradients' dtype).
        reductions: the engine's reductions (``reductions.reductions_for``), for that sum.
    """

    #: Where this rank waits (phase, bucket) for a ``Watchdog``: the optimizer sets its own.
    watch = Watchdog(None)

    def __init__(self, layout, params, grads, shard_comm, replica_comm, exchange_16bit: bool,
                 reductions):
        self.layout = layout
        self._params, self._grads = params, grads
        self._shard_comm, self._replica_comm = shard_comm, replica_comm
        self._reductions = reductions
        # 16-bit exchanges land in receive slots; two let one bucket's sum run while the next
        # bucket's exchange is in flight.
        slots = min(2, len(layout.buckets)) if exchange_16bit else 0
        xp = backend.xp_for(backend.backend_name(params))
        self._received = xp.empty((slots, max(b.size for b in layout.buckets)), params.dtype) \
            if slots else None
        self._tensor_buckets = {t.name: [b.index for b in layout.buckets
                                         if b.offset < t.offset + t.numel
                                         and t.offset < b.offset + b.used]
                                for t in layout.tensors}
        self._bucket_tensors = [sum(b.index in ids for ids in self._tensor_buckets.values())
                                for b in layout.buckets]
        self._gathers = []
        self._new_round()
        # Persistent requests hold these buffers: free them when the pipeline goes.
        self._release = weakref.finalize(self, shard_comm.close,
                                         [params, grads, self._received])

    @property
    def started(self) -> tuple[int, ...]:
        """The buckets whose reduction started this round (in flight or done), in order."""
        return tuple(self._started_order)

    @property
    def gathers_in_flight(self) -> int:
        """How many all-gathers have started and not yet been waited for."""
        return len(self._gathers)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the receive slots (16-bit exchanges only)."""
        return 0 if self._received is None else self._received.nbytes

    def close(self) -> None:
        """Complete and free the persistent requests on this pipeline's buffers (what its
        collection would do); idempotent. Must be called on all ranks, with nothing in
        flight."""
        self._release()

    def check_ready(self, names) -> list[str]:
        """Return ``names`` (a name or an iterable of names) as a list, or raise KeyError for
        an unknown name and ValueError for one already declared this round."""
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self._tensor_buckets:
                raise KeyError(f"grads_ready({name!r}): no parameter of that name")
            if name in self._ready:
                raise ValueError(f"grads_ready({name!r}) again before step(): its reduction may "
                                 "have started, so later gradients would be lost; accumulate "
                                 "first, then call grads_ready once per step")
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

    def start_gather(self, index: int) -> None:
        """Start the all-gather of bucket ``index`` of the parameters (this rank's shard of
        it written)."""
        bucket = self.layout.buckets[index]
        self.watch.bucket = index
        self._gathers.append((index, self._shard_comm.start_allgather(
            self._params[bucket.offset:bucket.offset + bucket.size])))

    def wait_gathers(self) -> None:
        """Complete the all-gathers in flight."""
        watch = self.watch
        watch.phase = "gather"
        for index, request in self._gathers:
            watch.bucket = index
            request.wait()
        self._gathers.clear()

    def gather_all(self) -> None:
        """All-gather every bucket of the parameters, blocking."""
        for bucket in self.layout.buckets:
            self._shard_comm.allgather_inplace(
                self._params[bucket.offset:bucket.offset + bucket.size])

    # -- internals ---------------------------------------------------------------------------

    def _new_round(self) -> None:
        """No tensor ready, no bucket started."""
        self._ready = set()
        self._waiting = list(self._bucket_tensors)
        self._next_start = len(self.layout.buckets) - 1
        self._started_order = []
        self._in_flight = {}  # bucket index -> (request, receive slot or None)
        self._reduced = {}    # bucket index -> this rank's summed shard, once finished
        self._across = {}     # bucket index -> its sum across the shard groups, in flight
        self._slot_owner = [None] * (0 if self._received is None else len(self._received))

    def _start_reduction(self, index: int) -> None:
        """Start summing bucket ``index``'s gradients over the group (in place, see below)."""
        bucket = self.layout.buckets[index]
        grads = self._grads[bucket.offset:bucket.offset + bucket.size]
        self.watch.bucket = index
        self._next_start = index - 1
        self._started_order.append(index)
        if self._shard_comm.size == 1:
            self._reduced[index] = grads
        elif self._received is None:
            self._in_flight[index] = (self._shard_comm.start_reduce_scatter(grads), None)
        else:
            slot = index % len(self._received)
            if self._slot_owner[slot] is not None:
                self._finish_reduction(self._slot_owner[slot])
            self._slot_owner[slot] = index
            received = self._received[slot, :bucket.size]
            self._in_flight[index] = (self._shard_comm.start_alltoall(grads, received), slot)

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
        grads = self._grads[bucket.offset:bucket.offset + bucket.size]
        if slot is None:
            reduced = self._shard_comm.reduced_block(grads)
        else:
            reduced = grads.view(FP32)[:bucket.shard_size]  # 2 x size bytes >= 4 x size / K
            blocks = self._received[slot, :bucket.size].reshape(self._shard_comm.size, -1)
            self._reductions.sum_blocks(blocks, reduced)
            self._slot_owner[slot] = None
        if self._replica_comm is not None:  # the group's sum, summed over its replicas
            self._across[index] = self._replica_comm.start_allreduce(reduced)
        self._reduced[index] = reduced
        return reduced

