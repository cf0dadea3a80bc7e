"""Session set-up shared by the tests."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = """
import numpy as np
from zero1_mpi.backend import PARAM_DTYPES
from zero1_mpi.reductions import NumbaReductions
from zero1_mpi.rules.registry import builtin_rules
reductions = NumbaReductions()
for dtype in PARAM_DTYPES.values():
    for entry in builtin_rules().values():
        for rule in entry.variants:
            s = rule.scalars(1, rule.check_options(**entry.defaults), 1.0)
            kernel = rule.kernel("numba", 64)
            state = [np.zeros(64, np.float32) for _ in range(1 + len(rule.state_names))]
            param = None if dtype == np.float32 else np.ones(64, dtype)
            if rule.tensor_sums:
                kernel.tensor_sums(np.ones(64, dtype), *state, s)
                kernel.apply(*state, param, rule.tensor_scalars(s, [1.0] * rule.tensor_sums))
            else:
                kernel(np.ones(64, dtype), *state, param, s)
    reductions.sum_of_squares(np.ones(64, dtype))
    reductions.sum_blocks(np.ones((2, 64), dtype), np.zeros(64, np.float32))
"""


@pytest.fixture(scope="session", autouse=True)
def warm_numba_cache():
    """Compile the Numba kernels (every registered rule's, and the reductions) once, before any
    multi-rank case runs: they are cached on disk (``cache=True``), so every rank then loads
    them instead of all ranks compiling at once under their cases' timeouts (a fresh clone
    starts with a cold cache). In a process of its own: where Numba is missing or fails, the
    cases run as they would have anyway."""
    subprocess.run([sys.executable, "-c", WARM_UP], cwd=ROOT, capture_output=True, timeout=300)
