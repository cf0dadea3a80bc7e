"""``python -m zero1_mpi.memory``: runs the memory tool (``zero1_mpi.cli.memory``), the
``zero1-memory`` console script. A program's entry point, which no module imports."""

import sys

from zero1_mpi.cli.memory import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
