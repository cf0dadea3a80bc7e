"""Started collectives on array buffers, and the request a caller completes.

``StartedCollectives`` starts a reduce-scatter, allreduce, alltoall or allgather on buffers MPI
takes as they are (``Communicator.start_*`` runs the others blocking): an MPI-4 persistent
request kept per (collective, buffer) and started again, or where the library has none a
nonblocking one, for good (``source`` says so). ``Request`` wraps an mpi4py request (or none:
``DONE``, what a blocking fallback returns) and runs its ``after`` once it has completed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels import backend
from .capabilities import MPI
from .staging import BufferRoutes, address, as_bytes

__all__ = ["Request", "DONE", "StartedCollectives", "reduce_type"]


class Request:
    """A started collective: ``test()`` lets MPI progress it, ``wait()`` completes it."""

    def __init__(self, request=None):
        self._request = request
        #: Called once, when the collective has completed (an out-of-place one's copy).
        self.after: Callable[[], object] | None = None

    def test(self) -> bool:
        done = self._request is None or self._request.Test()
        if done:
            self._finish()
        return done

    def wait(self) -> None:
        if self._request is not None:
            self._request.Wait()
        self._finish()

    def _finish(self) -> None:
        after, self.after = self.after, None
        if after is not None:
            after()


DONE = Request()  # what a blocking fallback returns


class StartedCollectives:
    """The started collectives of one mpi4py communicator, whose buffers take ``routes``;
    persistent ones while ``persistent`` (its reason: ``source``) holds."""

    def __init__(self, comm, routes: BufferRoutes, persistent: bool, source: str):
        self._comm, self._routes = comm, routes
        self.persistent, self.source = persistent, source
        self._requests: dict[tuple, Any] = {}  # key -> an MPI persistent request

    def reduce_scatter(self, buf) -> Request:
        """Start the in-place sum over ranks whose block for this rank lands at ``buf``'s
        front (out of place into a block, then copied there, where ``routes`` says so)."""
        spec = [buf, reduce_type(buf.dtype)]
        if self._routes.reduces_out_of_place(buf):
            block = self._routes.block_for(buf)
            out = [block, spec[1]]
            request = self._start(
                ("reduce_scatter_out", address(buf), buf.nbytes),
                lambda: self._comm.Reduce_scatter_block_init(spec, out, MPI.SUM),
                lambda: self._comm.Ireduce_scatter_block(spec, out, MPI.SUM),
                buf,
            )
            request.after = lambda: self._routes.land(buf, block)
            return request
        return self._start(
            ("reduce_scatter", address(buf), buf.nbytes),
            lambda: self._comm.Reduce_scatter_block_init(MPI.IN_PLACE, spec, MPI.SUM),
            lambda: self._comm.Ireduce_scatter_block(MPI.IN_PLACE, spec, MPI.SUM),
            buf,
        )

    def allreduce(self, buf) -> Request:
        """Start the in-place sum of ``buf`` over ranks (nonblocking)."""
        backend.synchronize(buf)  # MPI may read device memory as soon as it starts
        return Request(self._comm.Iallreduce(MPI.IN_PLACE, [buf, reduce_type(buf.dtype)], MPI.SUM))

    def alltoall(self, send, recv) -> Request:
        """Start sending block ``j`` of ``send`` to rank ``j``, receiving into ``recv``."""
        specs = ([as_bytes(send), MPI.BYTE], [as_bytes(recv), MPI.BYTE])
        return self._start(
            ("alltoall", address(send), address(recv), send.nbytes),
            lambda: self._comm.Alltoall_init(*specs),
            lambda: self._comm.Ialltoall(*specs),
            send,
        )

    def allgather(self, buf) -> Request:
        """Start gathering each rank's block of ``buf`` into every rank's ``buf``."""
        spec = [as_bytes(buf), MPI.BYTE]
        return self._start(
            ("allgather", address(buf), buf.nbytes),
            lambda: self._comm.Allgather_init(MPI.IN_PLACE, spec),
            lambda: self._comm.Iallgather(MPI.IN_PLACE, spec),
            buf,
        )

    def _start(self, key: tuple, make_persistent, make_nonblocking, buf) -> Request:
        """Start the persistent request of ``key`` (made by ``make_persistent()`` the first
        time), or a nonblocking one (``make_nonblocking()``) without persistent collectives."""
        backend.synchronize(buf)  # MPI may read device memory as soon as it starts
        request = self._requests.get(key)
        if request is None and self.persistent:
            try:
                request = self._requests[key] = make_persistent()
            except (NotImplementedError, MPI.Exception):  # an MPI before 4.0
                self.persistent = False
                self.source += "; no MPI-4 persistent collectives: nonblocking"
        if request is None:
            return Request(make_nonblocking())
        request.Start()
        return Request(request)

    def close(self, spans=None) -> None:
        """Complete and free the persistent requests on buffers starting in ``spans``
        (``(lo, hi)`` addresses; default: all of them)."""
        for key in list(self._requests):
            if spans is None or any(lo <= key[1] < hi for lo, hi in spans):
                request = self._requests.pop(key)
                request.Wait()  # MPI may not free an active request; inactive: returns at once
                request.Free()

    def __len__(self) -> int:
        """How many persistent requests are held."""
        return len(self._requests)

    def use(self, comm) -> None:
        """Start later collectives on ``comm`` (a freed communicator's stand-in)."""
        self._comm = comm


@functools.cache
def _reduce_types() -> dict:
    return {
        np.dtype(np.float32): MPI.FLOAT,
        np.dtype(np.float16): MPI.FLOAT16_T,
        np.dtype(np.float64): MPI.DOUBLE,
    }


def reduce_type(dtype):
    """The MPI datatype a sum of ``dtype`` runs in (float32, float16, float64)."""
    try:
        return _reduce_types()[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"MPI has no reduction for dtype {np.dtype(dtype).name}: reduce "
            "float32 or float16 buffers (bfloat16 gradients are exchanged with "
            "Alltoall and summed in float32)"
        ) from None
