"""``Communicator.collective_call``: a call that blocks until every rank has made it (as NCCL's
communicator initialisation does) and fails on one rank must raise on every rank, including
those still blocked inside their call; and ``nccl.exchange_unique_id`` gives every rank rank
0's id, or rank 0's error. The blocking call here is a barrier on another communicator that
the failing rank never enters, so the others stay inside it for good.

    mpiexec -n N python -m mpi4py tests/cases/collective_call.py   (N >= 2)
"""

import time

from mpi4py import MPI

from casekit import check
from zero1_mpi import Communicator
from zero1_mpi.comm.nccl import exchange_unique_id

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
comm = Communicator(world)
last = size - 1


def expect_failure(call, words):
    started = time.monotonic()
    try:
        comm.collective_call(call, "the test's call")
    except ValueError as exc:
        check(all(w in str(exc) for w in words), f"rank {rank}: {exc}")
    else:
        raise AssertionError(f"rank {rank}: no error although a rank failed")
    check(time.monotonic() - started < 30, f"rank {rank}: the error took too long")


def blocked_forever(other):
    def call():
        other.Barrier()  # never completes: the failing rank does not enter it
    return call


def fail(message, delay=0.0):
    def call():
        time.sleep(delay)
        raise ValueError(message)
    return call


# 1. The last rank fails at once; the others are blocked inside their call.
hang = world.Dup()
expect_failure(fail("no such device") if rank == last else blocked_forever(hang),
               ["no such device", f"failed on rank {last}"])
if rank == last:
    hang.Barrier()  # lets the others' abandoned calls finish, so that MPI can finalize
# 2. Rank 0 fails late, after every other rank's call has returned.
expect_failure(fail("out of memory", 0.5) if rank == 0 else (lambda: rank),
               ["out of memory", "failed on rank 0"])
# 3. Every rank succeeds: each gets its own value, and nothing is left over.
check(comm.collective_call(lambda: rank * 2, "the test's call") == rank * 2, "value")
# 4. The unique id travels from rank 0; an error there is raised on every rank.
uid = exchange_unique_id(comm, lambda: b"id-of-rank-%d" % rank)
check(uid == b"id-of-rank-0", f"rank {rank} got {uid!r}")
try:
    exchange_unique_id(comm, fail("NCCL is not loaded"))
except ValueError as exc:
    check("NCCL is not loaded" in str(exc) and "rank 0" in str(exc), str(exc))
else:
    raise AssertionError("no error from exchange_unique_id")
world.Barrier()
if rank == 0:
    print(f"OK collective_call on {size} ranks")
