"""A job killed at any moment of ``save`` leaves the previous checkpoint loadable.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint_crash.py prepare DIR
    mpiexec -n N python -m mpi4py tests/cases/checkpoint_crash.py crash DIR <moment>
    mpiexec -n N python -m mpi4py tests/cases/checkpoint_crash.py check DIR

``prepare`` trains, saves a good checkpoint and exports its state. ``crash`` loads it, trains
on and kills one rank (SIGKILL, no cleanup) at ``moment`` of the next save: ``mid-shard``
(the last rank, halfway through writing its file), ``background`` (the same, in the writer
thread of a non-blocking save while training goes on), ``before-rename`` (rank 0, all files
written and synced), ``before-latest`` (rank 0, the new directory in place but LATEST not yet
replaced). Just before it dies, the killed rank prints ``KILLED at <moment>:`` and what it
saw on disk there, so the test knows the kill happened at that point and not elsewhere.
``check`` loads the root again: it must be the good checkpoint, bit for bit, and the next save
must succeed and clear what the crash left.
"""

import os
import signal
import sys
from pathlib import Path

from mpi4py import MPI

import zero1_mpi.persistence.checkpoint as checkpoint
from zero1_mpi import ZeroAdamW
import casekit as kit
from casekit import check

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


SHAPES = {"w": (3000,), "b": (11,)}


def make():
    return ZeroAdamW(kit.init_values(SHAPES), comm, lr=1e-2, param_dtype="bfloat16",
                     bucket_elements=1000)


def train(opt, steps):
    kit.train(opt, steps, SHAPES)


def die(moment, seen):
    """Record the moment (on stdout, and in ``KILLED`` beside the root: a launcher may drop the
    last output of a process that SIGKILLs itself, as Open MPI's did once), then die."""
    record = f"KILLED at {moment}: {seen}"
    print(record, flush=True)
    with open(DIRECTORY / "KILLED", "w") as f:
        f.write(record + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def on_disk(root: Path) -> str:
    """What a save has left under ``root`` so far: temporary and complete checkpoints, their
    files, and what LATEST names."""
    entries = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            entries.append(f"{entry.name}/[{' '.join(sorted(f.name for f in entry.iterdir()))}]")
    latest = (root / checkpoint.LATEST).read_text().splitlines()[0]
    return f"{' '.join(entries)}; LATEST={latest}"


def prepare(directory):
    opt = make()
    train(opt, range(3))
    opt.save(directory / "root")
    opt.save_consolidated(directory / "good.safetensors")


def crash(directory, moment):
    global DIRECTORY
    DIRECTORY = directory
    opt = make()
    root = directory / "root"
    opt.load(root)
    train(opt, range(3, 5))
    if moment == "mid-shard" and rank == size - 1:
        calls = []
        original = checkpoint.row_views

        def dying_row_views(*args):
            calls.append(1)
            if len(calls) == 3:  # some rows are on disk, the rest never will be
                die(moment, on_disk(root))
            return original(*args)
        checkpoint.row_views = dying_row_views
    elif moment == "background" and rank == size - 1:  # a non-blocking save's writer thread
        original_chunks = checkpoint._snapshot_chunks

        def dying_chunks(snapshot):
            for index, chunk in enumerate(original_chunks(snapshot)):
                if index == 2:
                    die(moment, on_disk(root))
                yield chunk
        checkpoint._snapshot_chunks = dying_chunks
    elif moment == "before-rename" and rank == 0:
        rename = checkpoint.os.rename

        def dying_rename(src, dst):
            if Path(src).name.startswith(".tmp-"):
                die(moment, on_disk(root))
            rename(src, dst)
        checkpoint.os.rename = dying_rename
    elif moment == "before-latest" and rank == 0:
        replace = checkpoint.os.replace

        def dying_replace(src, dst):
            if Path(dst).name == checkpoint.LATEST:
                die(moment, on_disk(root))
            replace(src, dst)
        checkpoint.os.replace = dying_replace
    if moment == "background":
        pending = opt.save(root, blocking=False)
        train(opt, range(5, 8))  # training goes on while the files are written
        pending.wait()
    else:
        opt.save(root)
    print("UNREACHABLE: the save finished on rank", rank, flush=True)


def check_after_crash(directory):
    opt = make()
    opt.load(directory / "root")
    check(opt.step_count == 3, opt.step_count)
    opt.save_consolidated(directory / "after-crash.safetensors")
    if rank == 0:
        good = (directory / "good.safetensors").read_bytes()
        check((directory / "after-crash.safetensors").read_bytes() == good, "state differs")
    train(opt, range(3, 4))
    opt.save(directory / "root", keep=1)
    comm.Barrier()
    left = sorted(p.name for p in (directory / "root").iterdir())
    check(len(left) == 2 and "LATEST" in left, left)
    if rank == 0:
        print(f"OK crash recovery on {size} ranks: left {left}")


if __name__ == "__main__":
    phase, where = sys.argv[1], Path(sys.argv[2])
    if phase == "crash":
        crash(where, sys.argv[3])
    else:
        {"prepare": prepare, "check": check_after_crash}[phase](where)
