"""The multi-rank cases under ``tests/cases``, each on 1-4 ranks via mpiexec."""

import time

import pytest

from mpirun import run_mpi

RANKS = [1, 2, 3, 4]


@pytest.mark.parametrize("n", RANKS)
def test_parity_with_single_process_adam(n):
    out = run_mpi(n, "parity.py", timeout=300).stdout
    assert f"OK parity: 30 cases x 20 steps on {n} ranks (numpy)" in out


@pytest.mark.parametrize("n", RANKS)
def test_bad_input_raises_on_every_rank(n):
    out = run_mpi(n, "bad_input.py", timeout=120).stdout
    assert f"on {n} ranks" in out and "OK bad input" in out


@pytest.mark.parametrize("n", [2, 4])
def test_rank_failing_inside_step_aborts_the_job(n):
    start = time.monotonic()
    result = run_mpi(n, "step_failure.py", timeout=60, check=False)
    assert result.returncode != 0
    assert "injected failure in the Adam kernel" in result.stderr
    assert "UNREACHABLE" not in result.stdout
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("n", RANKS)
def test_communicator_collectives_direct_and_staged(n):
    assert f"OK comm on {n} ranks" in run_mpi(n, "comm.py", timeout=120).stdout
