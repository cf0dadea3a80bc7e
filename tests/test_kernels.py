"""The NumPy twin of the fused Adam kernel against the textbook reference, and the Numba kernel
against the NumPy twin, in one process. Only the Numba tests skip where Numba is missing."""

import sys
import tracemalloc

import numpy as np
import pytest

from reference import ReferenceAdam, max_rel_err, max_ulp_diff
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.reductions import NumbaReductions, NumpyReductions
from zero1_mpi.rules.adam import AdamScalars, NumbaAdam, NumpyAdam

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

SIZE = 1000


def run_twin(dtype_name, decoupled, weight_decay, steps=15, chunk=64, grad_scale=0.5):
    """Run NumpyAdam and the reference side by side; yield both after every step."""
    dtype = resolve_dtype(dtype_name)
    rng = np.random.default_rng(0)
    init = rng.standard_normal(SIZE).astype(np.float32)
    ref = ReferenceAdam({"p": init}, lr=1e-2, weight_decay=weight_decay, decoupled=decoupled)
    kernel = NumpyAdam(chunk=chunk)
    master = init.copy()
    m, v = np.zeros(SIZE, np.float32), np.zeros(SIZE, np.float32)
    param = init.astype(dtype) if dtype != np.float32 else None
    for step in range(1, steps + 1):
        grad = rng.standard_normal(SIZE).astype(dtype)
        s = AdamScalars.for_step(step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=weight_decay, decoupled=decoupled,
                                 grad_scale=grad_scale)
        kernel(grad, master, m, v, param, s)
        ref.step({"p": np.asarray(grad, np.float64) * grad_scale})
        yield (master if param is None else param), ref.params["p"], dtype


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_numpy_twin_matches_textbook_adam(dtype_name, decoupled, weight_decay):
    for got, want, dtype in run_twin(dtype_name, decoupled, weight_decay):
        if dtype == np.float32:
            assert max_rel_err(got, want) <= 1e-6
        else:
            assert max_ulp_diff(got, want.astype(np.float32).astype(dtype)) <= 1


def test_chunking_does_not_change_the_result():
    runs = [list(got.copy() for got, _, _ in run_twin("bfloat16", True, 0.1, chunk=c))
            for c in (7, 64, 1 << 16)]
    for a, b, c in zip(*runs):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        assert np.array_equal(a.view(np.uint16), c.view(np.uint16))


def test_step_scalars_follow_torch():
    s = AdamScalars.for_step(3, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5,
                             decoupled=True, grad_scale=0.25)
    assert s.step_size == pytest.approx(0.1 / (1 - 0.8 ** 3))
    assert s.bc2_sqrt == pytest.approx((1 - 0.9 ** 3) ** 0.5)
    assert (s.decay, s.l2, s.grad_scale) == (pytest.approx(1 - 0.1 * 0.5), 0.0, 0.25)
    adam = AdamScalars.for_step(1, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5,
                                decoupled=False)
    assert (adam.decay, adam.l2) == (1.0, 0.5)


def test_zero_gradient_padding_stays_zero():
    kernel = NumpyAdam()
    p, m, v = np.zeros(128, np.float32), np.zeros(128, np.float32), np.zeros(128, np.float32)
    out = np.zeros(128, np.float16)
    for step in range(1, 4):
        kernel(np.zeros(128, np.float16), p, m, v, out,
               AdamScalars.for_step(step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.1, decoupled=False))
    assert not (p.any() or m.any() or v.any() or out.any())


@pytest.mark.parametrize("dtype_name, limit", [("float32", 4096), ("float16", 65536),
                                               ("bfloat16", 65536)])
def test_a_step_allocates_no_per_element_memory(dtype_name, limit):
    """Scratch is allocated once; 16-bit casts only use NumPy's fixed-size cast buffers."""
    dtype = resolve_dtype(dtype_name)
    n = 1 << 20
    kernel = NumpyAdam()
    master, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    grad = np.ones(n, dtype)
    param = None if dtype == np.float32 else np.ones(n, dtype)
    s = AdamScalars.for_step(1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             decoupled=False)
    kernel(grad, master, m, v, param, s)
    tracemalloc.start()
    kernel(grad, master, m, v, param, s)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < limit, f"a step over {n} elements allocated {peak} bytes"


# -- the Numba fast path: the same bits as the NumPy twin --------------------------------------

ENCODINGS = ["float32", "float16", "bfloat16"]


@pytest.fixture
def numba_kernels():
    """``zero1_mpi.kernels_numba`` with its helpers compiled (skips where Numba is missing)."""
    pytest.importorskip("numba", reason="Numba does not import")
    from zero1_mpi import kernels_numba
    kernels_numba.compile_marked({})
    return kernels_numba


@pytest.mark.parametrize("grad_dtype", ENCODINGS)
@pytest.mark.parametrize("param_dtype", ENCODINGS)
@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_numba_kernel_is_bitwise_the_numpy_twin(grad_dtype, param_dtype, decoupled,
                                                weight_decay, numba_kernels):
    rng = np.random.default_rng(5)
    n = 3 * numba_kernels.CHUNK + 17  # several chunks and a remainder
    master = rng.standard_normal(n).astype(np.float32)
    mixed = param_dtype != "float32"
    twins = []
    for kernel in (NumpyAdam(chunk=1000), NumbaAdam()):
        state = [master.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32),
                 master.astype(resolve_dtype(param_dtype)) if mixed else None]
        for step in range(1, 5):
            grad = (np.random.default_rng(step).standard_normal(n) * 3).astype(
                resolve_dtype(grad_dtype))
            kernel(grad, *state, AdamScalars.for_step(
                step, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay,
                decoupled=decoupled, grad_scale=0.25))
        twins.append(state)
    for a, b in zip(*twins):
        if a is not None:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


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
    from zero1_mpi.reductions import KERNEL_ENV, resolve_cpu_kernel
    assert resolve_cpu_kernel({KERNEL_ENV: "numpy"}) == "numpy"
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}='fast'"):
        resolve_cpu_kernel({KERNEL_ENV: "fast"})
    monkeypatch.setitem(sys.modules, "numba", None)  # as if Numba were missing
    assert resolve_cpu_kernel({}) == "numpy"
    with pytest.raises(ImportError, match=r"zero1-mpi\[fast\]"):
        resolve_cpu_kernel({KERNEL_ENV: "numba"})


def test_kernel_choice_with_numba(numba_kernels):
    from zero1_mpi.reductions import KERNEL_ENV, resolve_cpu_kernel
    assert resolve_cpu_kernel({KERNEL_ENV: "numba"}) == "numba"
    assert resolve_cpu_kernel({}) == "numba"  # auto: Numba where it imports
