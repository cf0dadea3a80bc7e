"""python tools/properties.py [--examples 300] [--ranks 1,2,3,4] [--timeout 3600]

The property-based tests of tests/cases/properties.py with more cases than CI draws (CI: 12 on
1 and 4 ranks), on each world size in turn, through ``zero1_mpi.launcher`` (the NumPy kernels,
one thread a rank, as the tests run). Prints each run's summary line, or its failure with the
smallest failing case Hypothesis found; exits 1 if any world size failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zero1_mpi.launcher import run  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--ranks", default="1,2,3,4")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZERO1_MPI_KERNEL": "numpy",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for n in [int(x) for x in args.ranks.split(",")]:
        done = run(n, [sys.executable, "-m", "mpi4py", "tests/cases/properties.py",
                       "--examples", str(args.examples)], timeout=args.timeout,
                   environ=env, cwd=ROOT)
        ok = [line for line in done.stdout.splitlines() if line.startswith("OK properties")]
        if done.returncode == 0 and ok:
            print(ok[0], flush=True)
        else:
            failed += 1
            print(f"{n} ranks FAILED (exit {done.returncode}):\n{done.stdout}\n{done.stderr}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
