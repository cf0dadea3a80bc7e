"""Offload: step time and bytes per parameter with and without ``offload="cpu"``, one rank;
offloaded, for each share of --fractions (``offload_fraction``: default 0.5 and 1).

A flat bf16 model of --params parameters (a few large tensors), AdamW by default (--rule). For
each setting: the median step time (the gradients written before each step, the device
synchronized after it), the bytes the device holds per parameter as measured (CuPy's memory
pool; for NumPy parameters the arrays' own bytes) against the report's ``device_bytes``, and the
host bytes per parameter (the report, and what ``tracemalloc`` saw while building; page-locked
buffers come from CuPy's pinned pool, which it does not see). Every setting in one run.
Example: python tools/bench.py offload --params 1B --backend cupy
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np

from . import common

RANKS, TIMEOUT = False, None


def options(parser) -> None:
    common.params(parser, "1B")
    parser.add_argument("--backend", default="cupy", choices=["cupy", "numpy"])
    parser.add_argument("--rule", default="adam", help="a rule of zero1_mpi.rules.registry")
    common.steps(parser, 3)
    parser.add_argument("--fractions", type=_fractions, default=[0.5, 1.0],
                        help="offload_fraction of each offloaded row: 0.5,1 (default)")


def _fractions(text: str) -> list[float]:
    values = [float(part) for part in text.split(",")]
    if not values or not all(0 <= v <= 1 for v in values):
        raise ValueError(f"--fractions {text!r}: shares from 0 to 1, e.g. 0.5,1")
    return values


def worker(args) -> dict:
    from zero1_mpi.kernels.backend import xp_for

    try:
        xp = xp_for(args.backend)
    except ImportError as exc:
        raise SystemExit(f"tools/bench.py offload --backend {args.backend}: {exc}; or measure "
                         "NumPy arrays with --backend numpy") from None
    settings = [(None, 1.0)] + [("cpu", fraction) for fraction in args.fractions]
    return {"rows": [measure(xp, args.params, args.rule, offload, args.steps, fraction)
                     for offload, fraction in settings]}


def measure(xp, psi: int, rule: str, offload, steps: int, fraction: float = 1.0) -> dict:
    """One optimizer of ``psi`` bf16 parameters: its step time and bytes."""
    from mpi4py import MPI

    from zero1_mpi.rules.registry import get

    parts = 8  # tensors: the share offloaded falls at one of their starts
    sizes = [psi // parts + (i < psi % parts) for i in range(parts)]
    params = {f"w{i}": xp.full(n, 0.01, np.float32) for i, n in enumerate(sizes)}
    device = xp is not np
    pool = xp.get_default_memory_pool() if device else None
    if device:
        xp.cuda.Device().synchronize()
    before = pool.used_bytes() if device else 0
    tracemalloc.start()
    try:
        host_before = tracemalloc.get_traced_memory()[0]
        opt = get(rule).optimizer(params, MPI.COMM_SELF, param_dtype="bfloat16",
                                  offload=offload, offload_fraction=fraction)
        traced = tracemalloc.get_traced_memory()[0] - host_before
    finally:
        tracemalloc.stop()
    del params

    times = []
    for _ in range(steps + 1):
        for name in opt.grads:
            opt.grads[name][...] = 1e-3
        if device:
            xp.cuda.Device().synchronize()
        start = time.perf_counter()
        opt.step()
        if device:
            xp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    report = opt.memory_report()
    held = (pool.used_bytes() - before) if device else report.device_bytes
    on_host = report.offloaded  # (offload_fraction=0: the optimizer without offload)
    row = {"offload": offload, "fraction": report.offload_fraction if on_host else 0.0,
           "psi": psi, "rule": rule, "kernel": opt.kernel,
           "threads": opt.offload_threads if on_host else None,
           "step_ms": 1e3 * float(np.median(times[1:])),
           "device_measured_per_param": held / psi,
           "device_report_per_param": report.device_bytes / psi,
           "device_formula_per_param": report.device_formula_bytes / psi,
           "host_report_per_param": report.host_bytes / psi,
           "host_formula_per_param": report.host_formula_bytes / psi,
           "host_traced_per_param": traced / psi if device else None}
    del opt
    if device:
        pool.free_all_blocks()
    return row


def report(args, results: list[dict]) -> dict:
    rows = results[0]["rows"]
    print(f"{args.rule}, {args.params:,} bf16 parameters, 1 rank, {args.backend}")
    print(f"{'offload':16s} {'step ms':>9s} {'device B/param':>15s} {'(report, formula)':>18s} "
          f"{'host B/param':>13s} {'(formula)':>10s}  host kernel")
    for row in rows:
        where = f"{row['offload']} {row['fraction']:.2f}" if row["offload"] else "None"
        where += " (none)" if row["offload"] and not row["threads"] else ""
        print(f"{where:16s} {row['step_ms']:9.1f} "
              f"{row['device_measured_per_param']:15.2f} "
              f"{row['device_report_per_param']:8.2f},{row['device_formula_per_param']:6.1f}   "
              f"{row['host_report_per_param']:13.2f} {row['host_formula_per_param']:10.1f}  "
              f"{row['kernel']} x {row['threads'] or 1}")
    ratios = [row["step_ms"] / rows[0]["step_ms"] for row in rows[1:]]
    print("offloaded step / device step: " + ", ".join(
        f"{r:.2f} ({row['fraction']:.2f} on the host)" for r, row in zip(ratios, rows[1:])))
    return {"rows": rows, "offload_over_device": ratios[-1], "ratios": ratios}
