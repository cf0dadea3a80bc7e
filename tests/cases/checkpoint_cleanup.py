"""Saves delete only what they wrote, and a failed save removes what it wrote on every rank.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint_cleanup.py links DIR
    mpiexec -n N python -m mpi4py tests/cases/checkpoint_cleanup.py failures DIR
    mpiexec -n N python -m mpi4py tests/cases/checkpoint_cleanup.py full DIR

``links``: next to a ``.tmp-*`` link to the user's directory, an archived checkpoint moved
elsewhere and linked back under its name, and old checkpoint directories holding a foreign
file or a linked shard, saves with ``keep=2`` succeed and every file those reach survives.
``failures``: a write failing on one rank, and rank 0's publish failing before and after the
rename, remove what the save wrote before the error reaches every rank. ``full``: DIR is a
small file system (600 KiB); a save that does not fit (blocking, then not) raises on every
rank and leaves nothing behind, and the next save that fits succeeds.
"""

import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zero1_mpi.persistence.checkpoint as checkpoint
import zero1_mpi.persistence.publish as publish
from zero1_mpi.persistence.manifest import LATEST, MANIFEST_DIGEST
from zero1_mpi import CheckpointError, ZeroAdamW
from casekit import check, raises
from casekit import digest as own_digest

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def make(numel=3000):
    init = {"w": np.linspace(-1, 1, numel, dtype=np.float32), "b": np.ones(11, np.float32)}
    return ZeroAdamW(init, comm, lr=1e-2, bucket_elements=1024)


def train(opt, steps=1):
    for _ in range(steps):
        for grad in opt.grads.values():
            grad[...] = np.sin(np.arange(grad.size) + opt.step_count + rank).reshape(grad.shape)
        opt.step()


def digest(opt) -> tuple:
    """Every rank's ``casekit.digest`` of its state, with the step count."""
    return tuple(comm.allgather(own_digest(opt)[0])), opt.step_count


def loads_as(root, expected, numel=3000):
    """A fresh optimizer loading ``root`` holds the state ``expected`` (a ``digest``)."""
    fresh = make(numel)
    fresh.load(root)
    check(digest(fresh) == expected, f"{root} does not hold step {expected[1]}")


def on_root(fn):
    result = fn() if rank == 0 else None
    comm.Barrier()
    return comm.bcast(result)


