"""The example of docs/update-rules.md, "Adding an update rule", is complete: run as written on
1 and 2 ranks against one process (tests/cases/readme_rule.py)."""

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi_independent  # (conftest.py)


@pytest.mark.parametrize("n", [1, 2])
def test_readme_rule_trains_like_one_process_and_checkpoints(tmp_path, n):
    out = run_mpi(n, "readme_rule.py", str(tmp_path), timeout=180).stdout
    assert f"OK the docs' rule on {n} ranks" in out
