"""zero1_mpi.torch: a torch.optim.Optimizer over the flat buffers (skipped without torch).

The multi-rank case (tests/cases/torch_adapter.py) checks parity with torch.optim.AdamW under
two LR schedulers in three dtypes, overlap and no_sync(), and misuse raised on every rank; the
tests here check the arguments that are refused before any collective.
"""

import importlib.util
import os
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


def test_every_way_to_clip_gives_the_global_norm_in_any_import_order():
    """tests/cases/torch_clipping.py: torch's names bound before zero1_mpi.torch is imported,
    the module's own path, the deprecated name, get_total_norm + clip_grads_with_norm_ and
    accelerate's Accelerator.clip_grad_norm_, in stage 1 and 2, against a float64 oracle; and
    reduced_grads() as the clipped mean."""
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if not has_accelerate and os.environ.get("ZERO1_REQUIRE_TRANSFORMERS") == "1":
        pytest.fail("ZERO1_REQUIRE_TRANSFORMERS=1 but accelerate does not import")
    out = run_mpi(3, "torch_clipping.py", timeout=240).stdout
    assert f"OK torch clipping: {5 + has_accelerate} ways x 2 stages on 3 ranks" in out, out


def test_torch_clipping_functions_dispatch_here_through_torch_own_objects():
    """torch's wrappers (what any early-bound name holds) call this binding's functions; a
    wrapper of another shape is not patched but reported."""
    from zero1_mpi.bindings import torch_compat
    for name, wrapper in torch_compat._WRAPPERS.items():
        assert getattr(torch.nn.utils, name) is wrapper  # torch's objects stay in place
        cell = torch_compat._body_cell(name, wrapper)
        assert cell.cell_contents is getattr(torch_compat, name)
    torch_compat.install_clipping()  # idempotent
    assert torch_compat._body_cell("clip_grad_norm_", lambda: None) is None

    def other_wrapper(*args):
        return func(*args)
    func = print
    assert torch_compat._body_cell("clip_grad_norm_", other_wrapper) is None


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


@pytest.mark.parametrize("kwargs", [
    {"foreach": True, "fused": True, "capturable": False, "differentiable": False,
     "amsgrad": False, "maximize": False},
    {"foreach": None, "fused": None, "lr": torch.tensor(0.25)},
])
def test_torch_arguments_that_change_nothing_are_taken(kwargs):
    m = model()
    opt = ZeroOptimizer(m, "adamw", MPI.COMM_SELF, **kwargs)
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert opt.sharded.param_groups[0]["lr"] == (0.25 if "lr" in kwargs else 1e-3)
    assert "foreach" not in opt.param_groups[0] and opt.step_count == 1


@pytest.mark.parametrize("rule, kwargs, error, text", [
    ("adamw", {"amsgrad": True}, ValueError,
     ["ZeroOptimizer(ZeroAdamW): amsgrad=True", "docs/pytorch.md#differences-from-torchoptim"]),
    ("adam", {"maximize": True}, ValueError, "negate the loss"),
    ("sgd", {"differentiable": True}, ValueError, "outside autograd"),
    ("lion", {"momentum": 0.9}, TypeError,
     ["ZeroOptimizer(ZeroLion) got an unexpected argument 'momentum'", "betas",
      "differences-from-torchoptim"]),
    ("adamw", {"lr": torch.tensor([1e-3, 2e-3])}, ValueError, "lr=tensor"),
    ("adamw", {"lr": torch.tensor(True)}, ValueError, "must be a finite number"),
])
def test_other_torch_arguments_are_refused_naming_the_class_and_the_docs(rule, kwargs, error,
                                                                           text):
    with pytest.raises(error) as caught:
        ZeroOptimizer(model(), rule, MPI.COMM_SELF, **kwargs)
    for part in [text] if isinstance(text, str) else text:
        assert part in str(caught.value)


