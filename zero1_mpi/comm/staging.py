"""How a buffer reaches MPI: as it is, or staged through a reusable host buffer.

``BufferRoutes`` decides, from the communicator's agreed settings, whether a buffer goes to MPI
as it is or through pinned host memory (``host_view``), whether a started collective on it runs
blocking, and whether its reduce-scatter runs out of place into a block beside it (and lands
that block where the in-place one would leave it). It holds the staging buffers and the blocks,
counts their bytes and releases them. It calls no MPI: the communicator does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import backend

__all__ = ["BufferRoutes", "address", "as_bytes"]


class BufferRoutes:
    """The route of each buffer to MPI, and the host memory and blocks the routes hold.

    Args:
        size: the communicator's number of ranks (a reduce-scatter's block is 1/size).
        cuda_aware: MPI takes device buffers (else they are staged through pinned memory).
        device_started: started collectives take device buffers (else those run blocking).
        stage_host: host buffers are staged too (tests, debugging).
        reduce_out_of_place: see ``Communicator``; None: for device buffers MPI takes.
    """

    def __init__(
        self,
        size: int,
        *,
        cuda_aware: bool,
        device_started: bool,
        stage_host: bool,
        reduce_out_of_place: bool | None,
    ):
        self.size = size
        self.cuda_aware = cuda_aware
        self.device_started = device_started
        self.stage_host = stage_host
        self.reduce_out_of_place = reduce_out_of_place
        self._staging: dict[str, np.ndarray] = {}
        #: (address, nbytes) of a buffer -> the block an out-of-place reduce-scatter fills.
        self._blocks: dict[tuple[int, int], Any] = {}

    def host_view(self, buf, role: str, copy_in: bool = True, copy_out: bool = True):
        """Context manager: a buffer MPI can use for ``buf`` (``buf`` itself, or the staging
        buffer of ``role`` holding its bytes when ``copy_in``); on a clean exit, copies back
        what MPI wrote when ``copy_out``."""
        return _Staged(self, buf, role, copy_in, copy_out)

    def runs_blocking(self, buf) -> bool:
        """Whether a started collective on ``buf`` runs as a blocking one: staged buffers, and
        device buffers unless started collectives are allowed them (``device_started``)."""
        if backend.is_device_array(buf):
            return not (self.cuda_aware and self.device_started)
        return self.stage_host

    def reduces_out_of_place(self, buf) -> bool:
        if self.reduce_out_of_place is not None:
            return self.reduce_out_of_place and not self.needs_staging(buf)
        return backend.is_device_array(buf) and self.cuda_aware

    def block_for(self, buf):
        """The block (``buf.size // size`` elements, beside ``buf``) that an out-of-place
        reduce-scatter of ``buf`` fills: one per buffer, as two may be in flight."""
        key = (address(buf), buf.nbytes)
        block = self._blocks.get(key)
        if block is None:
            xp = backend.xp_for("cupy" if backend.is_device_array(buf) else "numpy")
            block = self._blocks[key] = xp.empty(buf.size // self.size, buf.dtype)
        return block

    def land(self, buf, block):
        """Copy an out-of-place reduce-scatter's ``block`` to where the in-place one leaves
        it (the front of ``buf``), which is returned."""
        front = buf[: block.size]
        front[...] = block
        return front

    def needs_staging(self, buf) -> bool:
        if backend.is_device_array(buf):
            return not self.cuda_aware
        return self.stage_host

    def staging_buffer(self, role: str, like) -> np.ndarray:
        """A reusable (pinned, for device buffers) host buffer for ``role``, grown as needed."""
        held = self._staging.get(role)
        if held is None or held.nbytes < like.nbytes:
            held = backend.pinned_empty(like.nbytes, device=backend.is_device_array(like))
            self._staging[role] = held
        return held[: like.nbytes].view(like.dtype)

    @property
    def staging_bytes(self) -> int:
        return sum(buf.nbytes for buf in self._staging.values())

    @property
    def block_bytes(self) -> int:
        """Bytes of the blocks out-of-place reduce-scatters fill (beside their buffers)."""
        return sum(block.nbytes for block in self._blocks.values())

    def release_blocks(self, spans=None) -> None:
        """Drop the blocks of the buffers starting in ``spans`` (``(lo, hi)`` addresses;
        default: all of them)."""
        for key in list(self._blocks):
            if spans is None or any(lo <= key[0] < hi for lo, hi in spans):
                del self._blocks[key]

    def clear(self) -> None:
        """Drop the staging buffers and the blocks."""
        self._staging.clear()
        self._blocks.clear()


class _Staged:
    """Context manager: a host buffer MPI can use for ``buf``; copies back what MPI wrote."""

    def __init__(self, routes: BufferRoutes, buf, role: str, copy_in: bool, copy_out: bool):
        self.buf = buf
        self.host = routes.staging_buffer(role, buf) if routes.needs_staging(buf) else None
        self.copy_in = copy_in
        self.copy_out = copy_out

    def __enter__(self):
        if self.host is None:  # not staged
            backend.synchronize(self.buf)  # MPI reads device memory: the writes must be done
            return self.buf
        if self.copy_in:
            backend.copy_to_host(self.buf, self.host)
        return self.host

    def __exit__(self, exc_type, exc, tb):
        if self.host is not None and self.copy_out and exc_type is None:  # staged
            backend.copy_from_host(self.host, self.buf)
        return False


def address(buf) -> int:
    """The address of ``buf``'s first byte (host or device)."""
    face = getattr(buf, "__cuda_array_interface__", None) or buf.__array_interface__
    return face["data"][0]


def as_bytes(buf):
    """``buf`` as a flat uint8 view (for collectives that only move bytes)."""
    return buf.reshape(-1).view(np.uint8)
