"""The parameters' all-gathers: each rank's updated shard of a bucket sent to every rank of its
shard group, in place in the flat parameter buffer.

``ParamGathers`` starts a bucket's all-gather as soon as its shard has landed (``start``), keeps
what is in flight until ``wait()``, and gathers every bucket at once after a checkpoint or an
export wrote the shards (``gather_all``). The watchdog it is handed is told which bucket it
waits for. Methods that start or complete collectives must be called on all ranks, with the
same arguments.
"""

from __future__ import annotations

import weakref

from .watchdog import Watchdog

__all__ = ["ParamGathers"]


class ParamGathers:
    """The all-gathers of ``params`` (the flat parameter buffer laid out by ``layout``) over
    ``shard_comm``, marked on ``watch``."""

    def __init__(self, layout, params, shard_comm, watch: Watchdog):
        self.layout, self._params, self._comm, self._watch = layout, params, shard_comm, watch
        self._in_flight: list = []  # (bucket index, request), in the order started
        # Persistent requests hold the buffer: free them when this goes.
        self._release = weakref.finalize(self, shard_comm.close, [params])

    @property
    def in_flight(self) -> int:
        """How many all-gathers have started and not yet been waited for."""
        return len(self._in_flight)

    def start(self, index: int) -> None:
        """Start the all-gather of bucket ``index`` (this rank's shard of it written)."""
        bucket = self.layout.buckets[index]
        self._watch.bucket = index
        self._in_flight.append(
            (
                index,
                self._comm.start_allgather(
                    self._params[bucket.offset : bucket.offset + bucket.size]
                ),
            )
        )

    def wait(self) -> None:
        """Complete the all-gathers in flight."""
        watch = self._watch
        watch.phase = "gather"
        for index, request in self._in_flight:
            watch.bucket = index
            request.wait()
        self._in_flight.clear()

    def gather_all(self) -> None:
        """All-gather every bucket, blocking (what is in flight completed first)."""
        self.wait()
        for bucket in self.layout.buckets:
            self._comm.allgather_inplace(self._params[bucket.offset : bucket.offset + bucket.size])

    def close(self) -> None:
        """Complete what is in flight and free the persistent requests on the buffer;
        idempotent. Must be called on all ranks."""
        self.wait()
        self._release()
