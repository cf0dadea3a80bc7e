"""The NumPy twin of the fused Adam kernel against the textbook reference, in one process."""

import tracemalloc

import numpy as np
import pytest

from reference import ReferenceAdam, max_rel_err, max_ulp_diff
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.kernels import AdamScalars, NumpyAdam

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
