"""Session set-up shared by the tests."""

import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def warm_numba_cache():
    """Compile the Numba kernels once, here, before any multi-rank case runs: they are cached
    on disk (``cache=True``), so every rank then loads them instead of all ranks compiling at
    once under their cases' timeouts (a fresh clone starts with a cold cache)."""
    try:
        from zero1_mpi.kernels import AdamScalars
        from zero1_mpi.kernels_numba import NumbaAdam
    except ImportError:  # no Numba: the cases use the NumPy kernel
        return
    from zero1_mpi.backend import PARAM_DTYPES
    s = AdamScalars.for_step(1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                             decoupled=False)
    kernel = NumbaAdam()
    for dtype in PARAM_DTYPES.values():
        n = 64
        state = [np.zeros(n, np.float32) for _ in range(3)]
        kernel(np.ones(n, dtype), *state, None if dtype == np.float32 else np.ones(n, dtype), s)
        kernel.sum_of_squares(np.ones(n, dtype))
        kernel.sum_blocks(np.ones((2, n), dtype), state[0])
