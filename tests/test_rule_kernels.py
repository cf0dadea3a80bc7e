"""The kernels of every rule of the registry (``zero1_mpi.rules.registry``), in one process:
each variant's Numba twin gives its NumPy twin's bits (every parameter and gradient dtype,
several chunks and a remainder, one- or two-phase); the NumPy twin follows the rule's float64
reference (tests/reference.py); its chunk size changes no bit (an elementwise rule) or only the
rounding of the tensor sums (a two-phase one); zero gradients keep zero padding at zero; a step
allocates no memory per element (a twin that keeps scratch). Then what is one rule's own:
Adam's host scalars are torch's, LAMB's trust ratio where a norm is zero; and the Numba
helpers (16-bit rounding, the sums) and how the CPU kernel is chosen. Only the Numba tests
skip where Numba is missing. The multi-rank parity of every rule is tests/test_parity.py's.
"""

import sys
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from casekit import REFERENCES, rule_cases, run_twin, variant_cases
from reference import max_rel_err, max_ulp_diff
from zero1_mpi import ZeroLAMB
from zero1_mpi.kernels.backend import PARAM_DTYPES, resolve_dtype
from zero1_mpi.kernels.local_sums import NUMPY_CHUNK, NumbaReductions, NumpyReductions
from zero1_mpi.rules.adam import AdamScalars
from zero1_mpi.rules.lamb import Lamb
from zero1_mpi.rules.registry import builtin_rules

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

#: (rule name, index): one per option set of every variant (casekit.rule_cases).
CASES = [(name, index) for name, entry in builtin_rules().items()
         for index in range(len(rule_cases(entry)))]
#: (rule name, index): one per variant (casekit.variant_cases).
VARIANTS = [(name, index) for name, entry in builtin_rules().items()
            for index in range(len(variant_cases(entry)))]


def case(name, index, cases=rule_cases):
    return cases(builtin_rules()[name])[index]


@pytest.mark.parametrize("param_dtype", list(PARAM_DTYPES))
@pytest.mark.parametrize("name, index", VARIANTS)
def test_numba_twin_is_bitwise_the_numpy_twin(name, index, param_dtype):
    pytest.importorskip("numba")
    rule, options = case(name, index, variant_cases)
    n = 70_001  # chunks of every twin, and a remainder
    dtype = PARAM_DTYPES[param_dtype]
    for grad_dtype in PARAM_DTYPES.values():  # the engine gives the param dtype or fp32
        ours = run_twin(rule.kernel("numpy", n), rule, options, dtype, grad_dtype, n)
        theirs = run_twin(rule.kernel("numba", n), rule, options, dtype, grad_dtype, n)
        assert not np.array_equal(ours[0], np.random.default_rng(0).standard_normal(n)
                                  .astype(np.float32))  # the update moved the parameters
        for a, b in zip(ours, theirs, strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, grad_dtype)


#: The reference's attribute holding each state array.
REFERENCE_STATE = {"exp_avg": "m", "exp_avg_sq": "v", "momentum_buffer": "buf"}


#: fp32 for every rule; Adam's 16-bit parameters too (the rounded master each step: a sign
#: rule's update flips where fp32 and float64 round its argument apart, so the multi-rank
#: parity's per-tensor bound holds the others' 16-bit parameters).
REFERENCE_CASES = [(name, index, "float32") for name, index in CASES] + \
    [(name, index, dtype) for name, index in CASES if name == "adam"
     for dtype in ("float16", "bfloat16")]


@pytest.mark.parametrize("name, index, param_dtype", REFERENCE_CASES)
def test_numpy_twin_follows_the_float64_reference(name, index, param_dtype):
    """One whole tensor, 8 steps, gradients scaled by 1/2 (as the engine's mean): the master
    and the state arrays within fp32 rounding, 16-bit parameters within one unit in the last
    place of the reference rounded."""
    rule, options = case(name, index)
    if name not in REFERENCES:
        pytest.skip(f"tests/reference.py has no float64 {name}")
    n, steps, dtype = 10_007, 8, PARAM_DTYPES[param_dtype]
    got = run_twin(rule.kernel("numpy", n), rule, options, dtype, dtype, n, steps=steps)
    init = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    ref = REFERENCES[name](rule, params={"p": init}, **options)
    for step in range(1, steps + 1):
        grad = np.random.default_rng(step).standard_normal(n).astype(dtype)
        ref.step({"p": np.asarray(grad, np.float64) * 0.5})
    assert max_rel_err(got[0], ref.params["p"]) <= 1e-6
    for state, array in zip(rule.state_names, got[1:]):
        want = getattr(ref, REFERENCE_STATE[state]).get("p", np.zeros(n))
        assert max_rel_err(array, want) <= 1e-6, state
    if dtype != np.float32:
        assert max_ulp_diff(got[-1], ref.params["p"].astype(np.float32).astype(dtype)) <= 1


