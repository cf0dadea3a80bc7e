"""The rules beside Adam: ZeroSGD (torch.optim.SGD) and ZeroLion on shards. Parity on 1-4
ranks (tests/cases/parity_rules.py), the kernel twins bitwise equal, the NumPy twins against
torch (SGD) or the float64 reference (Lion), ReferenceSGD against torch.optim.SGD, bad options
on every rank (tests/cases/bad_input_rules.py), and checkpoints saved on N ranks loaded on M
(tests/cases/checkpoint_rules.py)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import run_mpi
from reference import ReferenceLion, ReferenceSGD, max_rel_err
from zero1_mpi import ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.rules.lion import Lion, NumbaLion, NumpyLion
from zero1_mpi.rules.sgd import SGD, NumbaSGD, NumpySGD

RULES = ["sgd", "lion", "lamb"]  # the rules of the bad-input and checkpoint cases
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
    pytest.importorskip("numba")
    has_buffer = options["momentum"] != 0
    a = run_kernel(NumpySGD(has_buffer, chunk=1000), options, param_dtype)
    b = run_kernel(NumbaSGD(has_buffer), options, param_dtype)
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
    assert opt.rule.state_names == () and not opt.state.state  # no momentum buffer allocated
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
    pytest.importorskip("numba")
    a = run_lion(NumpyLion(chunk=1000), param_dtype)
    b = run_lion(NumbaLion(), param_dtype)
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


@pytest.mark.parametrize("n", [2, 3])
def test_bad_rule_options_raise_on_every_rank(n):
    """At construction, set in param_groups between steps, and differing between ranks."""
    out = run_mpi(n, "bad_input_rules.py", *RULES, timeout=120).stdout
    assert f"OK bad rule options: {'+'.join(RULES)}, " in out and f"on {n} ranks" in out


def test_rule_checkpoints_saved_on_n_ranks_load_on_m(tmp_path):
    """Saved on 1, 3, 4 ranks, loaded on 1, 2, 4: 3->2, 1->4, 4->1, ... and same-N bitwise."""
    saved, loaded = [1, 3, 4], [1, 2, 4]
    for n in saved:
        run_mpi(n, "checkpoint_rules.py", "save", str(tmp_path / f"N{n}"), *RULES)
    for m in loaded:
        out = run_mpi(m, "checkpoint_rules.py", "load", str(tmp_path), *RULES,
                      timeout=300).stdout
        loads = len(saved) * len(RULES) * 2 * 2  # x dtypes x (load, load_consolidated)
        assert f"OK rule checkpoints: {'+'.join(RULES)}, {loads} loads on {m} ranks" in out


TORCH_SGD = [  # (defaults, options of group 1, max_grad_norm)
    ({"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
     {"momentum": 0.8, "nesterov": True, "weight_decay": 0.0, "lr": 0.02}, 5.0),
    ({"momentum": 0.0, "weight_decay": 0.05}, {"momentum": 0.9, "dampening": 0.5}, None),
    ({"momentum": 0.7, "nesterov": True, "weight_decay": 0.0},
     {"momentum": 0.0, "weight_decay": 0.1, "lr": 0.2}, 3.0),
]


@pytest.mark.parametrize("defaults, group_1, max_grad_norm", TORCH_SGD)
def test_reference_sgd_is_torch_sgd(defaults, group_1, max_grad_norm):
    """ReferenceSGD (the oracle of tests/cases/parity_rules.py) is torch.optim.SGD with
    clip_grad_norm_, in float64, with two param groups: this ties the multi-rank parity to
    torch."""
    torch = pytest.importorskip("torch")
    shapes, names_1 = {"w": (5, 13), "b": (7,), "s": ()}, ["b", "s"]
    rng = np.random.default_rng(3)
    init = {k: rng.standard_normal(s) for k, s in shapes.items()}
    ref = ReferenceSGD(init, lr=0.1, **defaults, max_grad_norm=max_grad_norm,
                       groups=[{"names": ["w"]}, {"names": names_1, **group_1}])
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64))
              for k, v in init.items()}
    opt = torch.optim.SGD([{"params": [params["w"]]},
                           {"params": [params[k] for k in names_1], **group_1}],
                          lr=0.1, **defaults)
    clipped = 0
    for step in range(1, 9):
        grads = {k: rng.standard_normal(s) * (3.0 if step % 2 else 0.2)
                 for k, s in shapes.items()}
        norm = ref.step(grads)
        for k, p in params.items():
            p.grad = torch.tensor(grads[k], dtype=torch.float64)
        if max_grad_norm is not None:
            total = float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm))
            assert abs(total - norm) <= 1e-12 * norm
            clipped += norm > max_grad_norm
        opt.step()
        for k, p in params.items():
            assert max_rel_err(ref.params[k], p.detach().numpy()) <= 1e-12, (step, k)
            buf = opt.state[p].get("momentum_buffer")
            if buf is None:
                assert k not in ref.buf, (step, k)
            else:
                assert max_rel_err(ref.buf[k], buf.numpy()) <= 1e-12, (step, k)
    assert max_grad_norm is None or 0 < clipped < 8  # clipping both applied and not
