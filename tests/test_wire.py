"""The 8-bit wire format (``zero1_mpi.wire``) and the engine's 8-bit paths.

In one process: the NumPy and Numba twins against the float64 model of the format
(``reference.int8_encode`` / ``int8_sum``), bit for bit, for every dtype, ragged blocks, error
feedback, and blocks holding inf or nan (they decode to nan, never to a finite value). On N
ranks (tests/cases/wire.py): the reduced shards equal the model bit for bit (stage 1 and 2, flat
and in shard groups, every hop or the one across), 8-bit gathers keep identical copies within
their bound, overflow in any block is a skipped step or an error on every rank, every rule, and
bad values on every rank.
"""

import numpy as np
import pytest

import reference as ref
from mpirun import run_mpi
from zero1_mpi import wire
from zero1_mpi.backend import BFLOAT16

KINDS = ["numpy", "numba"]
DTYPES = [np.float32, np.float16, BFLOAT16]


def values(n, dtype, seed=0, bad=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * rng.choice([1e-4, 1.0, 300.0], size=n)
    if bad and n > 700:
        x[:256] = 0  # a zero block
        x[300], x[600] = np.inf, np.nan
    return x.astype(dtype)


def same(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_packed_bytes():
    assert wire.packed_bytes(256) == 4 + 256
    assert wire.packed_bytes(257) == 8 + 260
    assert wire.packed_bytes(64) == 4 + 64
    assert wire.packed_bytes(1 << 20) / (1 << 20) == pytest.approx(1 + 4 / 256)


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 256, 900, 70_000])
@pytest.mark.parametrize("feedback", [False, True])
def test_encode_equals_the_float64_model(kind, dtype, n, feedback):
    codec = wire.codec_for(kind, n)
    x = values(n, dtype)
    residual = (values(n, np.float32, seed=1, bad=False) * 0.01).astype(dtype) if feedback else None
    packed = np.zeros(wire.packed_bytes(n), np.uint8)
    mine = None if residual is None else residual.copy()
    codec.encode(x, packed, mine)
    scales, q, new = ref.int8_encode(x, residual)
    got_scales, got_q = wire.split_packed(packed, n)
    assert np.array_equal(got_scales, scales, equal_nan=True)
    assert np.array_equal(got_q, q)
    if feedback:
        assert same(mine, new)
        assert np.isfinite(mine.astype(np.float32)).all()  # bad blocks leave 0, not nan


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sum_and_add_equal_the_model(kind, dtype):
    n, codec = 900, wire.codec_for(kind, 900)
    rows = np.zeros((3, wire.packed_bytes(n)), np.uint8)
    for r in range(3):
        wire.codec_for("numpy").encode(values(n, dtype, seed=r, bad=r == 1), rows[r])
    out = np.empty(n, np.float32)
    codec.decode_sum(rows, n, out)
    want = ref.int8_sum([wire.split_packed(rows[r], n) for r in range(3)])
    assert np.array_equal(out, want, equal_nan=True)
    assert np.isnan(out[256:768]).all() and np.isfinite(out[:256]).all()  # bad blocks: nan
    target = values(n, dtype, seed=7, bad=False)
    want = (ref._f32(target.astype(np.float64)
                     + ref.int8_decode(*wire.split_packed(rows[0], n)))).astype(dtype)
    codec.decode_add(rows[0], target)
    assert same(target, want)


def test_a_block_with_inf_decodes_to_nan_not_a_huge_value():
    x = np.ones(512, np.float32)
    x[5] = np.inf
    packed = np.zeros(wire.packed_bytes(512), np.uint8)
    wire.codec_for("numpy").encode(x, packed)
    out = np.empty(512, np.float32)
    wire.codec_for("numpy").decode_sum(packed[None], 512, out)
    assert np.isnan(out[:256]).all() and (out[256:] == 1).all()


def test_quantization_error_is_within_half_a_step():
    x = values(70_000, np.float32, bad=False)
    packed = np.zeros(wire.packed_bytes(x.size), np.uint8)
    wire.codec_for("numpy").encode(x, packed)
    out = np.empty(x.size, np.float32)
    wire.codec_for("numpy").decode_sum(packed[None], x.size, out)
    scales = np.repeat(wire.split_packed(packed, x.size)[0], 256)[: x.size]
    assert (np.abs(out - x) <= scales / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("n, parts", [
    (2, ["reduce", "gather", "overflow", "rules", "options", "feedback"]),
    (3, ["reduce", "overflow"]),
    (4, ["reduce", "gather", "overflow", "feedback"]),
    (6, ["reduce"]),  # 3 replicas: the sum across groups reduce-scattered, then gathered
])
def test_the_8bit_paths_on_n_ranks(n, parts):
    out = run_mpi(n, "wire.py", *parts, timeout=600).stdout
    assert f"OK 8-bit wire on {n} ranks: {', '.join(parts)}" in out, out


def test_the_numba_twin_in_the_engine():
    out = run_mpi(2, "wire.py", "reduce", timeout=300,
                  env={"ZERO1_MPI_KERNEL": "numba"}).stdout
    assert "OK 8-bit wire on 2 ranks: reduce" in out, out
