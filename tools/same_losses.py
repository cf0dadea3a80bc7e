"""Whether runs logged by tools/gpu_check.sh ended with the same loss:

    python tools/same_losses.py gpu_check.log [--rtol R] "CHECK A=CHECK B" ...

Each check's section of the log runs from ``=== NAME: command`` to ``=== NAME: PASS|FAIL``;
its loss is the last ``last_loss=`` printed there (the examples' ``final:`` line). Exits 1
naming each pair whose losses differ (beyond ``--rtol``; default: digit for digit) or are
missing (a check that did not run, or failed before its last line); prints every loss found.
"""

from __future__ import annotations

import argparse
import re
import sys


def final_losses(log: str) -> dict[str, str]:
    """The last ``last_loss=`` value of each check's section of ``log``."""
    losses = {}
    for name, body in re.findall(r"^=== (.+?): .*?\n(.*?)^=== \1: (?:PASS|FAIL)", log,
                                 re.S | re.M):
        found = re.findall(r"last_loss=(\S+)", body)
        if found:
            losses[name] = found[-1]
    return losses


def same(a: str | None, b: str | None, rtol: float) -> bool:
    if a is None or b is None:
        return False
    return a == b if rtol == 0 else abs(float(a) - float(b)) <= rtol * abs(float(a))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("pairs", nargs="+", metavar="A=B")
    parser.add_argument("--rtol", type=float, default=0.0)
    args = parser.parse_args(argv)
    losses = final_losses(open(args.log).read())
    for name, loss in losses.items():
        print(f"{name}: last_loss={loss}")
    pairs = [pair.split("=", 1) for pair in args.pairs]
    bad = [f"{a} ({losses.get(a)}) vs {b} ({losses.get(b)})" for a, b in pairs
           if not same(losses.get(a), losses.get(b), args.rtol)]
    for line in bad:
        print(f"DIFFER: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
