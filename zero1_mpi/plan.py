"""``zero1_mpi.plan`` and ``python -m zero1_mpi.plan``, kept for user code and scripts: the
communication model and ``zero1-plan`` live in ``zero1_mpi.cli.plan``."""

import sys

from .cli.plan import compare, main, packed_bytes, parse_rate, parse_seconds, plan

__all__ = ["plan", "compare", "packed_bytes", "parse_rate", "parse_seconds", "main"]

if __name__ == "__main__":
    sys.exit(main())
