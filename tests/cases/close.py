"""close() and the context manager release everything an optimizer holds: many optimizers with
hierarchical sharding built and closed in one process (each splits two sub-communicators: an
MPI library runs out of them unless close() frees them; MPICH's limit is 2048), with the
collectives of a step left in flight, stage 2 and offload threads among them; afterwards the
threads are those of the start, COMM_WORLD and a caller's Communicator still work, and every
use of a closed optimizer raises, naming close(), on every rank.

    mpiexec -n N python -m mpi4py tests/cases/close.py [COUNT]   (N even, 4 or more for K = 2)
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check
from zero1_mpi import Communicator, ZeroAdamW, ZeroSGD

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 1200  # 2,400 splits: MPICH has 2,046
K = 2 if size >= 4 and size % 2 == 0 else None  # two groups or more: two splits each
SHAPES = {"w": (3, 5), "b": (4,)}


def params():
    return kit.init_values(SHAPES)


def grads(opt, step):
    kit.hand_over(opt, kit.grads_of(rank, step, SHAPES))


def raises_naming_close(call, what):
    try:
        call()
    except RuntimeError as exc:
        check("close()" in str(exc) and "closed" in str(exc), f"{what}: {exc}")
        return
    check(False, f"{what} on a closed optimizer raised nothing")


def variant(i):
    """Every 50th: stage 2 with a step; every 100th (offset): offload threads; else plain,
    every 10th with a step left in flight (step(wait=False)) for close() to complete."""
    if i % 50 == 0:
        return {"shard_gradients": True}, True
    if i % 100 == 25:
        return {"offload": "cpu", "offload_threads": 2}, True
    return {}, i % 10 == 0


threads_before = threading.active_count()
user = Communicator(comm)  # a caller's communicator: close() must leave it usable
started = time.perf_counter()
for i in range(COUNT):
    options, steps = variant(i)
    # Mostly the caller's Communicator (fewer collectives: the test's time); every 7th builds
    # its own from COMM_WORLD, which close() frees (COMM_WORLD itself stays).
    target = comm if i % 7 == 0 else user
    if i % 2:
        with ZeroAdamW(params(), target, lr=1e-2, shard_group_size=K, **options) as opt:
            if steps:
                grads(opt, i)
                opt.step(wait=False)
        check(opt.closed, "the with-block did not close the optimizer")
    else:
        opt = ZeroSGD(params(), target, lr=0.1, momentum=0.9, shard_group_size=K, **options)
        if steps:
            grads(opt, i)
            opt.step(wait=i % 4 != 0)
        kept = opt.params["w"]  # a view: close() completes the gathers that write it
        opt.close()
        opt.close()  # idempotent
        if steps:
            mine = kept.copy()
            check(all(np.array_equal(mine, other) for other in comm.allgather(mine)),
                  f"optimizer {i}: the parameters gathered before close() differ between ranks")
seconds = time.perf_counter() - started

check(threading.active_count() == threads_before,
      f"{threading.active_count()} threads after closing the optimizers, {threads_before} before")
check(not kit.persistent_requests(user), f"{kit.persistent_requests(user)} persistent requests "
      "left on the caller's communicator by closed optimizers")
check(user.allreduce_sum([1.0])[0] == size, "the caller's Communicator stopped working")
user.free()
user.free()
check(comm.allreduce(1) == size, "COMM_WORLD stopped working after Communicator.free()")
sub = Communicator(comm).split(rank % 2)
check(sub.owns_comm and sub.size == len(range(rank % 2, size, 2)), "split()")
sub.free()
try:
    sub.allreduce_sum([1.0])
    check(False, "a freed Communicator ran a collective")
except RuntimeError as exc:
    check("free()" in str(exc), f"a freed Communicator's error does not name free(): {exc}")

opt = ZeroAdamW(params(), comm, lr=1e-2, shard_group_size=K)
opt.close()
raises_naming_close(opt.step, "step()")
raises_naming_close(lambda: opt.add_grad("w", np.zeros(SHAPES["w"], np.float32)), "add_grad()")
raises_naming_close(lambda: opt.params["w"], "params[...]")
raises_naming_close(lambda: opt.grads["w"], "grads[...]")
raises_naming_close(lambda: opt.save("unused"), "save()")
raises_naming_close(opt.zero_grad, "zero_grad()")
raises_naming_close(opt.memory_report, "memory_report()")
raises_naming_close(opt.__enter__, "with on a closed optimizer")

if rank == 0:
    print(f"OK built and closed {COUNT} optimizers (shard_group_size={K}) on {size} ranks in "
          f"{seconds:.1f} s under {MPI.Get_library_version().splitlines()[0].strip()}")
