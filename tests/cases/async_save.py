"""Non-blocking saves: ``save(..., blocking=False)`` checkpoints the state of the step it was
called at while training goes on, publishes only once every rank's file is written, changes
nothing in training, holds one host copy of the shard, and reports a failed write on every rank.

    mpiexec -n N python -m mpi4py tests/cases/async_save.py DIR [GROUP]

GROUP: ``shard_group_size`` (hierarchical: the replicas write nothing and hold no copy).
"""

import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zero1_mpi.persistence.checkpoint as checkpoint
from zero1_mpi.persistence.manifest import LATEST
from zero1_mpi import CheckpointError, ZeroAdamW
import casekit as kit
from casekit import check, raises

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (300, 70), "b": (70,), "s": ()}


def make(group=None):
    return ZeroAdamW(kit.init_values(SHAPES), comm, lr=1e-2, param_dtype="bfloat16",
                     bucket_elements=4096, shard_group_size=group)


def train(opt, steps):
    kit.train(opt, steps, SHAPES)


def digest(opt) -> tuple:
    """The whole job's state: every rank's arrays, hashed, gathered."""
    mine, steps = kit.digest(opt)
    return tuple(comm.allgather(mine)), steps


def latest(root: Path) -> str:
    file = root / LATEST
    return file.read_text().splitlines()[0] if file.exists() else ""


def main(directory: Path, group):
    # The reference: blocking saves at steps 3 and 6 of an uninterrupted run.
    reference = make(group)
    train(reference, range(3))
    reference.save(directory / "blocking")
    at_3 = digest(reference)
    train(reference, range(3, 10))
    final = digest(reference)

    opt = make(group)
    train(opt, range(3))
    root = directory / "async"
    check(opt.memory_report().checkpoint_buffer == 0)
    # The writers wait until training has changed the state: what they write must be step 3's.
    trained_on, write = threading.Event(), checkpoint._write_shard

    def held_write(*args):
        trained_on.wait()
        return write(*args)
    checkpoint._write_shard = held_write
    pending = opt.save(root, blocking=False)
    check(not pending.done and latest(root) == "", "published before any step")
    rows, owned = len(opt.state_rows), opt.layout.shard_total
    writes = rank < opt.shard_group_size
    buffer = opt.memory_report().checkpoint_buffer
    expected = rows * sum(hi - lo for lo, hi, _ in opt.layout.owned(opt.shard_rank)) * 4
    check(buffer == (expected if writes else 0), (buffer, expected, owned, writes))
    # Training goes on while the files are written; the state it changes is not what is saved.
    train(opt, range(3, 5))
    check(not pending.done, "published while the writers were held")
    trained_on.set()
    checkpoint._write_shard = write
    while not comm.allreduce(pending.written, op=MPI.LAND):
        time.sleep(0.01)
    train(opt, range(5, 6))  # the first step after every write: publishes
    check(pending.done and pending.error is None and pending.path is not None, pending.error)
    check(latest(root) == pending.path.name and pending.path.name.startswith("ckpt-00000003-"),
          (latest(root), pending.path))
    check(pending.wait() == pending.path)
    train(opt, range(6, 10))
    check(digest(opt) == final, "a non-blocking save changed training")

    loaded = make(group)
    loaded.load(root)
    check(digest(loaded) == at_3, "the non-blocking checkpoint is not the state of step 3")
    same = [np.load(f).tobytes() == np.load(directory / "blocking" / latest(
        directory / "blocking") / f.name).tobytes() for f in sorted(pending.path.glob("*.npy"))]
    check(all(same) and len(same) == opt.shard_group_size, same)

    # wait() publishes without a step; a second non-blocking save reuses the buffer.
    second = opt.save(root, blocking=False)
    check(second.wait().name.startswith("ckpt-00000010-") and latest(root) == second.path.name)
    check(opt.memory_report().checkpoint_buffer == buffer)
    # A blocking save, a load and another non-blocking save each finish the one in flight.
    third = opt.save(root, blocking=False)
    loaded.load(root)  # finishes nothing of loaded's, loads second's (third is opt's)
    opt.save(root, keep=2)
    check(third.done and third.path is not None and loaded.step_count == 10)
    check(sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt-"))
          == sorted([third.path.name, latest(root)]) or rank != 0, "keep=2")

    # A write that fails on the last writing rank: reported on every rank, LATEST unchanged.
    before = latest(root)
    if rank == opt.shard_group_size - 1:
        def failing(file, *args):
            raise OSError(28, "No space left on device (test)")
        checkpoint._write_shard = failing
    failed = opt.save(root, blocking=False)
    train(opt, range(10, 12))
    raises(CheckpointError, "No space left on device (test)", lambda: opt.save(root))
    checkpoint._write_shard = write
    check(failed.error is not None and latest(root) == before, (failed.error, latest(root)))
    raises(CheckpointError, "No space left on device (test)", failed.wait)
    opt.save(root)  # and the next one goes through
    check(latest(root).startswith("ckpt-00000012-"))
    raises(ValueError, "blocking='no' must be True or False",
           lambda: opt.save(root, blocking="no"))
    raises(ValueError, "keep=0 must be None (keep all) or an integer >= 1",
           lambda: opt.save(root, keep=0, blocking=False))
    # close() publishes the save in flight and gives the signal handlers back.
    previous = signal.getsignal(signal.SIGUSR2)
    opt.checkpoint_on_signal(directory / "signal", signals=("SIGUSR2",))
    last = opt.save(root, blocking=False)
    opt.close()
    check(last.done and last.error is None and latest(root) == last.path.name, last.error)
    check(signal.getsignal(signal.SIGUSR2) is previous, "SIGUSR2's handler was not restored")
    if rank == 0:
        print(f"OK non-blocking saves on {size} ranks, shard_group_size={opt.shard_group_size}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
