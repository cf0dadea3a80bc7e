"""State modes: step time and bytes per parameter of each way of keeping the sharded state.

One rank (``MPI.COMM_SELF``), a flat bf16 model of --params parameters in a few tensors, the
rule of --rule, each CPU kernel family of --kernels (``numpy``, ``numba``) or ``cupy``
(--backend cupy). For each mode (the engine options that choose it: ``masters``,
``state_dtype``), the median
step time over --steps steps (gradients written before each step; the device synchronized
after it), its ratio to the first mode's, measured in the same run and interleaved step by
step so that the machine's drift falls on every mode alike, and the sharded bytes per
parameter (``memory_report().optimizer_state / Ψ``: K). The update alone (the step's
``update`` phase): its milliseconds, the bytes per element it must move as the masters and the
state are stored (``moved_bytes``: the 16-bit gradient read, the parameter, the masters and each
state array read and written), and the GB/s that makes as a share of the in-place stream
(``a += b`` over fp32 arrays of Ψ elements, read a and b, write a) measured in the same run on
the host, or on the GPU (--backend cupy; there the update's time is the synchronized step's, of
which it is all but the launches on one rank). Example: python tools/bench.py state --params
16M --kernels numpy,numba
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
    ("fp32 + bf16 state", {"masters": "fp32", "state_dtype": "bfloat16"}),
    ("remainder + bf16 state", {"masters": "remainder", "state_dtype": "bfloat16"}),
    ("remainder + int8 state", {"masters": "remainder", "state_dtype": "int8"}),
    ("fp32 + int8 state", {"masters": "fp32", "state_dtype": "int8"}),
)
#: Bytes per element a state array of each encoding is read and written with (8 bits: the
#: codes and one fp32 scale per block of 256, ``state.int8_blocks``).
STATE_MOVED = {"float32": 8.0, "bfloat16": 4.0, "int8": 2.0 + 8.0 / 256}


def moved_bytes(states: int, engine: dict) -> float:
    """Bytes per element one update of bf16 parameters must move: the 16-bit gradient read;
    fp32 masters read and written and the new parameter written, or the parameter and its
    int16 remainder read and written; each of ``states`` arrays as ``STATE_MOVED`` says."""
    masters = 8.0 + 2.0 if engine.get("masters") == "fp32" else 4.0 + 4.0
    return 2.0 + masters + states * STATE_MOVED[engine.get("state_dtype", "float32")]


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
    times, updates = [[] for _ in MODES], [[] for _ in MODES]
    for step in range(steps + 1):
        for opt, spent, update in zip(opts, times, updates):
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
                update.append(opt.last_step_seconds["update"])
    a, b = xp.ones(psi, np.float32), xp.zeros(psi, np.float32)

    def add():
        xp.add(a, b, out=a)
        if device:
            xp.cuda.Device().synchronize()

    add()
    stream = 3 * a.nbytes / min(common.clock(add) for _ in range(5)) / 1e9
    base = float(np.median(times[0]))
    rows = []
    for (label, engine), opt, spent, update in zip(MODES, opts, times, updates):
        report = opt.memory_report()
        ms, update_s = float(np.median(spent)), float(np.median(update))
        if device:  # (the update's kernels run after their launches: the synchronized step)
            update_s = ms
        moved = moved_bytes(len(opt.rule.state_names), engine)
        rows.append({"mode": label, "options": engine, "kernel": kernel, "psi": psi,
                     "rule": rule, "step_ms": 1e3 * ms, "ratio": ms / base,
                     "update_ms": 1e3 * update_s, "moved_bytes": moved,
                     "update_GBps": moved * psi / update_s / 1e9, "stream_GBps": stream,
                     "k": report.optimizer_state / psi, "k_formula": report.bytes_per_param})
    return rows


def report(args, results: list[dict]) -> dict:
    rows = results[0]["rows"]
    print(f"{args.rule}, {args.params:,} bf16 parameters, 1 rank, {args.backend}; "
          f"median of {args.steps} steps, interleaved")
    print(f"{'kernel':7s} {'mode':22s} {'step ms':>9s} {'ratio':>7s} {'update ms':>10s} "
          f"{'B/elem':>7s} {'GB/s':>6s} {'of stream':>9s} {'K measured':>11s} {'K formula':>10s}")
    for row in rows:
        print(f"{row['kernel']:7s} {row['mode']:22s} {row['step_ms']:9.1f} {row['ratio']:7.3f} "
              f"{row['update_ms']:10.1f} {row['moved_bytes']:7.2f} {row['update_GBps']:6.1f} "
              f"{row['update_GBps'] / row['stream_GBps']:9.0%} {row['k']:11.3f} "
              f"{row['k_formula']:10g}")
    return {"rows": rows}
