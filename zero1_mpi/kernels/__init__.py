"""Array work on one rank: the backends and the kernels outside the update rules.

- ``backend.py``: NumPy or CuPy (the only module that imports CuPy), the supported dtypes,
  device copies and CuPy's ``ElementwiseKernel`` with readable compile errors.
- ``numba_shared.py``: what every Numba twin shares (16-bit values as bit patterns, chunking,
  lazy compilation); Numba is optional.
- ``numba_forms.py``: how the masters and the rule's state are stored (remainder masters, bf16
  state rounded stochastically, 8-bit blocks) for the Numba twins' one pass per range, and
  their chunk codecs.
- ``numba_scalars.py``: the same codecs on one element (fp32 bits by LLVM bitcasts).
- ``numba_generated.py``: that one pass, generated per combination of a rule's element math
  and the stored forms, and cached on disk (``ZERO1_MPI_KERNEL_CACHE``).
- ``cuda_generated.py``: the CuPy twins' one pass, one ``ElementwiseKernel`` generated per
  combination of a rule's element math (CUDA) and the same stored forms.
- ``local_sums.py``: the engine's own sums (sums of squares for the norm, blocks received from
  every rank summed in fp32) in three twins, and which CPU kernel family runs
  (``ZERO1_MPI_KERNEL``).

The rules' update kernels live with their rules (``zero1_mpi.rules``).
"""

__all__: list[str] = []
