"""Saving and loading checkpoints: time and peak memory, and the steps a save holds.

Times saving and loading a ZeroAdamW checkpoint of --params parameters on each number of ranks
in --ranks (one ``mpiexec -n N`` job each, in one run), both the sharded checkpoint
(``save``/``load``, loaded at the same N) and the consolidated export
(``save_consolidated``/``load_consolidated``). Per operation it reports the slowest rank's time
and the largest per-rank peak of memory allocated during it (tracemalloc: arrays and buffers;
file pages mapped for reading are the OS's page cache, not the rank's), beside the bytes of
optimizer state each rank holds. Files go to a temporary directory under --dir (default: the
system's), removed afterwards. --training: how long a training step is held by a blocking
``save`` and by ``save(blocking=False)``, and what the background write costs the steps that
overlap it (their time against --steps steps without a save, in the same job).
Example: python tools/bench.py checkpoint --params 100M --ranks 1,2,4
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

from zero1_mpi.memory import format_param_count

from . import common

RANKS, TIMEOUT = "1,2,4", 900
OPERATIONS = ("save", "load", "save_consolidated", "load_consolidated")
MIB = 2 ** 20


def options(parser) -> None:
    common.params(parser, "100M")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--training", action="store_true",
                        help="time steps around blocking and non-blocking saves")
    parser.add_argument("--steps", type=common.at_least(1), default=5,
                        help="--training: steps without a save, before and after (default 5)")


@contextmanager
def scratch(comm, base):
    """A directory of rank 0's making under ``base`` for the job, removed afterwards."""
    made = tempfile.mkdtemp(prefix="zero1-ckpt-bench-", dir=base) if comm.rank == 0 else None
    directory = Path(comm.bcast(made))
    try:
        yield directory
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def worker(args) -> dict:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    comm = MPI.COMM_WORLD
    psi = args.params
    sizes = [psi // 10] * 9 + [psi - 9 * (psi // 10)]
    opt = ZeroAdamW({f"layer{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}, comm,
                    param_dtype=args.dtype)
    with scratch(comm, args.dir) as directory:
        if args.training:
            return training(comm, opt, directory, args.steps)
        return operations(comm, opt, directory)


def operations(comm, opt, directory: Path) -> dict:
    for g in opt.grads.values():
        g[...] = 1e-3
    opt.step()  # non-zero state
    report = opt.memory_report()
    state_bytes = report.master_weights + report.exp_avg + report.exp_avg_sq
    calls = {"save": lambda: opt.save(directory / "ckpt"),
             "load": lambda: opt.load(directory / "ckpt"),
             "save_consolidated": lambda: opt.save_consolidated(directory / "full.safetensors"),
             "load_consolidated": lambda: opt.load_consolidated(directory / "full.safetensors")}
    results = {}
    for name in OPERATIONS:
        tracemalloc.start()
        elapsed = common.timed(comm, calls[name])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results[name] = (elapsed, common.slowest(comm, peak))
    disk = sum(f.stat().st_size for f in (directory / "ckpt").rglob("*") if f.is_file())
    return {"world_size": comm.size, "results": results, "disk": disk,
            "state_bytes": common.slowest(comm, state_bytes)}


def training(comm, opt, directory: Path, steps: int) -> dict:
    def step() -> float:
        for g in opt.grads.values():
            g[...] = 1e-3
        return common.timed(comm, opt.step)

    step()
    opt.save(directory / "warm-up", keep=1)  # the first write of a file system's blocks, and
    opt.save(directory / "warm-up", keep=1, blocking=False).wait()  # the host copy's pages
    plain = [step() for _ in range(steps)]
    blocking = common.timed(comm, lambda: opt.save(directory / "ckpt", keep=1))
    pending = []
    held = common.timed(comm, lambda: pending.append(opt.save(directory / "ckpt", keep=1,
                                                              blocking=False)))
    start, overlapped = time.perf_counter(), []
    while not pending[0].done:
        overlapped.append(step())
    published = common.slowest(comm, time.perf_counter() - start)
    after = [step() for _ in range(steps)]
    buffer = common.slowest(comm, opt.memory_report().checkpoint_buffer)
    return {"world_size": comm.size, "plain": plain, "after": after, "blocking": blocking,
            "held": held, "overlapped": overlapped, "published": published, "buffer": buffer,
            "path": str(pending[0].path)}


def report(args, results: list[dict]) -> list[dict]:
    psi = format_param_count(args.params)
    if args.training:
        print(f"ZeroAdamW, {psi} {args.dtype} parameters: a step held by a save, and the steps "
              "that overlap a non-blocking save's write (slowest rank, median of steps)\n")
        print(common.row("ranks", "step, no save", "blocking save", "non-blocking save",
                         "steps overlapping the write", "their median", "published after",
                         "host copy/rank"))
        print(common.rule("rrrrrrrr"))
        for found in results:
            plain = statistics.median(found["plain"] + found["after"])
            over = found["overlapped"]
            median = statistics.median(over) if over else float("nan")
            print(common.row(found["world_size"], f"{plain:.3f} s", f"{found['blocking']:.3f} s",
                             f"{found['held']:.3f} s", len(over),
                             f"{median:.3f} s ({median / plain:.2f}x)",
                             f"{found['published']:.2f} s", f"{found['buffer'] / MIB:.0f} MiB"))
        return results
    print(f"ZeroAdamW, {psi} {args.dtype} parameters; time of the slowest rank, largest "
          "per-rank peak allocation during the operation\n")
    print(common.row("ranks", "state/rank", "on disk", *OPERATIONS))
    print(common.rule("rrrrrrr"))
    for found in results:
        cells = [f"{found['results'][op][0]:.2f} s, {found['results'][op][1] / MIB:.1f} MiB"
                 for op in OPERATIONS]
        print(common.row(found["world_size"], f"{found['state_bytes'] / MIB:.0f} MiB",
                         f"{found['disk'] / MIB:.0f} MiB", *cells))
    return results
