"""The parameters' all-gathers: each rank's updated shard of a bucket sent to every rank of its
shard group, in place in the flat parameter buffer.

``ParamGathers`` starts a bucket's all-gather once the kernel wrote its shard at ``target``,
completes them at ``wait()``, and gathers every bucket whole after a checkpoint or export
(``gather_all``). ``QuantizedGathers`` (``gather_dtype="int8"``) sends the change instead: the
new 16-bit shard minus the copy every rank holds, in ``wire``'s 8-bit blocks, which every rank,
the owner too, adds to its copy alike; the copies stay identical, and each change carries the
last one's rounding, so their distance to the new values does not grow with the steps.
Methods that start or complete collectives: all ranks, the same arguments.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from typing import Any

import numpy as np

from ..comm.watchdog import Watchdog
from ..flat.views import Views
from ..kernels import backend
from .codec import packed_bytes
from .unit_gathers import OwnedParams, UnitGathers

__all__ = [
    "ParamGathers",
    "QuantizedGathers",
    "param_gathers",
    "param_buffer",
    "check_gather_dtype",
]


class ParamGathers:
    """The all-gathers of ``params`` (the flat parameter buffer laid out by ``layout``) over
    ``shard_comm``, marked on ``watch``."""

    #: Whether the gathered parameters are the masters rounded (not an approximation of them).
    exact = True

    def __init__(self, layout, params, shard_comm, watch: Watchdog):
        self.layout, self._params, self._comm, self._watch = layout, params, shard_comm, watch
        self._in_flight: deque = deque()  # (bucket index, request, slot), in the order started
        # Persistent requests hold the buffer: free them when this goes.
        self._release = weakref.finalize(self, shard_comm.close, self._held())

    def _held(self) -> list:
        return [self._params]

    @property
    def in_flight(self) -> int:
        """How many all-gathers have started and not yet been waited for."""
        return len(self._in_flight)

    @property
    def scratch_bytes(self) -> int:
        return 0

    def views(self, before_read=None) -> Views:
        """The tensors by name as views of the parameter buffer (``before_read`` first)."""
        return Views(self.layout, self._params, before_read)

    @contextlib.contextmanager
    def gathered(self, unit: str):
        """The tensors of ``unit`` (``layout.units``) by name: every rank holds them all."""
        names = self.layout.unit_named(unit).tensors
        views = self.views()
        yield {name: views[name] for name in names}

    def target(self, bucket):
        """Where the kernel writes this rank's new shard of ``bucket``."""
        lo, hi = bucket.shard(self._comm.rank)
        return self._params[lo:hi]

    def start(self, index: int) -> None:
        """Start the all-gather of bucket ``index`` (this rank's shard of it written)."""
        bucket = self.layout.buckets[index]
        self._watch.bucket = index
        request = self._comm.start_allgather(self._bucket(bucket))
        self._in_flight.append((index, request, None))

    def wait(self) -> None:
        """Complete the all-gathers in flight."""
        self._watch.phase = "gather"
        while self._in_flight:
            self._finish(self._in_flight.popleft())

    def gather_all(self) -> None:
        """All-gather every bucket whole, blocking (what is in flight completed first)."""
        self.wait()
        for bucket in self.layout.buckets:
            self._comm.allgather_inplace(self._bucket(bucket))

    def close(self) -> None:
        """Complete what is in flight and free the persistent requests on the buffer;
        idempotent. Must be called on all ranks."""
        self.wait()
        self._release()

    def _bucket(self, bucket):
        return self._params[bucket.offset : bucket.offset + bucket.size]

    def _finish(self, entry) -> None:
        index, request, _ = entry
        self._watch.bucket = index
        request.wait()


