"""An NCCL communicator for CuPy buffers behind the ``Communicator`` interface (GPU fast path).

``ZeroAdam(cupy_params, comm=NcclCommunicator(MPI.COMM_WORLD))``: collectives on device buffers
run through NCCL (``cupy.cuda.nccl``), with no staging and no CUDA-aware MPI; agreement, host
numbers and checkpoint traffic stay on MPI, which also carries NCCL's unique id. Blocking
collectives run on the current CuPy stream; started ones on the communicator's own stream,
after an event on the current stream, and their ``wait()`` makes the current stream wait (no
host synchronisation). Pick each rank's GPU (by node-local rank) before building it: NCCL
refuses two ranks on one GPU, which every rank reports before NCCL starts. Must be built on all
ranks; a rank whose NCCL initialisation fails makes every rank raise, none hangs. It cannot
``split`` (so no hierarchical sharding yet).
"""

from __future__ import annotations

import socket

import numpy as np

from ..kernels import backend
from .communicator import Communicator
from .started import Request

__all__ = ["NcclCommunicator", "exchange_unique_id", "shared_gpu_error"]


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(
            "NcclCommunicator needs CuPy built with NCCL: pip install "
            "'zero1-mpi[cuda12,nccl12]' (or [cuda13,nccl13])"
        ) from exc
    if not getattr(nccl, "available", True):  # CuPy imports it even where libnccl is missing
        raise ImportError(
            "NcclCommunicator needs the NCCL library, which CuPy did not find: "
            "pip install 'zero1-mpi[nccl12]' (or [nccl13], matching CuPy's CUDA)"
        )
    return nccl


class NcclCommunicator(Communicator):
    """``Communicator`` whose device-buffer collectives go through NCCL.

    Args:
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None).
    """

    supports_split = False

    def __init__(self, comm=None):
        super().__init__(comm, cuda_aware=False)
        error = None
        try:
            nccl = _nccl()
            self._types = {
                "float32": nccl.NCCL_FLOAT32,
                "float16": nccl.NCCL_FLOAT16,
                "bfloat16": getattr(nccl, "NCCL_BFLOAT16", None),
            }
            self._bytes_type, self._sum = nccl.NCCL_UINT8, nccl.NCCL_SUM
            self._group = (nccl.groupStart, nccl.groupEnd)
            device = (socket.gethostname(), backend.xp_for("cupy").cuda.Device().pci_bus_id)
        except ImportError as exc:
            error, device = exc, None
        self.agree(error)
        self.agree(shared_gpu_error(self.allgather_objects(device)))
        uid = exchange_unique_id(self, nccl.get_unique_id)
        self.nccl = self.collective_call(
            lambda: nccl.NcclCommunicator(self.size, uid, self.rank),
            "NCCL's communicator initialisation",
        )
        self.stream = backend.xp_for("cupy").cuda.Stream(non_blocking=True)

    def free(self) -> None:
        """``Communicator.free``, after completing the work queued on this communicator's
        stream and destroying the NCCL communicator (``ncclCommDestroy``); idempotent. Must
        be called on all ranks."""
        if self.nccl is not None:
            self.stream.synchronize()
            self.nccl.destroy()
            self.nccl = self.stream = None
        super().free()

    def split(self, color: int) -> Communicator:
        """Not available: raises NotImplementedError (an NCCL communicator per group is not
        built yet)."""
        raise NotImplementedError(
            "NcclCommunicator cannot split into sub-communicators, so "
            "it cannot run hierarchical sharding (shard_group_size): "
            "shard over all ranks, or use zero1_mpi.Communicator (MPI)"
        )

    # Device buffers through NCCL; host buffers (tests, checkpoints) through MPI as before.

    def bcast(self, buf, root: int = 0) -> None:
        if not backend.is_device_array(buf):
            return super().bcast(buf, root)
        self.nccl.bcast(_ptr(buf), buf.nbytes, self._bytes_type, root, _stream())

    def reduce_scatter_sum(self, buf):
        if not backend.is_device_array(buf):
            return super().reduce_scatter_sum(buf)
        block = self.reduced_block(buf)  # NCCL in place: recvbuff = sendbuff + rank * count
        self.nccl.reduceScatter(
            _ptr(buf), _ptr(block), block.size, self._type(buf), self._sum, _stream()
        )
        return block

    def reduced_block(self, buf):
        if not backend.is_device_array(buf):
            return super().reduced_block(buf)
        count = buf.size // self.size
        return buf[self.rank * count : (self.rank + 1) * count]

    def alltoall(self, send, recv) -> None:
        if not backend.is_device_array(send):
            return super().alltoall(send, recv)
        block = send.nbytes // self.size
        start, end = self._group
        start()
        for peer in range(self.size):  # NCCL has no all-to-all: grouped sends and receives
            self.nccl.send(_ptr(send) + peer * block, block, self._bytes_type, peer, _stream())
            self.nccl.recv(_ptr(recv) + peer * block, block, self._bytes_type, peer, _stream())
        end()

    def allgather_inplace(self, buf) -> None:
        if not backend.is_device_array(buf):
            return super().allgather_inplace(buf)
        block = buf.nbytes // self.size
        self.nccl.allGather(
            _ptr(buf) + self.rank * block, _ptr(buf), block, self._bytes_type, _stream()
        )

    def start_reduce_scatter(self, buf) -> Request:
        if not backend.is_device_array(buf):
            return super().start_reduce_scatter(buf)
        return self._on_own_stream(lambda: self.reduce_scatter_sum(buf))

    def start_alltoall(self, send, recv) -> Request:
        if not backend.is_device_array(send):
            return super().start_alltoall(send, recv)
        return self._on_own_stream(lambda: self.alltoall(send, recv))

    def start_allgather(self, buf) -> Request:
        if not backend.is_device_array(buf):
            return super().start_allgather(buf)
        return self._on_own_stream(lambda: self.allgather_inplace(buf))

    def _on_own_stream(self, collective) -> Request:
        """Queue ``collective`` on this communicator's stream, after everything queued so far
        on the current stream; its request orders later work on the current stream after it."""
        cupy = backend.xp_for("cupy")
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record()
        self.stream.wait_event(ready)
        with self.stream:  # the collectives take the current stream: this one, here
            collective()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return _EventRequest(done)

    def _type(self, buf) -> int:
        kind = self._types.get(np.dtype(buf.dtype).name)
        if kind is None:
            raise TypeError(f"NCCL has no sum for {buf.dtype}")
        return kind


