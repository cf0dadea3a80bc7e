"""ZeroLAMB's kernels: the two phases of the Numba twin bitwise equal to the NumPy twin's
(pieces longer than a chunk included), the NumPy twin against the float64 reference on whole
tensors, the trust ratio's edge cases, and bad options. Multi-rank parity (tensors straddling
shards and buckets, so the norms need the Allreduce) is in test_rules.py."""

import numpy as np
import pytest
from mpi4py import MPI

from reference import ReferenceLAMB, max_rel_err
from zero1_mpi import ZeroLAMB
from zero1_mpi.backend import resolve_dtype
from zero1_mpi.reductions import NUMPY_CHUNK
from zero1_mpi.rules.lamb import Lamb, NumbaLamb, NumpyLamb

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
SIZES = (NUMPY_CHUNK + 1_000, 7, 1)  # one tensor crosses a chunk boundary


def run_lamb(kernel, param_dtype, options=OPTIONS, steps=4, sizes=SIZES):
    """Whole tensors, one piece each: ``(masters, exp_avgs, exp_avg_sqs, params)``."""
    dtype = resolve_dtype(param_dtype)
    masters = [np.random.default_rng(i).standard_normal(n).astype(np.float32)
               for i, n in enumerate(sizes)]
    ms, vs = [np.zeros(n, np.float32) for n in sizes], [np.zeros(n, np.float32) for n in sizes]
    params = [m.astype(dtype) if dtype != np.float32 else None for m in masters]
    for step in range(1, steps + 1):
        s = Lamb.scalars(step, options, 0.5)
        grads = [np.random.default_rng([step, i]).standard_normal(n).astype(dtype)
                 for i, n in enumerate(sizes)]
        sums = [kernel.tensor_sums(g, p, m, v, s) for g, p, m, v in zip(grads, masters, ms, vs)]
        for p, m, v, param, total in zip(masters, ms, vs, params, sums):
            kernel.apply(p, m, v, param, Lamb.tensor_scalars(s, total))
    return masters, ms, vs, params


@pytest.mark.parametrize("param_dtype", ["float32", "float16", "bfloat16"])
def test_numba_lamb_is_bitwise_the_numpy_twin(param_dtype):
    pytest.importorskip("numba")
    a = run_lamb(NumpyLamb(), param_dtype)
    b = run_lamb(NumbaLamb(), param_dtype)
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            if x is not None:
                assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_numpy_lamb_matches_the_float64_reference():
    masters, ms, vs, _ = run_lamb(NumpyLamb(), "float32")
    init = {str(i): np.random.default_rng(i).standard_normal(n).astype(np.float32)
            for i, n in enumerate(SIZES)}
    ref = ReferenceLAMB(init, **OPTIONS)
    for step in range(1, 5):
        ref.step({str(i): np.random.default_rng([step, i]).standard_normal(n)
                  .astype(np.float32).astype(np.float64) * 0.5 for i, n in enumerate(SIZES)})
    for i in range(len(SIZES)):
        assert max_rel_err(masters[i], ref.params[str(i)]) <= 1e-6
        assert max_rel_err(ms[i], ref.m[str(i)]) <= 1e-6
        assert max_rel_err(vs[i], ref.v[str(i)]) <= 1e-6


def test_trust_ratio_is_one_where_a_norm_is_zero():
    s = Lamb.scalars(1, OPTIONS, 1.0)
    assert Lamb.tensor_scalars(s, [0.0, 4.0]).neg_step == -OPTIONS["lr"]
    assert Lamb.tensor_scalars(s, [9.0, 0.0]).neg_step == -OPTIONS["lr"]
    assert Lamb.tensor_scalars(s, [9.0, 4.0]).neg_step == pytest.approx(-OPTIONS["lr"] * 1.5)


def test_zero_parameters_move_by_lr_times_the_direction():
    """||p|| = 0 gives ratio 1: the first step moves each element by lr * g / (|g| + eps)."""
    opt = ZeroLAMB({"w": np.zeros(8, np.float32)}, MPI.COMM_SELF, lr=0.1, weight_decay=0.0)
    opt.grads["w"][...] = np.arange(1, 9, dtype=np.float32)
    opt.step()
    np.testing.assert_allclose(opt.params["w"], -0.1 * np.ones(8), rtol=1e-5)


@pytest.mark.parametrize("options, words", [
    ({"betas": (1.0, 0.999)}, "betas[0]=1.0 must be in [0, 1)"),
    ({"eps": -1e-6}, "eps=-1e-06 must be >= 0"),
    ({"lr": -1.0}, "lr=-1.0 must be >= 0"),
    ({"weight_decay": -0.01}, "weight_decay=-0.01 must be >= 0"),
])
def test_bad_lamb_options_name_the_value(options, words):
    with pytest.raises(ValueError) as info:
        ZeroLAMB({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, **options)
    assert words in str(info.value)
