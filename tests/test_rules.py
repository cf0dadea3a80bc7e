"""The rules beside Adam: ZeroSGD (torch.optim.SGD) and ZeroLion on shards. Parity on 1-4
ranks (tests/cases/parity_rules.py), the kernel twins bitwise equal, the NumPy twins against
torch (SGD) or the float64 reference (Lion), and bad options."""

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import run_mpi
from reference import ReferenceLion, max_rel_err
from zero1_mpi import ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.rules.lion import Lion, NumpyLion
from zero1_mpi.rules.sgd import SGD, NumpySGD

OPTIONS = [{"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": False},
           {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True},
           {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.01, "nesterov": False}]


@pytest.mark.parametrize("rule, cases", [("sgd", 18), ("lion", 12), ("lamb", 12)])
@pytest.mark.parametrize("n, kernel", [(n, "numpy") for n in (1, 2, 3, 4)] + [(2, "auto")])
def test_parity_with_single_process_reference(tmp_path, rule, cases, n, kernel):
    out = run_mpi(n, "parity_rules.py", rule, str(tmp_path), timeout=300,
                  env={"ZERO1_MPI_KERNEL": kernel}).stdout
    assert f"OK {rule} parity: {cases} cases x 12 steps on {n} ranks" in out


def run_kernel(kernel, options, param_dtype, steps=5, n=10_007):
    dtype = resolve_dtype(param_dtype)
    master = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    buf = np.zeros(n, np.float32)
    param = master.astype(dtype) if dtype != np.float32 else None
    states = (buf,) if kernel.has_buffer else ()
    for step in range(1, steps + 1):
        grad = np.random.default_rng(step).standard_normal(n).astype(dtype)
        kernel(grad, master, *states, param, SGD.scalars(step, {"lr": 0.1, **options}, 0.5))
    return master, buf, param


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("param_dtype", ["float32", "float16", "bfloat16"])
def test_numba_kernel_is_bitwise_the_numpy_twin(options, param_dtype):
    numba_kernels = pytest.importorskip("zero1_mpi.kernels_numba", exc_type=ImportError)
    has_buffer = options["momentum"] != 0
    a = run_kernel(NumpySGD(has_buffer, chunk=1000), options, param_dtype)
    b = run_kernel(numba_kernels.NumbaSGD(has_buffer), options, param_dtype)
    for x, y in zip(a, b):
        if x is not None:
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_twin_matches_torch_sgd(options):
    torch = pytest.importorskip("torch")
    master, _, _ = run_kernel(NumpySGD(options["momentum"] != 0), options, "float32")
    p = torch.nn.Parameter(torch.tensor(np.random.default_rng(0).standard_normal(10_007)
                                        .astype(np.float32), dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1, **options)
    for step in range(1, 6):
        grad = np.random.default_rng(step).standard_normal(10_007).astype(np.float32)
        p.grad = torch.tensor(grad.astype(np.float64) * 0.5)
        opt.step()
    want = p.detach().numpy()
    assert np.abs(master - want).max() / np.abs(want).max() <= 1e-6


@pytest.mark.parametrize("options, words", [
    ({"momentum": -0.5}, "momentum=-0.5 must be >= 0"),
    ({"nesterov": True}, "nesterov=True needs momentum > 0"),
    ({"momentum": 0.9, "dampening": 0.1, "nesterov": True}, "dampening=0.1"),
    ({"lr": -1.0}, "lr=-1.0 must be >= 0"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ({"nesterov": "yes"}, "nesterov='yes'"),
])
def test_bad_options_name_the_value(options, words):
    with pytest.raises(ValueError, match=None) as info:
        ZeroSGD({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, **options)
    assert words in str(info.value)


def test_momentum_needs_a_buffer_chosen_at_construction():
    opt = ZeroSGD({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, lr=0.1)
    assert opt.rule.state_names == () and not opt._state  # no momentum buffer allocated
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="needs a momentum buffer"):
        opt.step()
    with_buffer = ZeroSGD([{"params": {"w": np.ones(4, np.float32)}, "momentum": 0.9}],
                          MPI.COMM_SELF)
    assert with_buffer.rule.state_names == ("momentum_buffer",)


def run_lion(kernel, param_dtype, steps=5, n=10_007):
    dtype = resolve_dtype(param_dtype)
    master = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    exp_avg = np.zeros(n, np.float32)
    param = master.astype(dtype) if dtype != np.float32 else None
    options = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    for step in range(1, steps + 1):
        grad = np.random.default_rng(step).standard_normal(n).astype(dtype)
        kernel(grad, master, exp_avg, param, Lion.scalars(step, options, 0.5))
    return master, exp_avg, param


@pytest.mark.parametrize("param_dtype", ["float32", "float16", "bfloat16"])
def test_numba_lion_is_bitwise_the_numpy_twin(param_dtype):
    numba_kernels = pytest.importorskip("zero1_mpi.kernels_numba", exc_type=ImportError)
    a = run_lion(NumpyLion(chunk=1000), param_dtype)
    b = run_lion(numba_kernels.NumbaLion(), param_dtype)
    for x, y in zip(a, b):
        if x is not None:
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_numpy_lion_matches_the_float64_reference():
    master, exp_avg, _ = run_lion(NumpyLion(), "float32")
    ref = ReferenceLion({"p": np.random.default_rng(0).standard_normal(10_007)
                        .astype(np.float32)}, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(1, 6):
        ref.step({"p": np.random.default_rng(step).standard_normal(10_007)
                  .astype(np.float32).astype(np.float64) * 0.5})
    assert max_rel_err(master, ref.params["p"]) <= 1e-6
    assert max_rel_err(exp_avg, ref.m["p"]) <= 1e-6


@pytest.mark.parametrize("options, words", [
    ({"betas": (0.9, 1.0)}, "betas[1]=1.0 must be in [0, 1)"),
    ({"betas": 0.9}, "betas=0.9 must be a pair"),
    ({"lr": -1e-4}, "lr=-0.0001 must be >= 0"),
    ({"weight_decay": float("nan")}, "weight_decay=nan must be a finite number"),
])
def test_bad_lion_options_name_the_value(options, words):
    with pytest.raises(ValueError) as info:
        ZeroLion({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, **options)
    assert words in str(info.value)
