"""python tools/memory_table.py [--params 7B] [--gpus 1,4,8,16,32,64,128] [--optimizer adam]
                              [--momentum 0.9] [--stage 1|2] [--measure]

Prints the reference chapter's per-GPU memory table (GB = 1e9 bytes) for ZeRO stages 0-3, with
the ``--optimizer``'s bytes per parameter K of the sharded part (adam: the chapter's 12; lamb 12;
sgd 8, or 4 with ``--momentum 0``; lion 8; any rule of ``zero1_mpi.rules.registry``). With
``--measure`` it instead runs that rule's optimizer (``ZeroAdam``, ``ZeroSGD``, ...) under
``mpiexec -n N`` for each
N in ``--gpus`` (default 1,2,4; ``--params`` default 10M) and prints, for the rank holding the
most (ties: the most padding + scratch), its measured bytes next to the stage-1 formula. Summed
over ranks, ``measured - formula`` must equal ``padding + scratch``: the "balanced" column says
so. ``--stage 2`` prints the chapter's Stage 2 column alone, from ``memory.stage_bytes``, the
function ``memory_report()`` holds gradient sharding to; with ``--measure`` it measures
``shard_gradients=True`` (stage 1 by default). The table alone, with more options (dtype,
offload), is ``python -m zero1_mpi.memory`` (the ``zero1-memory`` console script), whose code
this tool shares.

    python tools/memory_table.py --params 1.3e9 --gpus 1,2,4
    python tools/memory_table.py --optimizer sgd --momentum 0
    python tools/memory_table.py --measure --params 1M --gpus 1,2 --dtype bfloat16
    python tools/memory_table.py --measure --optimizer lion --params 1M --gpus 1,2
    python tools/memory_table.py --stage 2 --gpus 4,8,16,32,64,128
    python tools/memory_table.py --measure --stage 2 --params 1M --gpus 1,2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))
from zero1_mpi.memory import MemoryReport, format_param_count, format_table, stage_bytes
from zero1_mpi.cli.memory import DEFAULT_MOMENTUM, describe, momentum_arg, param_count_arg, table_options
from zero1_mpi.rules.registry import builtin_rules

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import run_ranks  # noqa: E402

TABLE_PARAMS, TABLE_GPUS = 7 * 10**9, [1, 4, 8, 16, 32, 64, 128]
MEASURE_PARAMS, MEASURE_GPUS = 10 * 10**6, [1, 2, 4]
DTYPES = ("float16", "bfloat16", "float32")


def tensor_shapes(psi: int) -> list[tuple[int, ...]]:
    """Varied shapes (a scalar, odd sizes, a matrix, a remainder) with exactly ``psi`` elements."""
    shapes, left = [], psi
    for shape, size in (((), 1), ((7,), 7), ((3, 331), 993)):
        if left > size:
            shapes.append(shape)
            left -= size
    rows = left // 2 // 64
    if rows:
        shapes.append((rows, 64))
        left -= rows * 64
    if left:
        shapes.append((left,))
    return shapes


def optimizer_class(optimizer: str):
    """The optimizer class that runs the registered rule ``optimizer``."""
    return builtin_rules()[optimizer].optimizer


def worker(psi: int, dtype: str, optimizer: str = "adam",
           momentum: float = DEFAULT_MOMENTUM, stage: int = 1) -> None:
    """Runs on every rank: build the optimizer, gather each rank's report, print one JSON line
    on rank 0."""
    import numpy as np
    from mpi4py import MPI

    if dtype == "bfloat16":
        import ml_dtypes
        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    comm = MPI.COMM_WORLD
    params = {f"t{i}": np.zeros(shape, np_dtype) for i, shape in enumerate(tensor_shapes(psi))}
    options = {"momentum": momentum} if optimizer == "sgd" else {}
    cls = optimizer_class(optimizer)
    if stage == 2:
        options["shard_gradients"] = True
    opt = cls(params, comm=comm, lr=1e-3, param_dtype=dtype, **options)
    report = opt.memory_report()
    if not isinstance(report, MemoryReport):
        raise TypeError(f"{cls.__name__}.memory_report() returned {type(report).__name__}; "
                        f"it must return zero1_mpi.memory.MemoryReport")
    reports = comm.gather(report.as_dict(), root=0)
    if comm.rank == 0:
        print(json.dumps({"world_size": comm.size, "reports": reports}), flush=True)


def measure(psi: int, gpus, dtype: str = "float16", mpiexec: str | None = None,
            timeout: float = 300.0, optimizer: str = "adam",
            momentum: float = DEFAULT_MOMENTUM, stage: int = 1) -> dict[int, list[MemoryReport]]:
    """``{N: [report of rank 0, ..., rank N-1]}`` from one ``mpiexec -n N`` run per N."""
    results = {}
    for n in gpus:
        found = run_ranks(n, str(Path(__file__).resolve()),
                          ["--worker", "--params", str(psi), "--dtype", dtype,
                           "--optimizer", optimizer, "--stage", str(stage)]
                          + (["--momentum", repr(float(momentum))] if optimizer == "sgd" else []),
                          mpiexec, timeout)
        if len(found.get("reports", ())) != n:
            raise RuntimeError(f"the worker on {n} ranks returned {found!r}")
        results[n] = [MemoryReport(**d) for d in found["reports"]]
    return results


def balanced(reports: list[MemoryReport]) -> bool:
    """Summed over ranks, does ``total - formula`` equal ``padding + comm_scratch``?"""
    diff = sum(r.total - r.formula_bytes for r in reports)
    extra = sum(r.padding + r.comm_scratch for r in reports)
    return abs(diff - extra) <= 1e-9 * max(1.0, abs(diff)) + 0.5


def format_measured(psi: int, dtype: str, results: dict[int, list[MemoryReport]],
                    optimizer: str = "adam", momentum: float = DEFAULT_MOMENTUM) -> str:
    """A table: per N, the rank holding the most, its bytes, the formula and the difference
    (for rules other than Adam the title names the formula: 2Ψ+2Ψ+8Ψ/N, ...)."""
    def num(x):
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"

    widths = (6, 6, 14, 14, 12, 12, 12, 10)
    head = ("GPUs", "rank", "measured", "formula", "difference", "padding", "scratch",
            "balanced")
    title = (f"Measured bytes per rank, {describe(optimizer, momentum)}, "
             f"{format_param_count(psi)} {dtype} parameters")
    labels = {r.formula_label for reports in results.values() for r in reports}
    stage2 = any(r.grad_shard_dtype for reports in results.values() for r in reports)
    if stage2:
        title += ", gradients sharded (stage 2)"
    if (optimizer != "adam" or stage2) and labels:
        title += f", formula {', '.join(sorted(labels))}"
    lines = [title,
             "".join(f"{h:>{w}}" for h, w in zip(head, widths)), "-" * sum(widths)]
    for n, reports in results.items():
        r = max(reports, key=lambda r: (r.total, r.padding + r.comm_scratch))
        row = (n, r.rank, r.total, num(r.formula_bytes), num(r.total - r.formula_bytes),
               r.padding, r.comm_scratch, "yes" if balanced(reports) else "NO")
        lines.append("".join(f"{v:>{w}}" for v, w in zip(row, widths)))
    return "\n".join(lines)


def format_stage(psi: int, gpus, stage: int, k: int, param_dtype: str = "float16") -> str:
    """One stage's column of the table (GB = 1e9 bytes), from ``memory.stage_bytes``."""
    lines = [f"Per-GPU memory (GB) of ZeRO stage {stage} for a {format_param_count(psi)} "
             f"parameter model, K = {k}", f"{'GPUs':>6}{'Stage ' + str(stage):>11}", "-" * 17]
    for n in gpus:
        lines.append(f"{n:>6}{stage_bytes(psi, n, stage, k, param_dtype) / 1e9:>10.1f}G")
    return "\n".join(lines)


