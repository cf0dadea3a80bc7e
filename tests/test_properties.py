"""Property-based tests over the edges (tests/cases/properties.py, Hypothesis): drawn shapes
at the code's threshold constants, rules, dtypes, shard groups, state encodings and sums,
against the float64 references and, bit for bit, against the other ways of running the same
case (fp32 masters, stage 1, no offload). A bounded number of cases with a fixed seed here;
``tools/properties.py`` draws more."""

import pytest
from mpirun import run_mpi

pytest.importorskip("hypothesis")
#: The properties compare runs on one MPI with each other and with float64: CI's first pass.
pytestmark = pytest.mark.mpi_independent


@pytest.mark.parametrize("n", [1, 4])
def test_properties_hold_over_the_edges(n):
    """1 rank: groups of one (the 8-bit sums on a group of one rank); 4: groups of 4 and 2."""
    out = run_mpi(n, "properties.py", "--examples", "12", timeout=300).stdout
    assert f"OK properties on {n} ranks: 12 cases" in out, out
