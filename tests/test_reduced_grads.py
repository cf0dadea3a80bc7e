"""``opt.reduced_grads()``: the gradients as the step takes them, on every rank
(tests/cases/reduced_grads.py: against a float64 oracle in six layouts on 4 ranks)."""

from mpirun import run_mpi


def test_reduced_grads_are_the_clipped_mean_on_every_rank():
    out = run_mpi(4, "reduced_grads.py", timeout=180).stdout
    assert "OK reduced_grads on 4 ranks: 6 layouts" in out, out
