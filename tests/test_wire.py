"""The 8-bit wire format (``zero1_mpi.wire``) and the engine's 8-bit paths.

In one process: the NumPy and Numba twins against the float64 model of the format
(``reference.int8_encode`` / ``int8_sum``), bit for bit, for every dtype, ragged blocks, error
feedback, and blocks holding inf or nan (they decode to nan, never to a finite value). On N
ranks (tests/cases/wire.py): the reduced shards equal the model bit for bit (stage 1 and 2, flat
and in shard groups, every hop or the one across), 8-bit gathers keep identical copies within
their bound, overflow in any block is a skipped step or an error on every rank, every rule, and
bad values on every rank.
"""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import reference as ref
from mpirun import run_mpi
from zero1_mpi import Communicator, build_layout
from zero1_mpi.wire import codec as wire
from zero1_mpi.kernels.backend import BFLOAT16
from zero1_mpi.wire.param_gathers import QuantizedGathers
from zero1_mpi.comm.watchdog import Watchdog

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


#: A signaling nan of each 16-bit dtype: converting one to float32 sets the invalid flag.
SIGNALING_NAN = {np.dtype(BFLOAT16): 0x7F81, np.dtype(np.float16): 0x7C01}


class Uninitialized:
    """NumPy whose ``empty`` gives 16-bit float arrays full of signaling nans (as fresh memory
    may hold), other arrays of 0xff bytes."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        out = np.empty(shape, dtype)
        if out.dtype in SIGNALING_NAN:
            out.view(np.uint16)[...] = SIGNALING_NAN[out.dtype]
        else:
            out.view(np.uint8)[...] = 0xFF
        return out


@pytest.mark.mpi_independent
@pytest.mark.parametrize("dtype", [BFLOAT16, np.float16])
def test_8bit_gathers_never_read_the_padding_of_their_scratch(dtype):
    """The kernel writes a shard's real elements only; the 8-bit gather's change is computed
    over those, so nan in the scratch's padding warns of nothing and reaches no parameter
    (it once gave "RuntimeWarning: invalid value encountered in subtract")."""
    layout = build_layout({"w": (40,)}, 1, np.dtype(dtype).name, bucket_elements=64)
    params = np.zeros(layout.total, dtype)
    params[:40] = np.linspace(-1, 1, 40)
    gathers = QuantizedGathers(layout, params, Communicator(MPI.COMM_SELF), Watchdog(None),
                               Uninitialized(), wire.codec_for("numpy"))
    (bucket,) = layout.buckets
    assert bucket.owned_real(0) == 40 < bucket.shard_size == 64
    new = (params[:40].astype(np.float32) + 0.25).astype(dtype)
    gathers.target(bucket)[:40] = new  # as a kernel does: the padding stays as it was
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathers.start(0)
        gathers.wait()
    step = np.abs(new.astype(np.float32) - np.linspace(-1, 1, 40)).max() / 127
    assert np.abs(params[:40].astype(np.float32) - new.astype(np.float32)).max() <= 2 * step
    assert not params[40:].astype(np.float32).any()


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


@pytest.mark.mpi_independent
def test_the_numpy_codec_holds_one_chunk_of_scratch_whatever_the_row():
    """The NumPy twin works ``NUMPY_CHUNK`` values at a time: two fp32 chunks of scratch for a
    longer row (a shorter one: its own size, in whole blocks), and the same bytes as one
    call over a whole row (tools/mutate.py found no test of the bound)."""
    n = 2 * wire.NUMPY_CHUNK + 3 * wire.BLOCK + 5
    chunked, whole = wire.NumpyCodec(n), wire.NumpyCodec(wire.BLOCK + 1)
    assert chunked.scratch_bytes == 2 * 4 * wire.NUMPY_CHUNK
    assert whole.scratch_bytes == 2 * 4 * 2 * wire.BLOCK
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    packed = np.zeros(wire.packed_bytes(n), np.uint8)
    chunked.encode(x, packed)
    scales, q, _ = ref.int8_encode(x, np.zeros(n, np.float32))
    got_scales, got_q = wire.split_packed(packed, n)
    assert np.array_equal(got_scales, scales) and np.array_equal(got_q, q)
