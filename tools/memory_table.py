"""python tools/memory_table.py [--params 7B] [--gpus 1,4,8,16,32,64,128] [--measure]

Prints the seed's per-GPU memory table (GB = 1e9 bytes) for ZeRO stages 0-3. With
``--measure`` it instead runs a real ``zero1_mpi.ZeroAdam`` under ``mpiexec -n N`` for each N in
``--gpus`` (default 1,2,4; ``--params`` default 10M) and prints, for the rank holding the most
(ties: the most padding + scratch), its measured bytes next to the stage-1 formula. Summed over
ranks, ``measured - formula`` must equal ``padding + scratch``: the "balanced" column says so.

    python tools/memory_table.py --params 1.3e9 --gpus 1,2,4
    python tools/memory_table.py --measure --params 1M --gpus 1,2 --dtype bfloat16
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
from zero1_mpi.memory import MemoryReport, format_param_count, format_table, parse_param_count

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


def worker(psi: int, dtype: str) -> None:
    """Runs on every rank: build ZeroAdam, gather each rank's report, print one JSON line on 0."""
    import numpy as np
    from mpi4py import MPI
    from zero1_mpi import ZeroAdam

    if dtype == "bfloat16":
        import ml_dtypes
        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    comm = MPI.COMM_WORLD
    params = {f"t{i}": np.zeros(shape, np_dtype) for i, shape in enumerate(tensor_shapes(psi))}
    opt = ZeroAdam(params, comm=comm, lr=1e-3, param_dtype=dtype)
    report = opt.memory_report()
    if not isinstance(report, MemoryReport):
        raise TypeError(f"ZeroAdam.memory_report() returned {type(report).__name__}; "
                        f"it must return zero1_mpi.memory.MemoryReport")
    reports = comm.gather(report.as_dict(), root=0)
    if comm.rank == 0:
        print(json.dumps({"world_size": comm.size, "reports": reports}), flush=True)


def measure(psi: int, gpus, dtype: str = "float16", mpiexec: str | None = None,
            timeout: float = 300.0) -> dict[int, list[MemoryReport]]:
    """``{N: [report of rank 0, ..., rank N-1]}`` from one ``mpiexec -n N`` run per N."""
    results = {}
    for n in gpus:
        found = run_ranks(n, str(Path(__file__).resolve()),
                          ["--worker", "--params", str(psi), "--dtype", dtype], mpiexec, timeout)
        if len(found.get("reports", ())) != n:
            raise RuntimeError(f"the worker on {n} ranks returned {found!r}")
        results[n] = [MemoryReport(**d) for d in found["reports"]]
    return results


def balanced(reports: list[MemoryReport]) -> bool:
    """Summed over ranks, does ``total - formula`` equal ``padding + comm_scratch``?"""
    diff = sum(r.total - r.formula_bytes for r in reports)
    extra = sum(r.padding + r.comm_scratch for r in reports)
    return abs(diff - extra) <= 1e-9 * max(1.0, abs(diff)) + 0.5


def format_measured(psi: int, dtype: str, results: dict[int, list[MemoryReport]]) -> str:
    """A table: per N, the rank holding the most, its bytes, the formula and the difference."""
    def num(x):
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"

    widths = (6, 6, 14, 14, 12, 12, 12, 10)
    head = ("GPUs", "rank", "measured", "formula", "difference", "padding", "scratch",
            "balanced")
    lines = [f"Measured bytes per rank, ZeroAdam, {format_param_count(psi)} {dtype} parameters",
             "".join(f"{h:>{w}}" for h, w in zip(head, widths)), "-" * sum(widths)]
    for n, reports in results.items():
        r = max(reports, key=lambda r: (r.total, r.padding + r.comm_scratch))
        row = (n, r.rank, r.total, num(r.formula_bytes), num(r.total - r.formula_bytes),
               r.padding, r.comm_scratch, "yes" if balanced(reports) else "NO")
        lines.append("".join(f"{v:>{w}}" for v, w in zip(row, widths)))
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


def _param_count(text: str) -> int:
    try:
        return parse_param_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="memory_table.py",
        description="Per-GPU memory of ZeRO stages: the seed's table, or measured with --measure.")
    parser.add_argument("--params", type=_param_count, default=None,
                        help="parameter count Ψ: 7B, 125M, 1.3e9, 10000 "
                             "(default 7B; 10M with --measure)")
    parser.add_argument("--gpus", type=_gpu_list, default=None,
                        help="comma-separated rank counts (default 1,4,8,16,32,64,128; "
                             "1,2,4 with --measure)")
    parser.add_argument("--measure", action="store_true",
                        help="run zero1_mpi.ZeroAdam under mpiexec and measure it")
    parser.add_argument("--dtype", choices=DTYPES, default="float16",
                        help="parameter dtype for --measure (default float16)")
    parser.add_argument("--mpiexec", default=None,
                        help="MPI launcher for --measure, flags allowed (default: "
                        "$ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per mpiexec run (default 300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.params if args.params is not None else MEASURE_PARAMS, args.dtype)
        return 0
    if not args.measure:
        params = TABLE_PARAMS if args.params is None else args.params
        print(format_table(params, TABLE_GPUS if args.gpus is None else args.gpus))
        return 0
    psi = MEASURE_PARAMS if args.params is None else args.params
    if psi < 1:
        parser.error(f"--params {psi} is too small to measure: pass at least 1")
    try:
        results = measure(psi, MEASURE_GPUS if args.gpus is None else args.gpus, args.dtype,
                          args.mpiexec, args.timeout)
    except RuntimeError as exc:
        print(f"memory_table.py: error: {exc}", file=sys.stderr)
        return 1
    print(format_measured(psi, args.dtype, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
