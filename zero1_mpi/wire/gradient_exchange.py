"""The gradients' wire format: how a bucket travels within its shard group, and how a reduced
shard is summed across the groups.

``GroupExchange`` sends each rank its rows of a bucket by ``Alltoall`` into a receive slot and
sums the rows here in fp32 in rank order (the same bits on every MPI): 16-bit rows as they are
(``reduce_dtype="float32"``), or 8-bit blocks (``"int8"``, ``wire``'s format). ``AcrossGroups``
sums a reduced shard over the replicas of its shard group: MPI's ``Allreduce`` (fp32 on the wire
for a 16-bit shard, MPI having no bfloat16 sum), or the 8-bit blocks of every replica gathered
and summed in rank order. ``Quantizer`` is the 8-bit encoder of either, with its error-feedback
buffer (what quantizing dropped, added to the next step's values). Methods that start or
complete collectives must be called on all ranks of their communicator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm.started import DONE, Request
from ..kernels import backend
from .codec import packed_bytes

__all__ = [
    "Quantizer",
    "GroupExchange",
    "AcrossGroups",
    "GradientWire",
    "FP32",
    "REDUCE_DTYPES",
    "COMPRESS_HOPS",
    "check_reduce_dtype",
    "check_compress_hops",
    "check_error_feedback",
]

FP32 = np.dtype(np.float32)


class Quantizer:
    """``codec`` (``wire.codec_for``) with, for error feedback, a residual of ``size`` values
    of ``dtype`` (zeros at first), indexed like the values encoded (``offset``)."""

    def __init__(self, codec, xp, size: int, dtype, feedback: bool):
        self.codec = codec
        #: What quantizing dropped so far, by position (None: no error feedback).
        self.residual: Any = backend.zeros(xp, size, dtype) if feedback else None

    @property
    def feedback_bytes(self) -> int:
        return 0 if self.residual is None else self.residual.nbytes

    def rescale(self, factor: float) -> None:
        """Multiply the residual by ``factor`` (the loss scale's change; 0: forget it)."""
        if self.residual is None:
            return
        if factor == 0:
            self.residual.fill(0)
        else:
            self.residual *= self.residual.dtype.type(factor)

    def encode(self, values, packed, offset: int) -> None:
        """``packed`` = ``values`` (plus their residual) quantized; the residual updated."""
        residual = None if self.residual is None else self.residual[offset : offset + values.size]
        self.codec.encode(values, packed, residual)


class GroupExchange:
    """A bucket's rows exchanged by ``Alltoall`` over ``comm`` (the shard group) and summed
    here in rank order, through ``slots`` receive slots of ``largest`` (bucket) values.

    Args:
        comm: the shard group's ``Communicator``.
        xp, dtype: the gradients' array module and dtype.
        reductions: the engine's reductions (``sum_blocks``, for 16-bit rows).
        quantizer: a ``Quantizer`` for 8-bit rows, or None (rows as they are).
    """

    def __init__(self, comm, xp, slots: int, largest: int, dtype, reductions, quantizer=None):
        self._comm, self._reductions, self.quantizer = comm, reductions, quantizer
        self.slots = slots
        self._row = None if quantizer is None else packed_bytes(largest // comm.size)
        if quantizer is None:
            self._send: Any = None
            self._received: Any = xp.empty((slots, largest), dtype)
        else:
            self._send = xp.empty((slots, comm.size * self._row), np.uint8)
            self._received = xp.empty((slots, comm.size * self._row), np.uint8)

    @property
    def buffers(self) -> list:
        """The arrays persistent requests may hold (for ``Communicator.close``)."""
        return [b for b in (self._send, self._received) if b is not None]

    @property
    def scratch_bytes(self) -> int:
        """The buffers, and the 8-bit codec's own scratch."""
        codec = 0 if self.quantizer is None else self.quantizer.codec.scratch_bytes
        return sum(b.nbytes for b in self.buffers) + codec

    def start(self, slot: int, grads, offset: int) -> Request:
        """Start sending ``grads`` (a bucket at flat ``offset``) to the group: row ``r`` (its
        ``r``-th ``1/K``) to rank ``r``, into receive slot ``slot``."""
        k = self._comm.size
        if self.quantizer is None:
            return self._comm.start_alltoall(grads, self._received[slot, : grads.size])
        rows, row = grads.size // k, packed_bytes(grads.size // k)
        send = self._send[slot, : k * row]
        for r in range(k):
            self.quantizer.encode(
                grads[r * rows : (r + 1) * rows], send[r * row : (r + 1) * row], offset + r * rows
            )
        return self._comm.start_alltoall(send, self._received[slot, : k * row])

    def finish(self, slot: int, size: int, out) -> None:
        """``out`` (fp32, ``size / K`` values) = the rows received in slot ``slot`` (of a
        bucket of ``size`` values) summed in fp32, in rank order."""
        k = self._comm.size
        if self.quantizer is None:
            self._reductions.sum_blocks(self._received[slot, :size].reshape(k, -1), out)
            return
        row = packed_bytes(size // k)
        rows = self._received[slot, : k * row].reshape(k, row)
        self.quantizer.codec.decode_sum(rows, size // k, out)


class AcrossGroups:
    """A reduced shard summed over ``comm`` (the replicas of this rank's shard: one rank per
    shard group), in place.

    In 8 bits, over R replicas: for R = 2 each replica's quantized shard goes to the other
    (``Allgather``) and both are decoded and summed in rank order; for R > 2, so that the bytes
    stay 2(R-1)/R of the shard's (as MPI's ring sends, at a quarter of fp32's), the shard is cut
    into R parts and reduce-scattered (``Alltoall``, decoded and summed here), then each summed
    part quantized once more (no residual) and gathered (``Allgather``) for every replica to
    decode alike.

    Args:
        comm: the replicas' ``Communicator``.
        xp: the array module.
        largest: the most values of one shard (a bucket's shard).
        shard_dtype: the reduced shards' dtype.
        quantizer: a ``Quantizer`` for 8-bit blocks on the wire, or None (MPI's sum).
    """

    def __init__(self, comm, xp, largest: int, shard_dtype, quantizer=None):
        self._comm, self.quantizer, self._xp = comm, quantizer, xp
        r = comm.size
        self._scratch: Any = None
        self._send: Any = None
        self._received: Any = None
        self._part: Any = None
        self._gathered: Any = None
        if quantizer is None:
            if shard_dtype not in (FP32, np.dtype(np.float16)):
                self._scratch = xp.empty(largest, FP32)  # MPI has no bfloat16 sum
            return
        self._scratch = xp.empty(largest, FP32) if shard_dtype != FP32 else None
        if r == 2:
            self._gathered = xp.empty(r * packed_bytes(largest), np.uint8)
            return
        part = -(-largest // r)
        self._send = xp.empty(r * packed_bytes(part), np.uint8)
        self._received = xp.empty(r * packed_bytes(part), np.uint8)
        self._gathered = xp.empty(r * packed_bytes(part), np.uint8)
        self._part = xp.empty(part, FP32)

    @property
    def buffers(self) -> list:
        held = (self._gathered, self._send, self._received, self._part, self._scratch)
        return [b for b in held if b is not None]

    @property
    def scratch_bytes(self) -> int:
        """The buffers, and the 8-bit codec's own scratch."""
        codec = 0 if self.quantizer is None else self.quantizer.codec.scratch_bytes
        return sum(b.nbytes for b in self.buffers) + codec

    def start(self, shard, offset: int) -> Request:
        """Start summing ``shard`` (at ``offset`` in this rank's shard arrays) over the
        replicas: nonblocking where MPI sums it in place; in 8 bits, deferred to the request's
        ``wait()`` (so that no blocking collective across the groups runs during backward);
        else done on return (``sum``)."""
        if self.quantizer is None and self._scratch is None:
            return self._comm.start_allreduce(shard)
        if self.quantizer is not None:
            return _Deferred(lambda: self.sum(shard, offset))
        self.sum(shard, offset)
        return DONE

    def sum(self, shard, offset: int) -> None:
        """``shard`` = its sum over the replicas, blocking."""
        total = shard if self._scratch is None else self._scratch[: shard.size]
        if self.quantizer is None:
            if total is not shard:
                total[...] = shard
            self._comm.allreduce_inplace(total)
        elif self._comm.size == 2:
            self._gather_sum(shard, offset, total)
        else:
            self._scatter_gather_sum(shard, offset, total)
        if total is not shard:
            shard[...] = total

    def _gather_sum(self, shard, offset: int, total) -> None:
        r, row, rank = self._comm.size, packed_bytes(shard.size), self._comm.rank
        gathered = self._gathered[: r * row]
        self.quantizer.encode(shard, gathered[rank * row : (rank + 1) * row], offset)
        self._comm.allgather_inplace(gathered)
        self.quantizer.codec.decode_sum(gathered.reshape(r, row), shard.size, total)

    def _scatter_gather_sum(self, shard, offset: int, total) -> None:
        r, rank, n, codec = self._comm.size, self._comm.rank, shard.size, self.quantizer.codec
        part = -(-n // r)
        row = packed_bytes(part)
        parts = [(min(n, j * part), min(n, (j + 1) * part)) for j in range(r)]
        send, received = self._send[: r * row], self._received[: r * row]
        for j, (lo, hi) in enumerate(parts):
            packed = send[j * row : j * row + packed_bytes(hi - lo)]
            self.quantizer.encode(shard[lo:hi], packed, offset + lo)
        self._comm.alltoall(send, received)
        lo, hi = parts[rank]
        mine = self._part[: hi - lo]
        codec.decode_sum(received.reshape(r, row), hi - lo, mine)
        gathered = self._gathered[: r * row]
        codec.encode(mine, gathered[rank * row : rank * row + packed_bytes(hi - lo)])
        self._comm.allgather_inplace(gathered)
        for j, (lo, hi) in enumerate(parts):
            codec.decode_sum(
                gathered[j * row : (j + 1) * row].reshape(1, row), hi - lo, total[lo:hi]
            )


class _Deferred(Request):
    """A collective run, blocking, at ``wait()`` (``test()`` does not start it)."""

    def __init__(self, run):
        super().__init__()
        self._run = run

    def test(self) -> bool:
        return self._run is None

    def wait(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run()


class GradientWire:
    """A gradient source's wire: its ``exchange`` within the group and its sum ``across`` the
    groups (either None), with what the ledger and the step ask of both together."""

    def __init__(self, exchange, across):
        self.exchange, self.across = exchange, across
        self._parts = [p for p in (exchange, across) if p is not None]

    @property
    def scratch_bytes(self) -> int:
        return sum(part.scratch_bytes for part in self._parts)

    @property
    def feedback_bytes(self) -> int:
        """Bytes of the error-feedback residuals (8-bit wire with ``error_feedback``)."""
        return sum(p.quantizer.feedback_bytes for p in self._parts if p.quantizer)

    def rescale_feedback(self, factor: float) -> None:
        """Multiply the error-feedback residuals by ``factor`` (0: forget them)."""
        for part in self._parts:
            if part.quantizer is not None:
                part.quantizer.rescale(factor)


# -- the engine options this module owns (declared in config/options.py) ---------------

REDUCE_DTYPES = ("float32", "float16", "int8")
COMPRESS_HOPS = ("all", "across")


def check_reduce_dtype(value, checked):
    try:
        name = value if isinstance(value, str) else np.dtype(value).name
    except TypeError:
        name = None
    if name not in REDUCE_DTYPES:
        raise ValueError(
            f"reduce_dtype={value!r} is not supported: use 'float32' (default), 'int8' "
            "(8-bit blocks on the wire) or 'float16' (float16 parameters only)"
        )
    dtype = checked["param_dtype"]
    if name == "float16" and dtype != np.float16:
        raise ValueError(
            f"reduce_dtype='float16' needs float16 gradients, but param_dtype is "
            f"{dtype.name}: use reduce_dtype='float32'"
        )
    return name


def check_compress_hops(value, checked):
    if value not in COMPRESS_HOPS:
        raise ValueError(
            f"compress_hops={value!r} is not understood: use 'all' (every hop of the "
            "reduction in 8 bits) or 'across' (only the sum across shard groups)"
        )
    if value == "across" and checked["reduce_dtype"] != "int8":
        raise ValueError(
            f"compress_hops='across' chooses which hops reduce_dtype='int8' compresses, but "
            f"reduce_dtype is {checked['reduce_dtype']!r}: pass reduce_dtype='int8' too"
        )
    return value


def check_error_feedback(value, checked):
    if not isinstance(value, bool):
        raise ValueError(f"error_feedback={value!r} must be True or False")
    if value and checked["reduce_dtype"] != "int8":
        raise ValueError(
            "error_feedback=True keeps what 8-bit quantizing drops, but reduce_dtype is "
            f"{checked['reduce_dtype']!r}: pass reduce_dtype='int8' too, or drop it"
        )
    return value
