"""python tools/docs_options.py [--check]

Writes the engine options' list of docs/api.md (between ``zero1_mpi.config.generated.MARKERS``)
from their one declaration, ``zero1_mpi.config.options.OPTIONS``; ``--check`` only says whether it
is current (exit status 1 if not; tests/test_structure.py checks the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero1_mpi.config.generated import MARKERS, markdown  # noqa: E402

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def rewritten(text: str) -> str:
    """``text`` (docs/api.md) with the list between the markers generated anew."""
    head, found, rest = text.partition(MARKERS[0] + "\n")
    _, end, tail = rest.partition(MARKERS[1])
    if not found or not end:
        raise SystemExit(f"{API}: the markers {MARKERS} are missing")
    return f"{head}{MARKERS[0]}\n{markdown()}\n{MARKERS[1]}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    text = API.read_text()
    new = rewritten(text)
    if args.check:
        print("current" if new == text else "stale: run python tools/docs_options.py")
        return 0 if new == text else 1
    API.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