@pytest.mark.parametrize("name, index", VARIANTS)
def test_the_chunk_size_changes_no_bit(name, index):
    """Bitwise for an elementwise rule; a two-phase rule's tensor sums add the chunks' partial
    sums, so there only within fp32 rounding."""
    rule, options = case(name, index, variant_cases)
    n, dtype = 1000, PARAM_DTYPES["bfloat16"]
    runs = [run_twin(rule.kernel("numpy", chunk), rule, options, dtype, dtype, n, steps=6)
            for chunk in (7, 64, 1 << 16)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            if not rule.tensor_sums:
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
            elif a.dtype == np.float32:
                assert max_rel_err(a, b) <= 1e-5
            else:
                assert max_ulp_diff(a, b) <= 1


@pytest.mark.parametrize("name, index", CASES)
def test_zero_gradients_keep_the_padding_at_zero(name, index):
    """The padding at a bucket's end: zero parameters, zero gradients, zero state, whatever
    the options (weight decay included)."""
    rule, options = case(name, index)
    kernel = rule.kernel("numpy", 128)
    master, param = np.zeros(128, np.float32), np.zeros(128, np.float16)
    states = [np.zeros(128, np.float32) for _ in rule.state_names]
    for step in range(1, 4):
        s = rule.scalars(step, options, 1.0)
        if rule.tensor_sums:
            sums = kernel.tensor_sums(np.zeros(128, np.float16), master, *states, s)
            kernel.apply(master, *states, param, rule.tensor_scalars(s, sums))
        else:
            kernel(np.zeros(128, np.float16), master, *states, param, s)
    assert not (master.any() or param.any() or any(s.any() for s in states))


@pytest.mark.parametrize("param_dtype, limit", [("float32", 4096), ("float16", 65536),
                                                ("bfloat16", 65536)])
@pytest.mark.parametrize("name, index", VARIANTS)
def test_a_step_allocates_no_memory_per_element(name, index, param_dtype, limit):
    """Scratch is allocated once, with the kernel (what ``scratch_bytes`` reports); 16-bit
    casts only use NumPy's fixed-size cast buffers. (A twin reporting no scratch allocates per
    call, as the docs' example rule says of itself.)"""
    rule, options = case(name, index, variant_cases)
    dtype, n = PARAM_DTYPES[param_dtype], 1 << 20
    kernel = rule.kernel("numpy", n)
    if not kernel.scratch_bytes:
        pytest.skip(f"{name}'s NumPy twin reports no scratch: it allocates per call")
    master, grad = np.ones(n, np.float32), np.ones(n, dtype)
    states = [np.zeros(n, np.float32) for _ in rule.state_names]
    param = None if dtype == np.float32 else np.ones(n, dtype)
    s = rule.scalars(1, options, 1.0)

    def step():
        if rule.tensor_sums:
            sums = kernel.tensor_sums(grad, master, *states, s)
            kernel.apply(master, *states, param, rule.tensor_scalars(s, sums))
        else:
            kernel(grad, master, *states, param, s)
    step()
    tracemalloc.start()
    step()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < limit, f"a step over {n} elements allocated {peak} bytes"


# -- what is one rule's own ------------------------------------------------------------------

def test_adam_step_scalars_follow_torch():
    s = AdamScalars.for_step(3, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5,
                             decoupled=True, grad_scale=0.25)
    assert s.step_size == pytest.approx(0.1 / (1 - 0.8 ** 3))
    assert s.bc2_sqrt == pytest.approx((1 - 0.9 ** 3) ** 0.5)
    assert (s.decay, s.l2, s.grad_scale) == (pytest.approx(1 - 0.1 * 0.5), 0.0, 0.25)
    adam = AdamScalars.for_step(1, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5,
                                decoupled=False)
    assert (adam.decay, adam.l2) == (1.0, 0.5)


LAMB_OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}


def test_lamb_trust_ratio_is_one_where_a_norm_is_zero():
    s = Lamb.scalars(1, LAMB_OPTIONS, 1.0)
    assert Lamb.tensor_scalars(s, [0.0, 4.0]).neg_step == -LAMB_OPTIONS["lr"]
    assert Lamb.tensor_scalars(s, [9.0, 0.0]).neg_step == -LAMB_OPTIONS["lr"]
    assert Lamb.tensor_scalars(s, [9.0, 4.0]).neg_step == pytest.approx(-LAMB_OPTIONS["lr"] * 1.5)


