"""zero1_mpi.torch: a torch.optim.Optimizer over the flat buffers (skipped without torch).

The multi-rank case (tests/cases/torch_adapter.py) checks parity with torch.optim.AdamW under
two LR schedulers in three dtypes, overlap and no_sync(), and misuse raised on every rank; the
tests here check the arguments that are refused before any collective.
"""

import subprocess
import sys

import pytest

from mpirun import ROOT, run_mpi

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

torch = pytest.importorskip("torch")
from mpi4py import MPI

from zero1_mpi.torch import ZeroOptimizer, as_array, as_tensor


@pytest.mark.parametrize("n", [3])
def test_adapter_matches_torch_adamw_with_schedulers_on_n_ranks(n, tmp_path):
    out = run_mpi(n, "torch_adapter.py", str(tmp_path / "ckpt"), timeout=300).stdout
    assert f"OK torch adapter: 4 parity runs x 12 steps on {n} ranks" in out, out


def test_importing_the_package_does_not_import_torch():
    code = "import sys, zero1_mpi; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def model():
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def test_parameters_and_grads_become_views_of_the_flat_buffers():
    m = model()
    values = [p.detach().clone() for p in m.parameters()]
    opt = ZeroOptimizer(m, "sgd", MPI.COMM_SELF, lr=0.1, param_dtype="bfloat16")
    flat_p, flat_g = opt.sharded.params, opt.sharded.grads
    for (name, p), value in zip(m.named_parameters(), values):
        assert p.dtype == torch.bfloat16  # param_dtype moved the model to it
        assert torch.equal(p.detach(), value.to(torch.bfloat16))
        assert as_array(p).ctypes.data == flat_p[name].ctypes.data
        assert as_array(p.grad).ctypes.data == flat_g[name].ctypes.data
    assert as_tensor(flat_p["0.weight"]).data_ptr() == m[0].weight.data_ptr()
    assert [g["lr"] for g in opt.param_groups] == [0.1]
    assert opt.param_groups[0]["params"] == list(m.parameters())


@pytest.mark.parametrize("params, kwargs, error, text", [
    (lambda m: m, {"overlap": True, "module": None}, None, None),
    (lambda m: list(m.parameters()), {}, TypeError, "without its name"),
    (lambda m: [{"params": list(m.parameters())}], {}, TypeError, "module=model"),
    (lambda m: m.named_parameters(), {"overlap": True}, ValueError,
     "overlap=True needs the module"),
    (lambda m: [("a", m[0].weight), ("b", m[0].weight)], {}, ValueError, "tied parameter"),
    (lambda m: {"w": m[0].weight * 2}, {}, TypeError, "leaf tensor"),
    (lambda m: m[0].weight, {}, TypeError, "single tensor"),
    (lambda m: dict(m.named_parameters()), {"rule": "adamx"}, ValueError, "unknown update"),
    (lambda m: dict(m.named_parameters()), {"rule": 3}, TypeError, "optimizer class"),
])
def test_bad_arguments_are_refused_with_the_fix(params, kwargs, error, text):
    m = model()
    kwargs = {"rule": "adamw", **kwargs}
    if error is None:  # the module itself: overlap works without module=
        ZeroOptimizer(params(m), comm=MPI.COMM_SELF, **kwargs).unbind()
        return
    with pytest.raises(error, match=text):
        ZeroOptimizer(params(m), comm=MPI.COMM_SELF, **kwargs)


def test_a_frozen_parameter_is_left_out_of_a_module_and_refused_by_name():
    m = model()
    m[0].bias.requires_grad_(False)
    opt = ZeroOptimizer(m, "adamw", MPI.COMM_SELF)
    assert "0.bias" not in opt.sharded.params and len(opt.sharded.params) == 3
    opt.unbind()
    with pytest.raises(ValueError, match="'0.bias' does not require grad"):
        ZeroOptimizer(dict(m.named_parameters()), "adamw", MPI.COMM_SELF)


def test_zero_grad_keeps_the_views_and_step_returns_step_info():
    m = model()
    opt = ZeroOptimizer(m, "adam", MPI.COMM_SELF, lr=0.1, max_grad_norm=1e-3)
    m(torch.ones(4, 3)).sum().backward()
    grads = [p.grad for p in m.parameters()]
    opt.zero_grad()  # torch's default set_to_none=True cannot apply: the buffer is the storage
    assert all(p.grad is g and not g.any() for p, g in zip(m.parameters(), grads))
    m(torch.ones(4, 3)).sum().backward()
    info = opt.step()
    assert info is opt.last_step and info.step == 1 and info.clip_coef < 1.0
    assert opt.step(closure=lambda: 7.0) == 7.0 and opt.step_count == 2
