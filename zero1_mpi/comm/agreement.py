"""Errors agreed across ranks, so that no rank waits forever for one that failed.

``agree`` raises on every rank the first failing rank's error; ``check_same`` raises
``CollectiveError`` on every rank where a value differs; ``collective_call`` runs another
library's collective and turns one rank's failure into every rank's; ``abort_on_error`` ends
the job where only this rank can fail between collectives. Each takes the mpi4py
communicator that ``Communicator`` holds (its methods are the public face of these).
"""

from __future__ import annotations

import builtins
import importlib
import sys
import threading
import time
import traceback
from contextlib import contextmanager

from .capabilities import MPI

__all__ = [
    "CollectiveError",
    "ABORT_GRACE_SECONDS",
    "agree",
    "check_same",
    "collective_call",
    "abort_on_error",
]

ABORT_GRACE_SECONDS = 0.2  # after writing why, before MPI_Abort (see abort_on_error)


class CollectiveError(RuntimeError):
    """Raised on every rank when the ranks disagree about something that must be identical."""


def agree(comm, error: Exception | str | None) -> None:
    """Raise on every rank of the mpi4py ``comm`` if any rank passes an error (an exception,
    or a message for a ValueError): the first failing rank's exception type and message,
    naming that rank."""
    failed = [(rank, e) for rank, e in enumerate(comm.allgather(_told(error))) if e is not None]
    if failed:
        rank, (module, name, message) = failed[0]
        where = f"rank {rank}" + (" (this rank)" if rank == comm.Get_rank() else "")
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise _exception(module, name, f"{message} [detected on {where}{more}]")


def check_same(comm, value, what: str, fix: str) -> None:
    """Raise ``CollectiveError`` on every rank unless ``value`` is equal on all ranks; for a
    dict, the message names the first key that differs and both values."""
    values = comm.allgather(value)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        other = differing[0]
        first, theirs = values[0], values[other]
        if isinstance(first, dict) and isinstance(theirs, dict):
            key = next(k for k in first if first.get(k) != theirs.get(k))
            what = f"{key} ({first[key]!r} on rank 0, {theirs.get(key)!r} on rank {other})"
        raise CollectiveError(f"{what} differs between ranks (rank 0 vs rank {other}): {fix}")


def collective_call(comm, call, what: str, poll_seconds: float = 0.001):
    """``call()`` on every rank, where ``call`` is another library's collective that blocks
    until all ranks have called it: a rank whose call raises tells every other rank, and every
    rank raises that exception (naming the rank), also those still blocked inside their call
    (left to a daemon thread). Returns ``call()``'s value when all ranks succeeded."""
    rank, size = comm.Get_rank(), comm.Get_size()
    outcomes = comm.Dup()  # its own messages, apart from everything else
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
            _raise_if_failed(outcomes.recv(source=MPI.ANY_SOURCE, tag=0), what)
            heard += 1
        elif not worker.is_alive():
            break
        else:
            time.sleep(poll_seconds)
    error = failure.get("error")
    told = _told(error)
    for peer in range(size):
        if peer != rank:
            outcomes.isend((rank, told), dest=peer, tag=0)
    if told is not None:  # as error is not None
        raise _exception(
            told[0], told[1], f"{told[2]} [{what} failed on rank {rank} (this rank)]"
        ) from error
    while heard < size - 1:  # every other rank's outcome: a failure raises here
        _raise_if_failed(outcomes.recv(source=MPI.ANY_SOURCE, tag=0), what)
        heard += 1
    outcomes.Free()
    return result.get("value")


@contextmanager
def abort_on_error(comm, doing: str):
    """Abort the whole job if this block raises: for work between collectives that only this
    rank might fail, where the other ranks would otherwise wait forever."""
    try:
        yield
    except BaseException:
        rank, size = comm.Get_rank(), comm.Get_size()
        if size > 1:
            # One write, and a moment for the launcher to forward it: MPI_Abort kills the
            # job at once, and what its proxies had not yet read is lost.
            sys.stderr.write(
                f"zero1_mpi: rank {rank} failed {doing}; aborting all {size} ranks so that "
                f"none waits forever\n{traceback.format_exc()}"
            )
            sys.stderr.flush()
            time.sleep(ABORT_GRACE_SECONDS)
            comm.Abort(1)
        raise


def _told(error) -> tuple[str, str, str] | None:
    """What a rank tells the others of ``error``: (module, type name, message), or None."""
    if isinstance(error, BaseException):
        return (type(error).__module__, type(error).__qualname__, str(error))
    if error is not None:
        return ("builtins", "ValueError", str(error))
    return None


def _raise_if_failed(outcome: tuple, what: str) -> None:
    """Raise what a rank's ``(rank, told)`` outcome tells of its failure, if it failed."""
    rank, told = outcome
    if told is not None:
        raise _exception(told[0], told[1], f"{told[2]} [{what} failed on rank {rank}]")


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