class _EventRequest(Request):
    """Work queued on another stream, complete when its event is: ``wait()`` makes the current
    stream wait for it (work queued after ``wait()`` sees the result; the host does not
    block)."""

    def __init__(self, event):
        super().__init__()
        self._event = event

    def test(self) -> bool:
        return self._event.done

    def wait(self) -> None:
        backend.xp_for("cupy").cuda.get_current_stream().wait_event(self._event)


def exchange_unique_id(comm: Communicator, make_id):
    """Rank 0's ``make_id()`` (NCCL's unique id) on every rank, through MPI; if it fails there,
    every rank raises its error instead of waiting."""
    uid, error = None, None
    if comm.rank == 0:
        try:
            uid = make_id()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
    comm.agree(error)
    return comm.bcast_object(uid)


def _ptr(buf) -> int:
    return buf.data.ptr


def shared_gpu_error(devices: list) -> RuntimeError | None:
    """The error for the first GPU that two ranks would share, from each rank's ``(host, PCI
    bus id)`` in rank order; None when every rank has a GPU of its own."""
    first: dict[tuple, int] = {}  # (host, bus) -> the first rank on it
    for rank, device in enumerate(devices):
        if device in first:
            host, bus = device
            return RuntimeError(
                f"ranks {first[device]} and {rank} both use the GPU {bus} on {host}: NCCL "
                "refuses two ranks on one GPU ('Duplicate GPU detected', since NCCL 2.5). Run "
                "as many ranks per node as it has GPUs, each on the GPU of its node-local rank "
                "(zero1_mpi.kernels.backend.use_device), or let ranks share GPUs through "
                "zero1_mpi.Communicator (MPI, staged or CUDA-aware)"
            )
        first[device] = rank
    return None


def _stream() -> int:
    return backend.xp_for("cupy").cuda.get_current_stream().ptr
