"""python tools/bench.py BENCHMARK [options]: the project's benchmarks, one command.

Each benchmark is a module of tools/benchmarks/ (``python tools/bench.py BENCHMARK --help``
documents it). They share tools/benchmarks/common.py: ``--ranks 1,2,4`` runs one ``mpiexec -n N``
job per world size (without it, a benchmark that has ``--ranks`` measures the ranks of the job
it runs in, e.g. under ``mpiexec -n 2 python -m mpi4py tools/bench.py comm``), ``--json F``
writes all numbers, ``--params`` takes a count (100M, 1.3e9, 4096), and every rank uses one
thread (torch, BLAS, OpenMP).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread per rank, for every library

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]  # this checkout's zero1_mpi, whatever else is

from benchmarks import common  # noqa: E402

NAMES = ("step", "stage2", "stage3", "checkpoint", "comm", "offload", "watchdog", "node", "gpu", "quant", "wire",
         "state")


def parser() -> tuple[argparse.ArgumentParser, dict]:
    """The command's parser, and the benchmark module of each subcommand."""
    top = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    subcommands = top.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    benches = {}
    for name in NAMES:
        bench = benches[name] = importlib.import_module(f"benchmarks.{name}")
        sub = subcommands.add_parser(name, help=bench.__doc__.splitlines()[0],
                                     description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        bench.options(sub)
        common.add_shared(sub, bench)
    return top, benches


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top, benches = parser()
    args = top.parse_args(argv)
    return common.run(benches[args.benchmark], args, argv)


if __name__ == "__main__":
    sys.exit(main())
