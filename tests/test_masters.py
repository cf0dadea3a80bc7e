"""Remainder masters (``zero1_mpi.state.masters``, ``masters="remainder"``, bf16's default).

In one process: the NumPy and Numba twins keep every fp32 value with its bf16 rounding bit for
bit, ties included, equal to the integer model of ``reference.remainder_encode``; a tie is
forgotten once its element is stored again as something else; the counting argument for ties
(an even bf16 value is the rounding of 65,537 fp32 values). On N ranks (tests/cases/masters.py):
every rule, stage, overlap mode and group size gives today's fp32-master bits; checkpoints load
across the two modes at another world size; the ledger's bytes; bad values on every rank.
"""

import numpy as np
import pytest

import reference as ref
from mpirun import SIBLING, run_mpi
from zero1_mpi import ZeroAdamW
from zero1_mpi.kernels.backend import BFLOAT16
from zero1_mpi.state.masters import TIE, RemainderMasters

KINDS = ["numpy", "numba"]


def masters_with_ties(n, seed=0):
    """fp32 values of every magnitude and sign, a few thousand of them ties (half a bf16 step
    above an even bf16 value) and as many half a step below one, plus the edges."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([1e-40, 1e-30, 1.0, 1e30], n)).astype(np.float32)
    bits = x.view(np.uint32)
    above = rng.choice(n, n // 100, replace=False)
    bits[above] = (bits[above] & 0xFFFE0000) | TIE  # even high half, then exactly half a step
    below = rng.choice(n, n // 100, replace=False)
    bits[below] = (bits[below] & 0xFFFF0000) | 0x18000  # odd - 1/2 ... rounds up to the even
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max,
                      -np.finfo(np.float32).max, 1e-45, -1e-45, 3.3895314e38], np.float32)
    x[: edges.size] = edges
    return x


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_masters_come_back_bit_for_bit_and_equal_the_model(kind):
    n = 100_000
    x = masters_with_ties(n)
    m = RemainderMasters(n, n, np, kind)
    param = np.zeros(n, BFLOAT16)
    m.write(slice(0, n), x, param)
    assert np.array_equal(param.view(np.uint16), x.astype(BFLOAT16).view(np.uint16))
    rem, ties = ref.remainder_encode(x, param)
    assert np.array_equal(m.remainder, rem) and np.array_equal(m.ties, ties)
    assert ties.size > 500 and np.array_equal(m.read(slice(0, n), param).view(np.uint32),
                                              x.view(np.uint32))
    assert m.nbytes == 2 * n + 8 * ties.size == m.real_bytes(n)
    # a range in the middle, into the scratch at an offset (what a kernel call sees)
    st = slice(30_001, 70_003)
    got = m.load(st, 5, param[st])
    assert np.array_equal(got.view(np.uint32), x[st].view(np.uint32))


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_storing_a_range_again_keeps_the_ties_of_the_rest(kind):
    n = 50_000
    x = masters_with_ties(n, seed=1)
    m = RemainderMasters(n, n, np, kind)
    param = np.zeros(n, BFLOAT16)
    m.write(slice(0, n), x, param)
    st = slice(10_000, 20_000)
    new = masters_with_ties(n, seed=2)[st]  # other values and other ties in that range
    param[st] = new.astype(BFLOAT16)  # (the kernel writes the rounding, then store)
    m.store(st, new.copy(), param[st])
    x[st] = new
    assert np.array_equal(m.ties, ref.remainder_encode(x, param)[1])
    assert np.array_equal(m.read(slice(0, n), param).view(np.uint32), x.view(np.uint32))


@pytest.mark.mpi_independent
def test_an_even_bf16_value_is_the_rounding_of_65537_fp32_values():
    """Why ties exist: 16 bits name 65,536 remainders, and an even parameter has one more."""
    for high in (0x3F80, 0x3F81, 0x0002, 0x8004):  # 1.0 (even), odd, tiny even, negative even
        lo_bits = np.arange((high - 1) << 16, (high + 1) << 16, dtype=np.uint32)
        near = lo_bits.view(np.float32).astype(BFLOAT16).view(np.uint16) == high
        assert near.sum() == (65537 if high % 2 == 0 else 65535)


def test_bitwise_today_for_every_rule_stage_overlap_and_group(tmp_path):
    out = run_mpi(3, "masters.py", str(tmp_path), timeout=300).stdout
    assert "OK masters on 3 ranks" in out, out


@pytest.mark.parametrize("n", [1, 2, 4, SIBLING(6)])  # 4: groups of 2; 6: groups of 2 and of 3
def test_bitwise_today_on_other_world_sizes(n, tmp_path):
    out = run_mpi(n, "masters.py", str(tmp_path), "rules", "ties", "checkpoint",
                  timeout=300).stdout
    assert f"OK masters on {n} ranks" in out, out


@pytest.mark.mpi_independent
@pytest.mark.parametrize("options, text", [
    ({"masters": "half"}, "masters='half' is not understood"),
    ({"masters": "remainder", "param_dtype": "float32"}, "param_dtype is float32"),
    ({"masters": "remainder", "param_dtype": "float16"}, "param_dtype is float16"),
    ({"masters": "remainder", "param_dtype": "bfloat16", "offload": "cpu"},
     "offload='cpu' keeps every master on the host, as fp32 (with offload_fraction below 1"),
    ({"masters": "remainder", "param_dtype": "bfloat16", "gather_dtype": "int8"},
     "gather_dtype='int8'"),
])
def test_bad_values_name_the_value_and_the_fix(options, text):
    from mpi4py import MPI
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace("'", "'")):
        ZeroAdamW({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, **options)


@pytest.mark.mpi_independent
@pytest.mark.parametrize("dtype, offload, gather, want", [
    ("bfloat16", None, None, "remainder"),
    ("bfloat16", "cpu", None, "fp32"),
    ("bfloat16", None, "int8", "fp32"),
    ("float16", None, None, "fp32"),
    ("float32", None, None, "fp32"),
])
def test_auto_chooses_remainders_where_they_apply(dtype, offload, gather, want):
    from mpi4py import MPI
    opt = ZeroAdamW({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, param_dtype=dtype,
                    offload=offload, gather_dtype=gather)
    assert opt.options.masters == want
    assert opt.memory_report().masters == want


@pytest.mark.mpi_independent
def test_partly_offloaded_remainders_are_the_devices_part():
    """With offload_fraction < 1, 'auto' keeps fp32 masters (as the memory tool counts) and
    'remainder' keeps the device's part as remainders, the host's as fp32: K between."""
    from mpi4py import MPI
    params = {f"w{i}": np.ones(1000, np.float32) for i in range(4)}
    engine = dict(param_dtype="bfloat16", offload="cpu", offload_fraction=0.5,
                  bucket_elements=1024)
    assert ZeroAdamW(params, MPI.COMM_SELF, **engine).options.masters == "fp32"
    report = ZeroAdamW(params, MPI.COMM_SELF, masters="remainder", **engine).memory_report()
    assert report.masters == "remainder" and report.offload_fraction == 0.5
    assert report.bytes_per_param == 11 and report.host_bytes_per_param == 12
    assert report.host_state == 12 * 2000 and report.optimizer_state == 10 * 2000 + 12 * 2000
