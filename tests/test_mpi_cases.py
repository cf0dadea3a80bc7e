"""The multi-rank cases under ``tests/cases``, each on 1-4 ranks via mpiexec."""

import importlib.util
import time

import pytest

from mpirun import run_mpi

RANKS = [1, 2, 3, 4]


@pytest.mark.parametrize("n, kernel", [(n, "numpy") for n in RANKS] + [(2, "auto"), (3, "auto")])
def test_parity_with_single_process_adam(n, kernel):
    out = run_mpi(n, "parity.py", timeout=300, env={"ZERO1_MPI_KERNEL": kernel}).stdout
    ran = kernel
    if kernel == "auto":  # Numba where it imports: say which one ran
        ran = "numba" if importlib.util.find_spec("numba") else "numpy"
    assert f"OK parity: 33 cases x 20 steps on {n} ranks (numpy, kernel {ran})" in out


@pytest.mark.parametrize("n", RANKS)
def test_bad_input_raises_on_every_rank(n):
    out = run_mpi(n, "bad_input.py", timeout=120).stdout
    assert f"on {n} ranks" in out and "OK bad input" in out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("with_mpi4py_runner", [True, False])
def test_rank_failing_inside_step_aborts_the_job(n, with_mpi4py_runner):
    """Also without ``python -m mpi4py``: step() aborts the job instead of leaving the
    other ranks waiting in the all-gather."""
    start = time.monotonic()
    result = run_mpi(n, "step_failure.py", timeout=120, check=False,
                     abort_on_exception=with_mpi4py_runner)
    assert result.returncode != 0
    assert "injected failure in the Adam kernel" in result.stderr
    assert "UNREACHABLE" not in result.stdout
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("n, kernel", [(n, "numpy") for n in RANKS] + [(2, "numba")])
def test_communicator_collectives_direct_and_staged(n, kernel):
    """Also: a step in steady state allocates only a few KB (tracemalloc)."""
    if kernel == "numba":
        pytest.importorskip("numba")
    out = run_mpi(n, "comm.py", timeout=120, env={"ZERO1_MPI_KERNEL": kernel}).stdout
    assert f"OK comm on {n} ranks" in out


@pytest.mark.parametrize("n", RANKS)
def test_groups_schedule_clipping_scaling_accumulation(n):
    assert f"OK training: 14 cases x 20 steps on {n} ranks" in run_mpi(n, "training.py").stdout


@pytest.mark.parametrize("n", RANKS)
def test_overflow_and_bad_options_are_agreed_by_all_ranks(n):
    assert f"OK overflow on {n} ranks" in run_mpi(n, "overflow.py", timeout=120).stdout


@pytest.mark.parametrize("n", RANKS)
def test_overlapped_communication_gives_the_same_bits(n):
    assert f"OK overlap on {n} ranks" in run_mpi(n, "overlap.py", timeout=120).stdout
