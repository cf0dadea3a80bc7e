"""zero1_mpi.torch resumed as torch users write it (tests/cases/torch_resume.py; skipped
without torch): with torch's LambdaLR and, where installed, a transformers schedule, every
order of loading the optimizer and the scheduler continues bit for bit, the checkpoint of a
signal too; a one-rank checkpoint resumes on two ranks at the scheduler's learning rate."""

import importlib.util

import pytest

from mpirun import run_mpi

torch = pytest.importorskip("torch")


def test_every_resume_order_continues_bit_for_bit(tmp_path):
    out = run_mpi(2, "torch_resume.py", "orders", str(tmp_path), timeout=300).stdout
    schedules = 2 if importlib.util.find_spec("transformers") else 1
    assert f"OK torch resume: {schedules} schedules x 5 orders bit for bit on 2 ranks" in out, out


@pytest.mark.mpi_independent  # (conftest.py): the save and load paths run under every MPI above
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    run_mpi(1, "torch_resume.py", "save", str(tmp_path), timeout=120)
    out = run_mpi(2, "torch_resume.py", "load", str(tmp_path), timeout=120).stdout
    assert "OK torch resume 1 -> 2 ranks: lr exact" in out, out
