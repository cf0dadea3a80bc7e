"""N ranks == one process (tests/cases/parity.py): every rule of the registry against its
float64 reference on the averaged gradients, awkward layouts, the training loop's features.

Rank counts for what they prove: 1 (the trivial group, where reductions are copies), 3 (shards
of uneven real sizes, a count that divides nothing; more ranks than elements), 2 with the
kernel a user gets (Numba where it imports: its twins are bitwise the NumPy ones,
tests/test_rule_kernels.py; here they run inside the engine), also bitwise against one process
running the engine (the oracle of a rule without a float64 reference). 4 ranks: hierarchical
groups of 2 (tests/test_hierarchical.py, tests/test_stage2.py, tests/test_offload.py).
"""

import importlib.util

import pytest

from mpirun import SIBLING, run_mpi


ALL = ("rules", "layouts", "training")


@pytest.mark.parametrize("n, kernel, sub_cases", [
    SIBLING(1, "numpy", ALL), (2, "auto", ALL + ("engine-oracle",)), (3, "numpy", ALL)])
def test_n_ranks_equal_one_process(n, kernel, sub_cases):
    out = run_mpi(n, "parity.py", *sub_cases, timeout=300,
                  env={"ZERO1_MPI_KERNEL": kernel}).stdout
    ran = kernel
    if kernel == "auto":  # Numba where it imports: say which one ran
        ran = "numba" if importlib.util.find_spec("numba") else "numpy"
    assert f"on {n} ranks (numpy, kernel {ran})" in out, out
    said = {"rules": "rule cases (", "layouts": "layouts", "training": "training cases",
            "engine-oracle": "rule cases against one engine"}
    for sub_case in sub_cases:
        assert said[sub_case] in out, out