def contents(directory: Path) -> dict:
    """Every file under ``directory`` (links not followed), with its bytes."""
    return {str(p.relative_to(directory)): (p.readlink() if p.is_symlink() else p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_symlink() or p.is_file()}


def listing(root: Path) -> list:
    return sorted(p.name for p in root.iterdir())


def latest(root: Path) -> str:
    return (root / LATEST).read_text().splitlines()[0]


def links(directory: Path):
    root, user, archive = directory / "ckpt", directory / "user", directory / "archive"
    opt = make()
    train(opt)
    first = opt.save(root)

    def arrange():
        # The user's directory, with files named as a save's: a .tmp-* link reaches it.
        (user / "sub").mkdir(parents=True)
        for name in ("shard-00000.npy", "manifest.json", "manifest.sha256", "notes.txt"):
            (user / name).write_bytes(name.encode() * 3)
        (user / "sub" / "shard-00001.npy").write_bytes(b"nested")
        (root / ".tmp-00000000-1").symlink_to(user, target_is_directory=True)
        (root / ".tmp-00000000-2").symlink_to(user / "notes.txt")
        (root / ".tmp-00000000-3").symlink_to(directory / "nowhere")
        # A crashed save's debris (removed) and a directory with a file of the user's (kept).
        for name, files in ((".tmp-00000000-4", ("shard-00001.npy", "manifest.json")),
                            (".tmp-00000000-5", ("shard-00001.npy", "mine.txt"))):
            (root / name).mkdir()
            for file in files:
                (root / name / file).write_bytes(b"partly written")
        # The first checkpoint archived: moved to other storage, linked back under its name.
        archive.mkdir()
        first.rename(archive / first.name)
        first.symlink_to(archive / first.name, target_is_directory=True)
        return contents(user), contents(archive), contents(root / ".tmp-00000000-5")
    kept_user, kept_archive, kept_tmp = on_root(arrange)
    check(len(kept_archive) == size + 2, kept_archive)

    saved = [opt.save(root, keep=2)]  # LATEST named the archived one, through its link
    train(opt)
    saved.append(opt.save(root, keep=2))

    def foreign():
        # Two old checkpoints that are not all a save's: a note beside the files, a shard
        # that is a link to the user's file. Beyond keep=2, but nothing of either is removed.
        (saved[0] / "notes.txt").write_bytes(b"mine")
        shard = saved[1] / "shard-00000.npy"
        shard.unlink()
        shard.symlink_to(user / "shard-00000.npy")
        return contents(saved[0]), contents(saved[1])
    kept_foreign = on_root(foreign)
    for _ in range(3):
        train(opt)
        saved.append(opt.save(root, keep=2))
    loads_as(root, digest(opt))

    def survivors():
        check(contents(user) == kept_user, "the user's files reached by a .tmp-* link changed")
        check(contents(archive) == kept_archive, "the archived checkpoint changed")
        check((contents(saved[0]), contents(saved[1])) == kept_foreign, "foreign files changed")
        check(contents(root / ".tmp-00000000-5") == kept_tmp, "a foreign .tmp-* file changed")
        expected = sorted([".tmp-00000000-1", ".tmp-00000000-2", ".tmp-00000000-3",
                           ".tmp-00000000-5", first.name,
                           saved[0].name, saved[1].name, saved[-2].name, saved[-1].name,
                           LATEST])
        check(listing(root) == expected, (listing(root), expected))
        check(first.is_symlink() and (root / ".tmp-00000000-1").is_symlink(), listing(root))
    on_root(survivors)
    archived = make()
    archived.load(first)  # the archived checkpoint, through its link, still loads
    check(archived.step_count == 1, archived.step_count)


def failures(directory: Path):
    root = directory / "ckpt"
    opt = make()
    train(opt)
    good, at_good = opt.save(root), digest(opt)
    write, write_synced = checkpoint._write_shard, publish.write_synced

    def unchanged():
        return on_root(lambda: listing(root)) == sorted([good.name, LATEST]) \
            and latest(root) == good.name

    # A rank's write fails halfway through its file: every rank's file goes, on every rank.
    def half_written(file, shape, chunks):
        with open(file, "wb") as f:
            f.write(b"\x93NUMPY" + b"\0" * 100)
        raise OSError(28, "No space left on device (test)")
    for blocking in (True, False):
        train(opt)
        if rank == size - 1:
            checkpoint._write_shard = half_written
        if blocking:
            raises(CheckpointError, "No space left on device (test)", lambda: opt.save(root))
        else:
            pending = opt.save(root, blocking=False)
            raises(CheckpointError, "No space left on device (test)", pending.wait)
            raises(CheckpointError, "No space left on device (test)", opt.finish_save)
        checkpoint._write_shard = write
        check(unchanged(), (blocking, on_root(lambda: listing(root))))

    # Rank 0's publish fails: writing the manifest (before the rename), writing LATEST (after).
    for failing in (MANIFEST_DIGEST, f".{LATEST}.tmp"):
        def publish_fails(file, data, failing=failing):
            if file.name == failing:
                with open(file, "wb") as f:
                    f.write(data[:3])
                raise OSError(28, "No space left on device (test)")
            write_synced(file, data)
        train(opt)
        publish.write_synced = publish_fails
        raises(CheckpointError, "cannot publish", lambda: opt.save(root, keep=1))
        publish.write_synced = write_synced
        check(unchanged(), (failing, on_root(lambda: listing(root))))
    loads_as(root, at_good)
    train(opt)
    check(opt.save(root, keep=1).name == latest(root))
    check(on_root(lambda: listing(root)) == sorted([latest(root), LATEST]))
    loads_as(root, digest(opt))


def full(directory: Path):
    root = directory / "ckpt"
    small, big = make(3000), make(60000)  # 36 KiB and 720 KiB of state: 600 KiB hold one
    train(small)
    train(big)
    good = small.save(root)
    for blocking in (True, False):
        if blocking:
            raises(CheckpointError, "No space left on device", lambda: big.save(root, keep=1))
        else:
            pending = big.save(root, keep=1, blocking=False)
            raises(CheckpointError, "No space left on device", pending.wait)
            raises(CheckpointError, "No space left on device", big.finish_save)
        check(on_root(lambda: listing(root)) == sorted([good.name, LATEST]),
              (blocking, on_root(lambda: listing(root))))
        check(latest(root) == good.name, latest(root))
        loads_as(root, digest(small))
    free = on_root(lambda: os.statvfs(root).f_bavail * os.statvfs(root).f_frsize)
    check(free > 450 * 1024, f"the failed saves still hold space: {free} bytes free")
    train(small)
    good = small.save(root, keep=1)  # the save that fits succeeds, blocking or not
    loads_as(root, digest(small))
    train(small)
    good = small.save(root, keep=1, blocking=False).wait()
    found = on_root(lambda: listing(root))
    check(latest(root) == good.name and found == sorted([good.name, LATEST]), found)
    loads_as(root, digest(small))


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    {"links": links, "failures": failures, "full": full}[mode](directory)
    if rank == 0:
        print(f"OK checkpoint cleanup ({mode}) on {size} ranks")
