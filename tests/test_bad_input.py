"""What is wrong on one rank is raised on every rank and changes nothing (tests/cases/
bad_input.py): bad parameters, engine options and settings at construction; every rule's bad
or differing group options at construction and between steps; inf/nan gradients (skipped
with the loss scale backed off, or an error) and fp16 sums that overflow in MPI. On 1 rank
(where nothing can differ between ranks) and on 3 (the last rank differs; some ranks never
touch what is wrong there)."""

import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("n", [1, 3])
def test_bad_input_raises_on_every_rank(n):
    out = run_mpi(n, "bad_input.py", timeout=180).stdout
    assert f"OK bad input on {n} ranks: " in out, out
    for what in ("construction", "options", "overflow"):
        assert what in out, out


def test_every_declared_option_is_tested_from_its_declaration():
    """tests/cases/declared_options.py on 4 ranks: each option's bad values refused on every
    rank naming it, its edge values taken alike, a value needing others refused alone, and a
    value on one rank only refused by the agreement (taken, for a rank's own option)."""
    from zero1_mpi.config.options import OPTIONS
    out = run_mpi(4, "declared_options.py", timeout=300).stdout
    assert f"OK declared options on 4 ranks: {len(OPTIONS)} options, " in out, out
