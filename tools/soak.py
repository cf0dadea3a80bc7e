"""A long run that must leak nothing: RSS, open file descriptors and threads stay flat.

    mpiexec -n 2 python tools/soak.py [--steps 20000] [--warmup 8000] [--sample-every 250]
                                      [--rebuild-every 1000] [--leak none|ref|keep]
                                      [--rss-tolerance-kib 1024] [--json FILE]

Each rank trains a small two-layer model (2,384 parameters, one bucket, AdamW, clipping) for ``--steps`` steps, every other step leaving the all-gathers in flight
(``step(wait=False)``). Every ``--rebuild-every`` steps it also builds, steps and closes another
optimizer of the model and a 2 MiB tensor, in turn with offload threads (2), with gradient sharding (stage 2), and plain (on 4 or
more ranks with ``shard_group_size=2``: two sub-communicators each). Every ``--sample-every``
steps, with no such optimizer alive, each rank reads its ``VmRSS`` (``/proc/self/status``), its
open descriptors (``/proc/self/fd``) and its threads (``/proc/self/task``).

After the warm-up (caches, MPI's lazily made connections and buffers, the allocator's arenas)
the run is flat when, on every rank: descriptors and threads never differ from their value at
the end of the warm-up, and RSS grows by at most ``--rss-tolerance-kib`` from there, both at the
end and along a least-squares line through the samples (its slope times the span). A leak of
one 100-byte object a step is 1.1 MiB over the 12,000 steps after the default warm-up, above
the default 1 MiB; the allocator's jitter between samples is some tens of KiB. The warm-up is
long because Intel MPI 2021's RSS settles only after about 7,000 steps (1 MiB more from step
3,000 to 7,000, then 50 KiB over the next 13,000). ``--leak`` makes the run leak on
purpose, to show that the check catches it: ``ref`` keeps every step's ``StepInfo`` (as a
history list would), ``keep`` keeps the periodic optimizers referenced without closing them
(their offload threads and buffers live on). Prints a table and ``SOAK OK`` or ``SOAK FAILED``
(exit status 1) on rank 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroAdamW

SHAPES = {"w1": (32, 48), "b1": (48,), "w2": (48, 16), "b2": (16,)}
BIG = 1 << 19  # the periodic optimizers' extra tensor: 2 MiB, a 2**18-element shard on 2 ranks


def usage() -> tuple[int, int, int]:
    """``(RSS in KiB, open descriptors, threads)`` of this process."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def fixed_mmap_threshold(threshold: int = 128 << 10) -> None:
    """Have glibc map every allocation of ``threshold`` bytes or more on its own and unmap it
    when freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold
    after such a free): the periodic optimizers' MiB-sized buffers then go back to the system
    as they are freed instead of staying in the heap, whose RSS would step by MiBs as the
    allocator pleases. Nothing where the C library has no ``mallopt``."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def initial_params() -> dict:
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}


def write_grads(params, grads, rng) -> float:
    """The gradients of a mean squared error on a fresh batch into ``grads``; the loss."""
    x = rng.standard_normal((16, 32)).astype(np.float32)
    y = np.tanh(x[:, :16])
    h = np.maximum(x @ params["w1"] + params["b1"], 0)
    err = (h @ params["w2"] + params["b2"] - y) / len(x)
    grads["w2"][...] = h.T @ err
    grads["b2"][...] = err.sum(0)
    dh = (err @ params["w2"].T) * (h > 0)
    grads["w1"][...] = x.T @ dh
    grads["b1"][...] = dh.sum(0)
    return float((err * err).sum() * len(x))


def periodic(index: int, comm, rank: int, keep: list | None) -> None:
    """Build another optimizer (offload threads, stage 2 or plain, in turn), step it a few
    times and close it (``keep``: hold it instead, unclosed: the ``keep`` leak)."""
    size = comm.Get_size()
    options = [{"offload": "cpu", "offload_threads": 2}, {"shard_gradients": True}, {}][index % 3]
    group = 2 if size >= 4 and size % 2 == 0 else None
    shapes = {**SHAPES, "big": (BIG,)}  # big enough for the offload kernel's threads to run
    opt = ZeroAdamW({**initial_params(), "big": np.zeros(BIG, np.float32)}, comm, lr=1e-3,
                    shard_group_size=group, **options)
    rng = np.random.default_rng([index, rank])
    for _ in range(3):
        if options.get("shard_gradients"):
            for name, shape in shapes.items():
                opt.add_grad(name, rng.standard_normal(shape).astype(np.float32))
        else:
            for name, shape in shapes.items():
                opt.grads[name][...] = rng.standard_normal(shape)
        opt.step(wait=False)
    if keep is not None:
        keep.append(opt)
    else:
        opt.close()


def slope_span(steps: list[int], values: list[float]) -> float:
    """The growth along the least-squares line through ``(steps, values)`` over its span."""
    if len(steps) < 2:
        return 0.0
    slope = np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0]
    return float(slope * (steps[-1] - steps[0]))


def verdict(samples: list[dict], warmup: int, tolerance_kib: float) -> list[str]:
    """What is not flat after ``warmup`` steps, per rank (an empty list: flat)."""
    problems = []
    after = [s for s in samples if s["step"] >= warmup]
    if len(after) < 3:
        return [f"only {len(after)} samples after the warm-up of {warmup} steps: run longer"]
    for rank in range(len(after[0]["rss"])):
        base = after[0]
        rss = [s["rss"][rank] for s in after]
        for what in ("fds", "threads"):
            changed = [s for s in after if s[what][rank] != base[what][rank]]
            if changed:
                problems.append(f"rank {rank}: {what} {base[what][rank]} at step {base['step']},"
                                f" {changed[-1][what][rank]} at step {changed[-1]['step']}")
        growth = rss[-1] - rss[0]
        fitted = slope_span([s["step"] for s in after], rss)
        if growth > tolerance_kib or fitted > tolerance_kib:
            problems.append(f"rank {rank}: RSS grew {growth} KiB from step {base['step']} to "
                            f"{after[-1]['step']} ({fitted:.0f} KiB along the fitted line), "
                            f"more than {tolerance_kib:g} KiB")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=8000)
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--rebuild-every", type=int, default=1000)
    parser.add_argument("--leak", choices=("none", "ref", "keep"), default="none")
    parser.add_argument("--rss-tolerance-kib", type=float, default=1024)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    fixed_mmap_threshold()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    history, kept = [], ([] if args.leak == "keep" else None)
    rng = np.random.default_rng([1, rank])
    samples, started = [], time.perf_counter()
    with ZeroAdamW(initial_params(), comm, lr=1e-3, weight_decay=0.01,
                   max_grad_norm=1.0) as opt:
        params = {name: opt.params[name] for name in SHAPES}  # views (wait() before reading)
        for step in range(args.steps + 1):
            if step % args.sample_every == 0:
                rss, fds, threads = usage()
                gathered = comm.gather((rss, fds, threads))
                if rank == 0:
                    samples.append({"step": step, "seconds": time.perf_counter() - started,
                                    "rss": [g[0] for g in gathered],
                                    "fds": [g[1] for g in gathered],
                                    "threads": [g[2] for g in gathered]})
            if step == args.steps:
                break
            opt.wait()
            loss = write_grads(params, opt.grads, rng)
            info = opt.step(wait=step % 2 == 0)
            if args.leak == "ref":
                history.append(info)
            if step % args.rebuild_every == args.rebuild_every // 2:  # between two samples
                periodic(step // args.rebuild_every, comm, rank, kept)
    seconds = time.perf_counter() - started
    if rank != 0:
        return comm.bcast(None)
    problems = verdict(samples, args.warmup, args.rss_tolerance_kib)
    print(f"soak: {comm.Get_size()} ranks, {args.steps} steps in {seconds:.1f} s "
          f"({args.steps / seconds:.0f} steps/s), an optimizer built and closed every "
          f"{args.rebuild_every} steps, leak={args.leak}; last loss {loss:.4f}")
    print(f"{'step':>7} {'s':>7} {'RSS KiB (per rank)':>22} {'fds':>9} {'threads':>9}")
    every = max(1, len(samples) // 20)
    for index, s in enumerate(samples):
        if index % every == 0 or s is samples[-1]:
            print(f"{s['step']:>7} {s['seconds']:>7.1f} {'/'.join(map(str, s['rss'])):>22} "
                  f"{'/'.join(map(str, s['fds'])):>9} {'/'.join(map(str, s['threads'])):>9}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "seconds": seconds,
                                         "leak": args.leak, "samples": samples,
                                         "problems": problems}, indent=1))
    if problems:
        print("SOAK FAILED after the warm-up of {} steps:\n  {}".format(
            args.warmup, "\n  ".join(problems)))
    else:
        print(f"SOAK OK: after the warm-up of {args.warmup} steps, descriptors and threads "
              f"unchanged, RSS within {args.rss_tolerance_kib:g} KiB")
    return comm.bcast(1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
