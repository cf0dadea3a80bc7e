"""N ranks == one process (tests/cases/parity.py): every rule of the registry against its
float64 reference on the averaged gradients, awkward layouts, the training loop's features.

Rank counts for what they prove: 1 (the trivial group, where reductions are copies), 3 (shards
of uneven real sizes, a count that divides nothing), 4 (a power of two: also bitwise against
one process running the engine, the reference of a rule without a float64 one), and 2 with
the kernel a user gets (Numba where it imports: its twins are bitwise the NumPy ones,
tests/test_rule_kernels.py; here they run inside the engine).
"""

import importlib.util

import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("n, kernel, sub_cases", [
    (1, "numpy", ()), (2, "auto", ()), (3, "numpy", ()),
    (4, "numpy", ("rules", "engine-oracle", "layouts", "training"))])
def test_n_ranks_equal_one_process(n, kernel, sub_cases):
    out = run_mpi(n, "parity.py", *sub_cases, timeout=300,
                  env={"ZERO1_MPI_KERNEL": kernel}).stdout
    ran = kernel
    if kernel == "auto":  # Numba where it imports: say which one ran
        ran = "numba" if importlib.util.find_spec("numba") else "numpy"
    assert f"on {n} ranks (numpy, kernel {ran})" in out, out
    for what in ("rule cases", "layouts", "training cases") + \
            (("rule cases against one engine",) if "engine-oracle" in sub_cases else ()):
        assert what in out, out
