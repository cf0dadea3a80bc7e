"""Per-rank memory of ZeRO data parallelism: the formulas and what one rank measures.

- ``formulas.py``: bytes per rank of each stage for Ψ parameters on N ranks (the seed's table,
  other rules' K, masters, state encodings, offload), their tables, parameter counts.
- ``report.py``: ``MemoryReport``, the bytes one optimizer rank holds by category, each byte
  counted once, beside what the formulas predict.
- ``ledger.py``: ``memory_report``, that report measured from the arrays an optimizer's parts
  allocated.
- ``__main__.py``: ``python -m zero1_mpi.memory``, the ``zero1-memory`` tool (``cli.memory``).

Everything of ``formulas`` and ``MemoryReport`` is re-exported here (``zero1_mpi.memory``).
"""

from .formulas import (
    FP32_DTYPES,
    MASTER_BYTES,
    MIXED_DTYPES,
    MODES,
    STAGE1_FP32,
    STAGES,
    STATE_BYTES,
    baseline_bytes,
    bytes_per_param,
    format_modes_table,
    format_param_count,
    format_table,
    parse_param_count,
    stage1_bytes,
    stage1_fp32_bytes,
    stage2_bytes,
    stage3_bytes,
    stage_bytes,
    stage_terms,
)
from .report import MemoryReport

__all__ = [
    "MemoryReport",
    "STAGES",
    "STAGE1_FP32",
    "MIXED_DTYPES",
    "FP32_DTYPES",
    "MASTER_BYTES",
    "STATE_BYTES",
    "bytes_per_param",
    "stage_terms",
    "stage_bytes",
    "baseline_bytes",
    "stage1_bytes",
    "stage2_bytes",
    "stage3_bytes",
    "stage1_fp32_bytes",
    "format_param_count",
    "parse_param_count",
    "format_table",
    "format_modes_table",
    "MODES",
]
