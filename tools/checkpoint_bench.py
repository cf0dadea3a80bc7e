"""python tools/checkpoint_bench.py [--params 100M] [--ranks 1,2,4] [--dtype bfloat16] [--dir D]
       python tools/checkpoint_bench.py --training [--params 100M] [--ranks 2] [--steps 5]

Times saving and loading a ZeroAdamW checkpoint of ``--params`` parameters on each number of
ranks in ``--ranks`` (one ``mpiexec -n N`` job each, in one run), both the sharded checkpoint
(``save``/``load``, loaded at the same N) and the consolidated export
(``save_consolidated``/``load_consolidated``). Per operation it reports the slowest rank's
time and the largest per-rank peak of memory allocated during it (tracemalloc: arrays and
buffers; file pages mapped for reading are the OS's page cache, not the rank's), beside the
bytes of optimizer state each rank holds. Files go to ``--dir`` (default: a temporary
directory, removed afterwards). ``--training``: how long a training step is held by a blocking
``save`` and by ``save(blocking=False)``, and what the background write costs the steps that
overlap it (their time against ``--steps`` steps without a save, in the same job).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import run_ranks  # noqa: E402

from zero1_mpi.memory import format_param_count, parse_param_count  # noqa: E402

OPERATIONS = ("save", "load", "save_consolidated", "load_consolidated")


def worker(psi: int, dtype: str, directory: Path) -> None:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    comm = MPI.COMM_WORLD
    sizes = [psi // 10] * 9 + [psi - 9 * (psi // 10)]
    opt = ZeroAdamW({f"layer{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}, comm,
                    param_dtype=dtype)
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
        comm.Barrier()
        tracemalloc.start()
        start = time.perf_counter()
        calls[name]()
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results[name] = (comm.allreduce(elapsed, op=MPI.MAX), comm.allreduce(peak, op=MPI.MAX))
    disk = sum(f.stat().st_size for f in (directory / "ckpt").rglob("*") if f.is_file())
    if comm.rank == 0:
        print(json.dumps({"world_size": comm.size, "results": results, "disk": disk,
                          "state_bytes": comm.allreduce(state_bytes, op=MPI.MAX)}), flush=True)
    else:
        comm.allreduce(state_bytes, op=MPI.MAX)


def training_worker(psi: int, dtype: str, directory: Path, steps: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    comm = MPI.COMM_WORLD
    sizes = [psi // 10] * 9 + [psi - 9 * (psi // 10)]
    opt = ZeroAdamW({f"layer{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}, comm,
                    param_dtype=dtype)

    def step() -> float:
        for g in opt.grads.values():
            g[...] = 1e-3
        comm.Barrier()
        start = time.perf_counter()
        opt.step()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def timed(call) -> float:
        comm.Barrier()
        start = time.perf_counter()
        call()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    step()
    opt.save(directory / "warm-up", keep=1)  # the first write of a file system's blocks, and
    opt.save(directory / "warm-up", keep=1, blocking=False).wait()  # the host copy's pages
    plain = [step() for _ in range(steps)]
    blocking = timed(lambda: opt.save(directory / "ckpt", keep=1))
    pending = []
    held = timed(lambda: pending.append(opt.save(directory / "ckpt", keep=1, blocking=False)))
    start, overlapped = time.perf_counter(), []
    while not pending[0].done:
        overlapped.append(step())
    published = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    after = [step() for _ in range(steps)]
    buffer = comm.allreduce(opt.memory_report().checkpoint_buffer, op=MPI.MAX)
    if comm.rank == 0:
        print(json.dumps({"world_size": comm.size, "plain": plain, "after": after,
                          "blocking": blocking, "held": held, "overlapped": overlapped,
                          "published": published, "buffer": buffer,
                          "path": str(pending[0].path)}), flush=True)


def training_table(args, psi: int, base: Path) -> None:
    print(f"ZeroAdamW, {format_param_count(psi)} {args.dtype} parameters: a step held by a "
          "save, and the steps that overlap a non-blocking save's write (slowest rank, median "
          "of steps)\n")
    print("| ranks | step, no save | blocking save | non-blocking save | steps overlapping "
          "the write | their median | published after | host copy/rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.ranks.split(",")):
        directory = base / f"T{n}"
        directory.mkdir(parents=True, exist_ok=True)
        found = run_ranks(n, str(Path(__file__).resolve()),
                          ["--worker", "--training", "--params", str(psi), "--dtype",
                           args.dtype, "--dir", str(directory), "--steps", str(args.steps)],
                          args.mpiexec, args.timeout)
        plain = statistics.median(found["plain"] + found["after"])
        over = found["overlapped"]
        print(f"| {n} | {plain:.3f} s | {found['blocking']:.3f} s | {found['held']:.3f} s | "
              f"{len(over)} | {statistics.median(over) if over else float('nan'):.3f} s "
              f"({statistics.median(over) / plain if over else float('nan'):.2f}x) | "
              f"{found['published']:.2f} s | {found['buffer'] / 2**20:.0f} MiB |", flush=True)
        shutil.rmtree(directory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--mpiexec", help="MPI launcher, flags allowed "
                        "(default: $ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--training", action="store_true",
                        help="time steps around blocking and non-blocking saves")
    parser.add_argument("--steps", type=int, default=5,
                        help="--training: steps without a save, before and after")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    psi = parse_param_count(args.params)
    if args.worker:
        if args.training:
            training_worker(psi, args.dtype, Path(args.dir), args.steps)
        else:
            worker(psi, args.dtype, Path(args.dir))
        return 0

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero1-ckpt-bench-"))
    if args.training:
        try:
            training_table(args, psi, base)
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        return 0
    print(f"ZeroAdamW, {format_param_count(psi)} {args.dtype} parameters; time of the slowest "
          f"rank, largest per-rank peak allocation during the operation\n")
    print("| ranks | state/rank | on disk | save | load | save_consolidated | "
          "load_consolidated |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for n in (int(x) for x in args.ranks.split(",")):
            directory = base / f"N{n}"
            directory.mkdir(parents=True, exist_ok=True)
            found = run_ranks(n, str(Path(__file__).resolve()),
                              ["--worker", "--params", str(psi), "--dtype", args.dtype,
                               "--dir", str(directory)], args.mpiexec, args.timeout)
            cells = [f"{found['results'][op][0]:.2f} s, {found['results'][op][1] / 2**20:.1f} MiB"
                     for op in OPERATIONS]
            print(f"| {n} | {found['state_bytes'] / 2**20:.0f} MiB | "
                  f"{found['disk'] / 2**20:.0f} MiB | " + " | ".join(cells) + " |", flush=True)
            shutil.rmtree(directory)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
