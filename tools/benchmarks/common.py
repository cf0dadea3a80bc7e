"""What every benchmark of ``tools/bench.py`` shares: its options, launching, timing, tables.

A benchmark is a module of this package with
- a docstring: its first line is the subcommand's help, the whole its ``--help``;
- ``RANKS``: the default of ``--ranks`` (e.g. ``"1,2,4"``), ``None`` (``--ranks`` optional:
  without it the benchmark measures the ranks of the job it runs in), or ``False`` (one
  process: no ``--ranks``); ``TIMEOUT``: seconds per ``mpiexec`` job;
- ``options(parser)``: its own options (``params`` and ``steps`` add the shared ones);
- ``worker(args) -> dict``: the measurement, called on every rank of the job; rank 0's return
  value is the result and, where the benchmark has ``--ranks``, holds ``world_size``;
- ``report(args, results) -> object``: prints the results (one per world size, in order) and
  returns what ``--json`` writes.

With ``--ranks 1,2`` it runs ``python -m mpi4py tools/bench.py NAME ... --worker`` under
``mpiexec -n N`` for each N (``launch.run_ranks``), each job printing rank 0's result as one JSON
line; without, it calls ``worker`` in this process. Timing helpers take an mpi4py communicator
and must be called on all of its ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from zero1_mpi.memory import parse_param_count

BENCH = Path(__file__).resolve().parents[1] / "bench.py"


# -- options -----------------------------------------------------------------------------------

def count(text: str) -> int:
    """An argparse type: ``'100M'``, ``'1.3e9'``, ``'4096'`` -> a count (``parse_param_count``)."""
    try:
        return parse_param_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= {minimum}")
        return value
    return whole_number


def comma_list(parse):
    """An argparse type: ``'a,b'`` -> ``[parse('a'), parse('b')]``."""
    def comma_list(text: str) -> list:
        return [parse(part) for part in text.split(",")]
    return comma_list


def params(parser, default: str, what: str = "parameters") -> None:
    """``--params``: a count of ``what`` (``100M``, ``1.3e9``, ``4096``)."""
    parser.add_argument("--params", type=count, default=default,
                        help=f"{what}, e.g. 100M, 1.3e9 or 4096 (default {default})")


def steps(parser, default: int, warmup: int | None = None) -> None:
    """``--steps`` (timed) and, where ``warmup`` is given, ``--warmup`` (untimed first)."""
    parser.add_argument("--steps", type=at_least(1), default=default,
                        help=f"timed steps (default {default})")
    if warmup is not None:
        parser.add_argument("--warmup", type=at_least(0), default=warmup,
                            help=f"untimed steps before them (default {warmup})")


def add_shared(parser, bench) -> None:
    """The options every benchmark has: ``--json``, and for those that run on ranks
    ``--ranks``, ``--mpiexec``, ``--timeout`` and the internal ``--worker``."""
    parser.add_argument("--json", help="write all numbers to this file")
    if bench.RANKS is False:
        return
    across = f"(default {bench.RANKS})" if bench.RANKS else \
        "(default: the ranks of the job this runs in)"
    parser.add_argument("--ranks", type=comma_list(at_least(1)), default=bench.RANKS,
                        help=f"world sizes, one mpiexec job each, e.g. 1,2,4 {across}")
    parser.add_argument("--mpiexec", help="MPI launcher, flags allowed (default: "
                        "$ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=bench.TIMEOUT,
                        help=f"seconds per mpiexec job (default {bench.TIMEOUT:g})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


# -- running -----------------------------------------------------------------------------------

def run(bench, args, argv: list[str]) -> int:
    """Measure (in this job, or one ``mpiexec`` job per ``--ranks`` entry), print the
    benchmark's report on rank 0 and write ``--json``."""
    if getattr(args, "ranks", None) and not args.worker:
        from launch import run_ranks

        results = []
        for n in args.ranks:
            results.append(run_ranks(n, str(BENCH), [*argv, "--worker"], args.mpiexec,
                                     args.timeout))
            print(f"N={n} done", file=sys.stderr, flush=True)
    else:
        from mpi4py import MPI

        result = bench.worker(args)
        if MPI.COMM_WORLD.Get_rank() != 0:
            return 0
        if getattr(args, "worker", False):
            print(json.dumps(result), flush=True)
            return 0
        results = [result]
    found = bench.report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return 0


def init_gloo(comm) -> None:
    """torch.distributed over gloo on the ranks of ``comm``, as examples/gpt_torch.py's
    setup_ddp: rank 0 serves a TCPStore on a port the OS picks, MPI tells the others."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                          wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None)
    store = store or dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


# -- timing ------------------------------------------------------------------------------------

def slowest(comm, value):
    """The largest ``value`` (seconds, bytes) over the ranks of ``comm``."""
    from mpi4py import MPI
    return comm.allreduce(value, op=MPI.MAX)


def clock(fn) -> float:
    """Seconds of ``fn()`` on this rank."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed(comm, fn) -> float:
    """Seconds of ``fn()`` on the slowest rank, each rank timing it from a barrier."""
    comm.Barrier()
    return slowest(comm, clock(fn))


def median_phases(comm, fn, steps: int, warmup: int) -> dict:
    """``fn()`` returns its seconds by phase: the median over ``steps`` calls (after ``warmup``
    untimed ones, a barrier before each) of each phase's time on the slowest rank."""
    samples: dict[str, list[float]] = {}
    for i in range(warmup + steps):
        comm.Barrier()
        phases = fn()
        if i >= warmup:
            for phase, seconds in phases.items():
                samples.setdefault(phase, []).append(slowest(comm, seconds))
    return {phase: statistics.median(values) for phase, values in samples.items()}


# -- tables ------------------------------------------------------------------------------------

def row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def rule(align: str) -> str:
    """A markdown table's header rule: ``r`` a right-aligned column, ``l`` a left-aligned one."""
    return "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