def test_lamb_moves_zero_parameters_by_lr_times_the_direction():
    """||p|| = 0 gives ratio 1: the first step moves each element by lr * g / (|g| + eps)."""
    opt = ZeroLAMB({"w": np.zeros(8, np.float32)}, MPI.COMM_SELF, lr=0.1, weight_decay=0.0)
    opt.grads["w"][...] = np.arange(1, 9, dtype=np.float32)
    opt.step()
    np.testing.assert_allclose(opt.params["w"], -0.1 * np.ones(8), rtol=1e-5)


def test_lamb_pieces_longer_than_a_chunk_follow_the_reference():
    """A tensor longer than NUMPY_CHUNK: its sums add the chunks' partial sums."""
    rule = builtin_rules()["lamb"].variants[0]
    n = NUMPY_CHUNK + 1_000
    got = run_twin(rule.kernel("numpy", n), rule, rule.check_options(**LAMB_OPTIONS),
                   np.float32, np.float32, n, steps=4)
    ref = REFERENCES["lamb"](rule, params={"p": np.random.default_rng(0).standard_normal(n)
                                           .astype(np.float32)}, **LAMB_OPTIONS)
    for step in range(1, 5):
        ref.step({"p": np.random.default_rng(step).standard_normal(n).astype(np.float32)
                  .astype(np.float64) * 0.5})
    assert max_rel_err(got[0], ref.params["p"]) <= 1e-6


# -- the Numba helpers and the choice of kernel ------------------------------------------------

@pytest.fixture
def numba_kernels():
    """``zero1_mpi.kernels.numba_shared`` with its helpers compiled (skips where Numba is missing)."""
    pytest.importorskip("numba", reason="Numba does not import")
    from zero1_mpi.kernels import numba_shared as kernels_numba
    kernels_numba.compile_marked({})
    return kernels_numba


SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, 65504, 65519.99, 65520, 1e9, -1e9, 6e-8, 3e-8,
                    2.98e-8, 6.1035e-5, 6.1e-5, 1.0009765625, 1.00048828125, 3.4e38, 1e-40,
                    np.inf, -np.inf], np.float32)


@pytest.mark.parametrize("dtype, convert", [("float16", "narrow_f16"),
                                            ("bfloat16", "narrow_bf16")])
def test_numba_rounding_to_16_bits_matches_numpy(dtype, convert, numba_kernels):
    rng = np.random.default_rng(0)
    values = np.concatenate([SPECIAL, (rng.standard_normal(200_000) * 10.0 ** rng.integers(
        -9, 6, 200_000)).astype(np.float32)])
    out = np.empty(values.size, np.uint16)
    getattr(numba_kernels, convert)(values, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, values.astype(resolve_dtype(dtype)).view(np.uint16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numba_sums_of_blocks_and_squares(dtype, numba_kernels):
    """fp32 rows too: read as 16-bit patterns they were summed wrong, written past ``out``
    (heap corruption that crashed the process at exit)."""
    rng = np.random.default_rng(1)
    blocks = (rng.standard_normal((3, 10_001)) * 4).astype(resolve_dtype(dtype))
    want, got = np.empty(10_001, np.float32), np.empty(10_001, np.float32)
    NumpyReductions().sum_blocks(blocks, want)
    NumbaReductions().sum_blocks(blocks, got)
    assert np.array_equal(want, got)  # the same fp32 additions in the same order
    kernel = NumbaReductions()
    exact = float(np.sum(np.asarray(blocks[0], np.float64) ** 2))
    assert kernel.sum_of_squares(blocks[0]) == pytest.approx(exact, rel=1e-6)
    assert kernel.sum_of_squares(got) == pytest.approx(NumpyReductions().sum_of_squares(got),
                                                       rel=1e-6)
    assert np.isnan(kernel.sum_of_squares(np.array([1.0, np.nan], np.float32)))


def test_kernel_choice(monkeypatch):
    from zero1_mpi.kernels.local_sums import KERNEL_ENV, resolve_cpu_kernel
    assert resolve_cpu_kernel({KERNEL_ENV: "numpy"}) == "numpy"
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}='fast'"):
        resolve_cpu_kernel({KERNEL_ENV: "fast"})
    monkeypatch.setitem(sys.modules, "numba", None)  # as if Numba were missing
    assert resolve_cpu_kernel({}) == "numpy"
    with pytest.raises(ImportError, match=r"zero1-mpi\[fast\]"):
        resolve_cpu_kernel({KERNEL_ENV: "numba"})


def test_kernel_choice_with_numba(numba_kernels):
    from zero1_mpi.kernels.local_sums import KERNEL_ENV, resolve_cpu_kernel
    assert resolve_cpu_kernel({KERNEL_ENV: "numba"}) == "numba"
    assert resolve_cpu_kernel({}) == "numba"  # auto: Numba where it imports