def _gpu_list(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers >= 1, "
                                         f"e.g. 1,4,8")
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="memory_table.py",
        description="Per-GPU memory of ZeRO stages: the chapter's table, or measured with "
                    "--measure.")
    parser.add_argument("--params", type=param_count_arg, default=None,
                        help="parameter count Ψ: 7B, 125M, 1.3e9, 10000 "
                             "(default 7B; 10M with --measure)")
    parser.add_argument("--gpus", type=_gpu_list, default=None,
                        help="comma-separated rank counts (default 1,4,8,16,32,64,128; "
                             "1,2,4 with --measure)")
    parser.add_argument("--optimizer", choices=tuple(builtin_rules()), default="adam",
                        help="update rule: its bytes per parameter K in the table, the class "
                             "--measure runs (default adam: K = 12)")
    parser.add_argument("--momentum", type=momentum_arg, default=None,
                        help=f"SGD's momentum (default {DEFAULT_MOMENTUM:g}: K = 8; 0: no "
                             f"momentum buffer, K = 4); only with --optimizer sgd")
    parser.add_argument("--shard-group", type=int, default=None, metavar="K",
                        help="hierarchical sharding: the state sharded within groups of K GPUs "
                             "and replicated across them (rows whose N K does not divide are "
                             "left out); the table only")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=None,
                        help="the table: that stage's column alone; --measure: 2 measures "
                             "gradient sharding (shard_gradients=True; default 1)")
    parser.add_argument("--measure", action="store_true",
                        help="run the --optimizer's zero1_mpi class under mpiexec and measure it")
    parser.add_argument("--dtype", choices=DTYPES, default="float16",
                        help="parameter dtype for --measure (default float16)")
    parser.add_argument("--mpiexec", default=None,
                        help="MPI launcher for --measure, flags allowed (default: "
                        "$ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per mpiexec run (default 300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.momentum is not None and args.optimizer != "sgd":
        parser.error(f"--momentum is SGD's: pass --optimizer sgd (not {args.optimizer})")
    if args.momentum is None:
        args.momentum = DEFAULT_MOMENTUM
    if args.shard_group is not None and (args.measure or args.shard_group < 1):
        parser.error(f"--shard-group {args.shard_group}: a positive group size, for the table "
                     "(not with --measure)")
    if args.worker:
        worker(args.params if args.params is not None else MEASURE_PARAMS, args.dtype,
               args.optimizer, args.momentum, args.stage or 1)
        return 0
    if not args.measure:
        params = TABLE_PARAMS if args.params is None else args.params
        if args.stage is not None:
            if args.shard_group is not None:
                parser.error("--shard-group goes with the whole table, not --stage")
            k = table_options(args.optimizer, momentum=args.momentum)["k"]
            print(format_stage(params, TABLE_GPUS if args.gpus is None else args.gpus,
                               args.stage, k))
            return 0
        print(format_table(params, TABLE_GPUS if args.gpus is None else args.gpus,
                           shard_group=args.shard_group,
                           **table_options(args.optimizer, momentum=args.momentum)))
        return 0
    psi = MEASURE_PARAMS if args.params is None else args.params
    if psi < 1:
        parser.error(f"--params {psi} is too small to measure: pass at least 1")
    try:
        results = measure(psi, MEASURE_GPUS if args.gpus is None else args.gpus, args.dtype,
                          args.mpiexec, args.timeout, args.optimizer, args.momentum,
                          args.stage or 1)
    except RuntimeError as exc:
        print(f"memory_table.py: error: {exc}", file=sys.stderr)
        return 1
    print(format_measured(psi, args.dtype, results, args.optimizer, args.momentum))
    return 0


if __name__ == "__main__":
    sys.exit(main())
