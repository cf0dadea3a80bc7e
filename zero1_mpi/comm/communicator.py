"""The communicator: every collective the package runs, on NumPy or CuPy buffers alike.

``Communicator`` wraps an mpi4py intracommunicator: blocking and started (``start_*``)
collectives on array buffers, collectives on small Python objects, agreement on errors
(``agree``, ``check_same``, ``collective_call``, ``abort_on_error``: ``agreement.py``); all
ranks, but ``send``/``recv`` and ``abort_on_error``. How buffers reach MPI (``staging.py``) and
which started collectives run (``started.py``) is decided once (``capabilities.py``) and agreed;
``mpi4py.MPI`` (which starts MPI) is imported at its first use, not with this module.
"""

from __future__ import annotations

import numpy as np

from ..kernels import backend
from . import agreement
from .agreement import CollectiveError
from .capabilities import (
    CUDA_AWARE_ENV,
    DEVICE_STARTED_ENV,
    MPI,
    PERSISTENT_ENV,
    resolve_cuda_aware,
    resolve_device_started,
    resolve_persistent,
)
from .staging import BufferRoutes, address, as_bytes
from .started import DONE, Request, StartedCollectives, reduce_type

__all__ = ["Communicator", "CollectiveError"]


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
        self.cuda_aware, self.cuda_aware_source = False, "unresolved"
        persistent_found = (False, "unresolved")
        #: Whether started collectives take device buffers (else those run blocking), and why.
        self.device_started, self.device_started_source = False, "unresolved"
        error = None
        try:
            self.cuda_aware, self.cuda_aware_source = resolve_cuda_aware(cuda_aware)
            persistent_found = resolve_persistent(persistent)
            self.device_started, self.device_started_source = resolve_device_started(device_started)
        except (TypeError, ValueError) as exc:  # a setting of one rank's environment
            error = exc
        #: How each buffer reaches MPI, and the staging buffers and blocks that takes.
        self.routes = BufferRoutes(
            self.size,
            cuda_aware=self.cuda_aware,
            device_started=self.device_started,
            stage_host=stage_host,
            reduce_out_of_place=reduce_out_of_place,
        )
        #: The started collectives on buffers MPI takes as they are, and their requests.
        self.started = StartedCollectives(comm, self.routes, *persistent_found)
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

    # -- agreement on errors and values (agreement.py) -------------------------------------

    @property
    def persistent(self) -> bool:
        """Whether started collectives are MPI-4 persistent ones (else nonblocking)."""
        return self.started.persistent

    @property
    def persistent_source(self) -> str:
        """Why ``persistent`` is what it is."""
        return self.started.source

    def agree(self, error: Exception | str | None) -> None:
        """Raise on every rank if any rank passes an error (an exception, or a message for a
        ValueError): the first failing rank's exception type and message, naming that rank."""
        agreement.agree(self._comm, error)

    def abort_on_error(self, doing: str):
        """Abort the whole job if this block raises: for work between collectives that only
        this rank might fail, where the other ranks would otherwise wait forever."""
        return agreement.abort_on_error(self._comm, doing)

    def abort(self, errorcode: int = 1) -> None:
        """MPI Abort: end every rank of the job (callable from any thread, this rank alone)."""
        self._comm.Abort(errorcode)

    def collective_call(self, call, what: str, poll_seconds: float = 0.001):
        """``call()``, another library's collective, on every rank; one rank's failure raises
        on every rank (``agreement.collective_call``). Returns ``call()``'s value."""
        return agreement.collective_call(self._comm, call, what, poll_seconds)

    def check_same(self, value, what: str, fix: str) -> None:
        """Raise ``CollectiveError`` on every rank unless ``value`` is equal on all ranks.

        For a dict, the message names the first key that differs and both values.
        """
        agreement.check_same(self._comm, value, what, fix)

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
        with self.routes.host_view(buf, "bcast") as host:
            self._comm.Bcast([as_bytes(host), MPI.BYTE], root=root)

    def reduce_scatter_sum(self, buf):
        """In place: this rank's block of the sum over ranks lands in ``buf`` at
        ``reduced_block(buf)``, which is returned."""
        mpi_type = reduce_type(buf.dtype)
        if self.routes.reduces_out_of_place(buf):
            block = self.routes.block_for(buf)
            backend.synchronize(buf)
            self._comm.Reduce_scatter_block([buf, mpi_type], [block, mpi_type], MPI.SUM)
            return self.routes.land(buf, block)
        with self.routes.host_view(buf, "reduce_scatter") as host:
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
        mpi_type = reduce_type(buf.dtype)
        with self.routes.host_view(buf, "allreduce") as host:
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
            self.routes.host_view(send, "a2a_send", copy_out=False) as host_send,
            self.routes.host_view(recv, "a2a_recv", copy_in=False) as host_recv,
        ):
            self._comm.Alltoall([as_bytes(host_send), MPI.BYTE], [as_bytes(host_recv), MPI.BYTE])

    def allgather_inplace(self, buf) -> None:
        """Each rank's block of ``buf`` (block ``rank``, len/size elements) goes to every rank."""
        with self.routes.host_view(buf, "allgather") as host:
            self._comm.Allgather(MPI.IN_PLACE, [as_bytes(host), MPI.BYTE])

    # -- started collectives: persistent (MPI-4) where proven, else nonblocking (started.py) -

    def start_reduce_scatter(self, buf) -> Request:
        """Start ``reduce_scatter_sum(buf)``; the returned request's ``wait()`` completes it."""
        if self.routes.runs_blocking(buf):
            return self._blocking(self.reduce_scatter_sum, buf)
        return self.started.reduce_scatter(buf)

    def start_allreduce(self, buf) -> Request:
        """Start ``allreduce_inplace(buf)`` (nonblocking; blocking where ``buf`` is staged)."""
        if self.routes.runs_blocking(buf):
            return self._blocking(self.allreduce_inplace, buf)
        return self.started.allreduce(buf)

    def start_alltoall(self, send, recv) -> Request:
        """Start ``alltoall(send, recv)``."""
        if self.routes.runs_blocking(send) or self.routes.runs_blocking(recv):
            return self._blocking(self.alltoall, send, recv)
        return self.started.alltoall(send, recv)

    def start_allgather(self, buf) -> Request:
        """Start ``allgather_inplace(buf)``."""
        if self.routes.runs_blocking(buf):
            return self._blocking(self.allgather_inplace, buf)
        return self.started.allgather(buf)

    @staticmethod
    def _blocking(collective, *buffers) -> Request:
        collective(*buffers)
        return DONE

    def close(self, buffers=None) -> None:
        """Complete and free the persistent requests made for ``buffers`` (arrays; default:
        all of them)."""
        spans = (
            None
            if buffers is None
            else [(address(b), address(b) + b.nbytes) for b in buffers if b is not None]
        )
        self.started.close(spans)
        self.routes.release_blocks(spans)

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
        self.routes.clear()
        comm, self._comm = self._comm, _Freed(type(self).__name__)
        self.started.use(self._comm)
        if self.owns_comm:
            comm.Free()


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
