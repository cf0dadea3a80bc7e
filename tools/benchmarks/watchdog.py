"""The step watchdog's cost: steps with and without ``step_timeout``, in turn, same bits.

Two ZeroAdamW optimizers over the same parameters, one without a watchdog and one with
``step_timeout=600``, step in turn (A, B, A, B, ...) in one run on the same gradients; each
step is timed after a barrier (the slowest rank's wall time). Prints the median and mean
ms/step of each, their ratio, and checks that both end with the same bits (--control: an A/A
run, neither with a watchdog, for the noise floor between two optimizers). Also the watchdog's
cost per armed call (``arm`` + ``disarm``, what ``step()``, ``wait()`` and ``add_grad`` add) in
nanoseconds, one process. Example: python tools/bench.py watchdog --ranks 2 --params 4M
"""

from __future__ import annotations

import json
import statistics
import time

from . import common

RANKS, TIMEOUT = None, 900


def options(parser) -> None:
    common.params(parser, "4M")
    common.steps(parser, 40, warmup=3)
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: the second optimizer without a watchdog too")


def arm_ns(calls: int = 200_000) -> float:
    """Nanoseconds of one ``arm`` + ``disarm`` pair of a watchdog whose thread runs."""
    from zero1_mpi.comm.watchdog import Watchdog

    watchdog = Watchdog(600.0)
    try:
        start = time.perf_counter()
        for step in range(calls):
            watchdog.arm(step, "reduce")
            watchdog.disarm()
        return (time.perf_counter() - start) / calls * 1e9
    finally:
        watchdog.close()


def worker(args) -> dict:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    comm = MPI.COMM_WORLD
    n = args.params
    shapes = {"w0": (n // 2,), "w1": (n - n // 2,)}
    init = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32)
            for k, s in shapes.items()}
    on = None if args.control else 600
    opts = {"off": ZeroAdamW(init, lr=1e-4), "on": ZeroAdamW(init, lr=1e-4, step_timeout=on)}
    times = {"off": [], "on": []}
    rng = np.random.default_rng(1 + comm.Get_rank())
    for step in range(args.warmup + args.steps):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        for which in ("off", "on") if step % 2 == 0 else ("on", "off"):
            opt = opts[which]
            for k, g in grads.items():
                opt.grads[k][...] = g
            took = common.timed(comm, opt.step)
            if step >= args.warmup:
                times[which].append(took)
    same = all(np.array_equal(opts["off"].params[k], opts["on"].params[k]) for k in shapes)
    result = {"world_size": comm.Get_size(), "params": n, "steps": args.steps,
              "control": args.control,
              "mpi": MPI.Get_library_version().splitlines()[0].strip(),
              "same_bits": comm.allreduce(same, op=MPI.LAND),
              "arm_disarm_ns": arm_ns() if comm.Get_rank() == 0 else None}
    for which, seconds in times.items():
        result[f"{which}_median_ms"] = statistics.median(seconds) * 1e3
        result[f"{which}_mean_ms"] = statistics.fmean(seconds) * 1e3
    result["ratio_median"] = result["on_median_ms"] / result["off_median_ms"]
    result["ratio_mean"] = result["on_mean_ms"] / result["off_mean_ms"]
    return result


def report(args, results: list[dict]) -> list[dict]:
    for r in results:
        print(f"{r['world_size']} ranks, {r['params']:,} parameters, {r['mpi']}"
              f"{' (control: no watchdog on either)' if r['control'] else ''}: "
              f"step() {r['off_median_ms']:.2f} ms without the watchdog, "
              f"{r['on_median_ms']:.2f} ms {'again' if r['control'] else 'with'} (median of "
              f"{r['steps']}; ratio {r['ratio_median']:.3f}; means {r['off_mean_ms']:.2f} / "
              f"{r['on_mean_ms']:.2f} ms, ratio {r['ratio_mean']:.3f}); arm + disarm "
              f"{r['arm_disarm_ns']:.0f} ns; same bits: {r['same_bits']}")
        print(json.dumps(r))
    return results