def test_clipping_bound_parameters_goes_through_the_optimizer():
    """torch.nn.utils.clip_grad_norm_ on a ZeroOptimizer's parameters is its clip_grad_norm_
    (here on one rank the norm of the gradient; the step clips to max_norm); on a part of them,
    or with value clipping, an error that names what to call; other tensors are torch's."""
    m, ref = model(), model()
    ref.load_state_dict(m.state_dict())
    opt = ZeroOptimizer(m, "sgd", MPI.COMM_SELF, lr=1.0)
    m(torch.ones(2, 3)).sum().backward()
    ref(torch.ones(2, 3)).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # torch's own
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
    assert norm.dtype == torch.float32 and torch.allclose(norm, expected)
    with pytest.raises(ValueError, match="pass all of them"):
        torch.nn.utils.clip_grad_norm_(list(m.parameters())[:2], 0.5)
    with pytest.raises(ValueError, match="pass all of them"):
        torch.nn.utils.clip_grad_norm_([*m.parameters(), *ref.parameters()], 0.5)
    with pytest.raises(ValueError, match="clip_grad_value_ on a ZeroOptimizer"):
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.1)
    # accelerate's way: get_total_norm of the gradients, then clip_grads_with_norm_
    grads = [p.grad for p in m.parameters()]
    with pytest.raises(ValueError, match="get_total_norm was given 5 tensors, 4 of them"):
        torch.nn.utils.get_total_norm([*grads, torch.ones(2)])
    total = torch.nn.utils.get_total_norm(grads)
    assert torch.allclose(total, expected)
    torch.nn.utils.clip_grads_with_norm_(list(m.parameters()), 0.5, total)  # by the step
    assert torch.equal(torch.nn.utils.get_total_norm([torch.ones(4)]), torch.tensor(2.0))
    info = opt.step()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad  # SGD with lr 1 on the gradient clip_grad_norm_ scaled
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert info.clip_coef < 1.0 and abs(info.grad_norm - expected.item()) < 1e-5 * info.grad_norm


def test_clip_grad_norm_refuses_other_norms_and_late_gradients_on_every_rank():
    m = model()
    opt = ZeroOptimizer(m, "adamw", MPI.COMM_SELF, overlap=True)
    m(torch.ones(2, 3)).sum().backward()
    with pytest.raises(ValueError, match="only the L2 norm"):
        opt.clip_grad_norm_(1.0, norm_type="inf")
    m(torch.ones(2, 3)).sum().backward()
    assert opt.clip_grad_norm_(1.0) > 0
    m(torch.ones(2, 3)).sum().backward()  # after the reduction: the step refuses it
    with pytest.raises(ValueError, match="came after clip_grad_norm_"):
        opt.step()
    assert opt.step_count == 0
    m(torch.ones(2, 3)).sum().backward()
    opt.clip_grad_norm_(1.0)
    assert opt.step().step == 1  # a step after the error goes as usual
    m(torch.ones(2, 3)).sum().backward()
    with pytest.raises(ValueError, match="max_norm=-1.0 must be > 0"):
        opt.clip_grad_norm_(-1.0)
    with torch.no_grad():
        m[0].bias.grad[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_save_records_param_groups_as_they_are_and_load_restores_them(tmp_path):
    m = model()
    opt = ZeroOptimizer(m, "adamw", MPI.COMM_SELF, lr=torch.tensor(0.5))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    sched.step()  # lr 0.25 for the next step: what the checkpoint must hold
    opt.param_groups[0]["note"] = ("warm", 3)
    opt.save(tmp_path / "c")
    opt.param_groups[0]["bad"] = object()
    m(torch.ones(2, 3)).sum().backward()
    opt.step()  # a step leaves out what a checkpoint cannot hold; a save refuses it
    with pytest.raises(ValueError, match="'bad'=<object"):
        opt.save(tmp_path / "d")
    assert not (tmp_path / "d").exists()
    opt.close()
    m2 = model()
    opt2 = ZeroOptimizer(m2, "adamw", MPI.COMM_SELF, lr=torch.tensor(9.0))
    assert opt2.param_groups[0]["lr"] == 9.0  # taken as a number
    lr = opt2.param_groups[0]["lr"] = torch.tensor(9.0)  # as a scheduler may keep it
    opt2.load(tmp_path / "c")
    group = opt2.param_groups[0]
    assert group["lr"] is lr and lr.item() == 0.25  # a tensor lr is filled in place
    assert group["initial_lr"] == 0.5 and group["note"] == ["warm", 3]
