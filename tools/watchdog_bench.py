"""python tools/watchdog_bench.py [--ranks 2] [--params 4M] [--steps 40] [--json F]

The cost of the step watchdog (``step_timeout``): two ZeroAdamW optimizers over the same
parameters, one without a watchdog and one with ``step_timeout=600``, step in turn (A, B, A, B,
...) in one run on ``--ranks`` ranks, on the same gradients; each step is timed after a barrier
(the slowest rank's wall time). Prints the median and mean ms/step of each, their ratio, and
checks that both end with the same bits (``--control``: an A/A run, neither with a watchdog,
for the noise floor between two optimizers). Also the watchdog's cost per armed call (``arm`` +
``disarm``, what ``step()``, ``wait()`` and ``add_grad`` add) in nanoseconds, one process.
Under ``mpiexec`` without ``--ranks`` it measures that world size in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from zero1_mpi.memory import parse_param_count  # noqa: E402
from zero1_mpi.watchdog import Watchdog  # noqa: E402


def arm_ns(calls: int = 200_000) -> float:
    """Nanoseconds of one ``arm`` + ``disarm`` pair of a watchdog whose thread runs."""
    watchdog = Watchdog(600.0)
    try:
        start = time.perf_counter()
        for step in range(calls):
            watchdog.arm(step, "reduce")
            watchdog.disarm()
        return (time.perf_counter() - start) / calls * 1e9
    finally:
        watchdog.close()


def worker(args) -> dict | None:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    comm = MPI.COMM_WORLD
    n = parse_param_count(args.params)
    shapes = {"w0": (n // 2,), "w1": (n - n // 2,)}
    init = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32)
            for k, s in shapes.items()}
    on = None if args.control else 600
    opts = {"off": ZeroAdamW(init, lr=1e-4), "on": ZeroAdamW(init, lr=1e-4, step_timeout=on)}
    times = {"off": [], "on": []}
    rng = np.random.default_rng(1 + comm.Get_rank())
    for step in range(args.warmup + args.steps):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        order = ("off", "on") if step % 2 == 0 else ("on", "off")
        for which in order:
            opt = opts[which]
            for k, g in grads.items():
                opt.grads[k][...] = g
            comm.Barrier()
            start = time.perf_counter()
            opt.step()
            took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= args.warmup:
                times[which].append(took)
    same = all(np.array_equal(opts["off"].params[k], opts["on"].params[k]) for k in shapes)
    same = comm.allreduce(same, op=MPI.LAND)
    if comm.Get_rank() != 0:
        return None
    result = {"world_size": comm.Get_size(), "params": n, "steps": args.steps,
              "control": args.control,
              "mpi": MPI.Get_library_version().splitlines()[0].strip(), "same_bits": same,
              "arm_disarm_ns": arm_ns()}
    for which, seconds in times.items():
        result[f"{which}_median_ms"] = statistics.median(seconds) * 1e3
        result[f"{which}_mean_ms"] = statistics.fmean(seconds) * 1e3
    result["ratio_median"] = result["on_median_ms"] / result["off_median_ms"]
    result["ratio_mean"] = result["on_mean_ms"] / result["off_mean_ms"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="launch this many ranks under mpiexec")
    parser.add_argument("--params", default="4M", help="parameters (e.g. 4M)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: the second optimizer without a watchdog too")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)
    if args.ranks:
        from launch import run_ranks
        passed = ["--params", args.params, "--steps", str(args.steps), "--warmup",
                  str(args.warmup)] + (["--control"] if args.control else [])
        result = run_ranks(args.ranks, str(Path(__file__).resolve()), passed, timeout=900)
    else:
        result = worker(args)
        if result is None:
            return
    print(f"{result['world_size']} ranks, {result['params']:,} parameters, {result['mpi']}"
          f"{' (control: no watchdog on either)' if result['control'] else ''}: "
          f"step() {result['off_median_ms']:.2f} ms without the watchdog, "
          f"{result['on_median_ms']:.2f} ms {'again' if result['control'] else 'with'} (median of {result['steps']}; ratio "
          f"{result['ratio_median']:.3f}; means {result['off_mean_ms']:.2f} / "
          f"{result['on_mean_ms']:.2f} ms, ratio {result['ratio_mean']:.3f}); arm + disarm "
          f"{result['arm_disarm_ns']:.0f} ns; same bits: {result['same_bits']}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
