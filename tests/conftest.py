"""Session set-up shared by the tests."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = """
import numpy as np
from zero1_mpi.backend import PARAM_DTYPES
from zero1_mpi.kernels_numba import NumbaAdam, NumbaLamb, NumbaLion, NumbaReductions, NumbaSGD
from zero1_mpi.rules.adam import AdamScalars
from zero1_mpi.rules.lamb import Lamb
from zero1_mpi.rules.lion import Lion
from zero1_mpi.rules.sgd import SGD
adam = AdamScalars.for_step(1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                            decoupled=False)
sgd = SGD.scalars(1, {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.1,
                      "nesterov": False}, 1.0)
lion = Lion.scalars(1, {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}, 1.0)
lamb = Lamb.scalars(1, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.1},
                    1.0)
reductions = NumbaReductions()
for dtype in PARAM_DTYPES.values():
    state = [np.zeros(64, np.float32) for _ in range(3)]
    param = None if dtype == np.float32 else np.ones(64, dtype)
    NumbaAdam()(np.ones(64, dtype), *state, param, adam)
    NumbaSGD(True)(np.ones(64, dtype), *state[:2], param, sgd)
    NumbaLion()(np.ones(64, dtype), *state[:2], param, lion)
    NumbaLamb().tensor_sums(np.ones(64, dtype), *state, lamb)
    NumbaLamb().apply(*state, param, lamb)
    reductions.sum_of_squares(np.ones(64, dtype))
    reductions.sum_blocks(np.ones((2, 64), dtype), state[0])
"""


@pytest.fixture(scope="session", autouse=True)
def warm_numba_cache():
    """Compile the Numba kernels (every rule's, and the reductions) once, before any
    multi-rank case runs: they are cached on disk (``cache=True``), so every rank then loads
    them instead of all ranks compiling at once under their cases' timeouts (a fresh clone starts with a cold cache). In a process of
    its own: where Numba is missing or fails, the cases run as they would have anyway."""
    subprocess.run([sys.executable, "-c", WARM_UP], cwd=ROOT, capture_output=True, timeout=300)
