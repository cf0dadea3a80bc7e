"""The 8-bit wire format's sizes, stdlib only, for the codec and for the planner alike.

A row of ``n`` values travels as ``packed_bytes(n)`` bytes: an fp32 scale per ``BLOCK`` values,
then the ``n`` int8 values, padded to a multiple of 4 bytes (``codec.py`` packs and unpacks it;
``zero1_mpi.plan`` counts it without NumPy).
"""

__all__ = ["BLOCK", "packed_bytes"]

#: Values per fp32 scale (docs/performance.md: the block size against the bound).
BLOCK = 256


def packed_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes of a packed row of ``n`` values: ``4 * ceil(n / block)`` + ``n`` rounded up to 4."""
    return 4 * -(-n // block) + -(-n // 4) * 4