class QuantizedGathers(ParamGathers):
    """``ParamGathers`` of each step's change in 8-bit blocks (``codec``: ``wire.codec_for``),
    through ``slots`` packed slots (a third start waits for the oldest)."""

    exact = False

    def __init__(self, layout, params, shard_comm, watch: Watchdog, xp, codec, slots: int = 2):
        largest = layout.largest_shard
        self._xp, self._codec, self._row = xp, codec, packed_bytes(largest)
        #: The kernel's new shard of the bucket being updated, and its change in fp32.
        self._new: Any = xp.empty(largest, params.dtype)
        self._change: Any = xp.empty(largest, np.float32)
        self._packed: Any = xp.empty((slots, shard_comm.size * self._row), np.uint8)
        self._free = deque(range(slots))
        super().__init__(layout, params, shard_comm, watch)

    def _held(self) -> list:
        return [self._params, self._packed]

    @property
    def scratch_bytes(self) -> int:
        held = self._new.nbytes + self._change.nbytes + self._packed.nbytes
        return held + self._codec.scratch_bytes

    def target(self, bucket):
        return self._new[: bucket.shard_size]

    def start(self, index: int) -> None:
        """Send the change of this rank's shard of bucket ``index`` (the kernel wrote the new
        values to ``target``), after adding it to this rank's own copy."""
        bucket = self.layout.buckets[index]
        self._watch.bucket = index
        if not self._free:
            self._finish(self._in_flight.popleft())
        slot, n, rank = self._free.popleft(), bucket.shard_size, self._comm.rank
        row = packed_bytes(n)
        lo, hi = bucket.shard(rank)
        change, real = self._change[:n], bucket.owned_real(rank)
        # Only the real elements: the kernel may leave the padding of ``_new`` unwritten
        # (whatever the scratch held, nan or inf too, which subtracting would warn of).
        self._xp.subtract(
            self._new[:real], self._params[lo : lo + real], out=change[:real], dtype=np.float32
        )
        change[real:] = 0
        packed = self._packed[slot, : self._comm.size * row]
        mine = packed[rank * row : (rank + 1) * row]
        self._codec.encode(change, mine)
        self._codec.decode_add(mine, self._params[lo:hi])
        self._in_flight.append((index, self._comm.start_allgather(packed), slot))

    def _finish(self, entry) -> None:
        """Complete a bucket's gather and add every other rank's change to its copy."""
        index, request, slot = entry
        self._watch.bucket = index
        request.wait()
        bucket = self.layout.buckets[index]
        n = bucket.shard_size
        row = packed_bytes(n)
        for r in range(self._comm.size):
            if r != self._comm.rank:
                lo, hi = bucket.shard(r)
                self._codec.decode_add(
                    self._packed[slot, r * row : (r + 1) * row], self._params[lo:hi]
                )
        self._free.append(slot)


def param_gathers(options, layout, params, shard_comm, watch: Watchdog, xp, kind: str):
    """The all-gathers the checked ``options`` ask for (``gather_dtype``, ``shard_params``:
    ``params`` an ``OwnedParams``); a group of one rank sends no change either."""
    if options.shard_params:
        return UnitGathers(layout, params, shard_comm, watch, xp)
    if options.gather_dtype == "int8" and shard_comm.size > 1:
        from .codec import codec_for

        largest = layout.largest_shard
        return QuantizedGathers(layout, params, shard_comm, watch, xp, codec_for(kind, largest))
    return ParamGathers(layout, params, shard_comm, watch)


def param_buffer(options, layout, shard_rank: int, xp):
    """Where this rank keeps the parameters: the full flat buffer (64-byte aligned on the
    host), or with ``shard_params`` its shard alone (``OwnedParams``)."""
    if options.shard_params:
        return OwnedParams(layout, shard_rank, xp, options.param_dtype)
    return backend.zeros(xp, layout.total, options.param_dtype)


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_gather_dtype(value, checked):
    if value is None:
        return None
    if value != "int8":
        raise ValueError(
            f"gather_dtype={value!r} is not understood: use None (the parameters' dtype) "
            "or 'int8' (each step's change in 8-bit blocks)"
        )
    if checked["param_dtype"] == np.float32:
        raise ValueError(
            "gather_dtype='int8' needs 16-bit parameters (fp32 masters apart from them), "
            "but param_dtype is float32, whose shard is its own master: pass "
            "param_dtype='bfloat16' or 'float16', or drop gather_dtype"
        )
    return value
