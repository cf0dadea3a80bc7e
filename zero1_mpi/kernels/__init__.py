"""Array work on one rank: the backends and the kernels outside the update rules.

- ``backend.py``: NumPy or CuPy (the only module that imports CuPy), the supported dtypes,
  device copies and CuPy's ``ElementwiseKernel`` with readable compile errors.
- ``numba_shared.py``: what every Numba twin shares (16-bit values as bit patterns, chunking,
  lazy compilation); Numba is optional.
- ``numba_forms.py``: how the masters and the rule's state are stored, a chunk at a time, for
  the Numba twins' one pass per range (remainder masters, bf16 state rounded stochastically).
- ``local_sums.py``: the engine's own sums (sums of squares for the norm, blocks received from
  every rank summed in fp32) in three twins, and which CPU kernel family runs
  (``ZERO1_MPI_KERNEL``).

The rules' update kernels live with their rules (``zero1_mpi.rules``).
"""

__all__: list[str] = []
