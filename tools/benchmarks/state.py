"""State modes: step time and bytes per parameter of each way of keeping the sharded state.

One rank (``MPI.COMM_SELF``), a flat bf16 model of --params parameters in a few tensors, the
rule of --rule, each CPU kernel family of --kernels (``numpy``, ``numba``) or ``cupy``
(--backend cupy). For each mode (the engine options that choose it: ``masters``,
``state_dtype``), the median
step time over --steps steps (gradients written before each step; the device synchronized
after it), its ratio to the first mode's, measured in the same run and interleaved step by
step so that the machine's drift falls on every mode alike, and the sharded bytes per
parameter (``memory_report().optimizer_state / Ψ``: K). Example:
python tools/bench.py state --params 16M --kernels numpy,numba
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import common

RANKS, TIMEOUT = False, None

#: (label, engine options) of each mode, the first the baseline of the ratios.
MODES = (
    ("fp32 masters", {"masters": "fp32"}),
    ("remainder masters", {"masters": "remainder"}),
    ("remainder + bf16 state", {"masters": "remainder", "state_dtype": "bfloat16"}),
    ("remainder + int8 state", {"masters": "remainder", "state_dtype": "int8"}),
)


def options(parser) -> None:
    common.params(parser, "16M")
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--kernels", default="numpy,numba",
                        help="the CPU kernel families to time (ZERO1_MPI_KERNEL), for numpy")
    parser.add_argument("--rule", default="adam", help="a rule of zero1_mpi.rules.registry")
    common.steps(parser, 10)


def worker(args) -> dict:
    from zero1_mpi.kernels.backend import xp_for

    xp = xp_for(args.backend)
    kernels = ["cupy"] if args.backend == "cupy" else args.kernels.split(",")
    rows = []
    for kernel in kernels:
        if kernel != "cupy":
            os.environ["ZERO1_MPI_KERNEL"] = kernel
        rows += measure(xp, args.params, args.rule, args.steps, kernel)
    return {"rows": rows}


def measure(xp, psi: int, rule: str, steps: int, kernel: str) -> list[dict]:
    """Every mode of ``MODES`` on ``psi`` bf16 parameters, its steps interleaved with the
    others'."""
    from mpi4py import MPI

    from zero1_mpi.rules.registry import get

    parts = 4
    sizes = [psi // parts + (i < psi % parts) for i in range(parts)]
    rng = np.random.default_rng(0)
    init = {f"w{i}": rng.standard_normal(n).astype(np.float32) * 0.02
            for i, n in enumerate(sizes)}
    opts = [get(rule).optimizer({k: xp.asarray(v) for k, v in init.items()}, MPI.COMM_SELF,
                                param_dtype="bfloat16", **engine) for _, engine in MODES]
    grads = {k: xp.asarray((rng.standard_normal(v.size) * 1e-3).astype(np.float32))
             for k, v in init.items()}
    device = xp is not np
    times = [[] for _ in MODES]
    for step in range(steps + 1):
        for opt, spent in zip(opts, times):
            for name, g in grads.items():
                opt.grads[name][...] = g
            if device:
                xp.cuda.Device().synchronize()
            start = time.perf_counter()
            opt.step()
            if device:
                xp.cuda.Device().synchronize()
            if step:  # the first step compiles
                spent.append(time.perf_counter() - start)
    base = float(np.median(times[0]))
    rows = []
    for (label, engine), opt, spent in zip(MODES, opts, times):
        report = opt.memory_report()
        ms = float(np.median(spent))
        rows.append({"mode": label, "options": engine, "kernel": kernel, "psi": psi,
                     "rule": rule, "step_ms": 1e3 * ms, "ratio": ms / base,
                     "k": report.optimizer_state / psi, "k_formula": report.bytes_per_param})
    return rows


def report(args, results: list[dict]) -> dict:
    rows = results[0]["rows"]
    print(f"{args.rule}, {args.params:,} bf16 parameters, 1 rank, {args.backend}; "
          f"median of {args.steps} steps, interleaved")
    print(f"{'kernel':7s} {'mode':22s} {'step ms':>9s} {'ratio':>7s} {'K measured':>11s} "
          f"{'K formula':>10s}")
    for row in rows:
        print(f"{row['kernel']:7s} {row['mode']:22s} {row['step_ms']:9.1f} {row['ratio']:7.3f} "
              f"{row['k']:11.3f} {row['k_formula']:10g}")
    return {"rows": rows}
