"""Stage 3 through the PyTorch binding: ``ZeroOptimizer(model, shard_params=True)`` (skipped
without torch).

tests/cases/torch_stage3.py holds an unchanged training loop of a model with tied weights to
stage 2 bit for bit and to ``torch.optim.AdamW`` on the mean gradient, checks that freed
parameters hold no memory, the prefetch, ``state_dict()``, checkpoints into stage 2 and
``unbind()``. Here, in one process: the units found in a module tree, and misuse.
"""

import pytest

from mpirun import run_mpi

torch = pytest.importorskip("torch")
from mpi4py import MPI  # noqa: E402

from zero1_mpi.bindings.torch_units import ROOT, module_units  # noqa: E402
from zero1_mpi.torch import ZeroOptimizer  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 4])
def test_an_unchanged_loop_trains_with_stage3_on_n_ranks(n, tmp_path):
    out = run_mpi(n, "torch_stage3.py", str(tmp_path), timeout=300).stdout
    assert f"OK torch stage 3 on {n} ranks" in out, out


def tied():
    m = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4),
                            torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 5)))
    m[2][1].weight = torch.nn.Parameter(torch.randn(5, 4))
    m[0].weight = m[2][1].weight  # tied: both modules hold it
    return m


@pytest.mark.mpi_independent
def test_units_are_the_modules_owning_parameters_and_shared_ones_go_to_the_root():
    m = tied()
    named = dict(m.named_parameters())
    units, users = module_units(m, named)
    assert units == {ROOT: ["0.weight"], "1": ["1.weight", "1.bias"],
                     "2.0": ["2.0.weight", "2.0.bias"], "2.1": ["2.1.bias"]}
    assert users[m] == [ROOT] and users[m[1]] == ["1"] and users[m[2][1]] == ["2.1"]
    units, users = module_units(m, named, [m[1], m[2]])
    assert units == {ROOT: ["0.weight"], "1": ["1.weight", "1.bias"],
                     "2": ["2.0.weight", "2.0.bias", "2.1.bias"]}
    with pytest.raises(ValueError, match="units: Linear is not a submodule of the model"):
        module_units(m, named, [torch.nn.Linear(2, 2)])


@pytest.mark.mpi_independent
def test_stage3_needs_the_module_and_refuses_overlap():
    m = tied()
    with pytest.raises(ValueError, match="shard_params=True needs the module"):
        ZeroOptimizer(list(m.named_parameters()), "adamw", MPI.COMM_SELF, shard_params=True)
    with pytest.raises(ValueError, match="without overlap"):
        ZeroOptimizer(m, "adamw", MPI.COMM_SELF, shard_params=True, overlap=True)


@pytest.mark.mpi_independent
def test_reshard_after_forward_is_stage3s_and_a_flag():
    with pytest.raises(ValueError, match="reshard_after_forward=False is stage 3's: pass "
                                         "shard_params=True too"):
        ZeroOptimizer(tied(), "adamw", MPI.COMM_SELF, reshard_after_forward=False)
    with pytest.raises(ValueError, match="reshard_after_forward=2 must be True"):
        ZeroOptimizer(tied(), "adamw", MPI.COMM_SELF, shard_params=True,
                      reshard_after_forward=2)
