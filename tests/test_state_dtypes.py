"""The rule's state in bf16 and in 8 bits (``state_dtype``, ``zero1_mpi.state.encodings``,
``zero1_mpi.state.int8_blocks``).

In one process: the NumPy and Numba twins round stochastically bit for bit as the integer model
``reference.sr_bf16`` (every magnitude, inf, nan, any start), the rounding is unbiased, and the
bits follow the parameter's index, the step and the array; the 8-bit state's maps, its codes
and scales bit for bit its float64 model (``reference.int8_state_encode``: signed, unsigned,
zero and bad blocks, ragged segments, fp32 segments), reads and writes of any range. On N ranks
(tests/cases/state_dtypes.py): every rule, fp32 and bf16 parameters, stage 1 and 2, flat and in
groups, against a float64 model of the rule whose state is quantized as the engine does each
step; checkpoints across the modes at another world size; the ledger's bytes.
"""

import numpy as np
import pytest

import reference as ref
from mpirun import SIBLING, run_mpi
from zero1_mpi import ZeroAdamW
from zero1_mpi.state.encodings import Bf16State
from zero1_mpi.state.int8_blocks import BOUNDS, CODES, Int8State

KINDS = ["numpy", "numba"]


def values(n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([1e-40, 1e-20, 1.0, 1e30], n)).astype(np.float32)
    x[:7] = [np.inf, -np.inf, np.nan, 0.0, -0.0, np.finfo(np.float32).max, -1e-45]
    return x


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flat, step, array", [(0, 1, 0), (123_456_789, 77, 1), (2**33 + 5, 3, 2)])
def test_rounding_equals_the_integer_model(kind, flat, step, array):
    n = 300_001  # more than one NumPy chunk
    x = values(n)
    kept = Bf16State(n + 10, n, np, kind, array)
    kept.store(slice(10, n + 10), x.copy(), flat, step)
    want = ref.sr_bf16(x, flat + np.arange(n), step, array)
    assert np.array_equal(kept.held[10:], want)
    back = kept.read(slice(10, n + 10))
    assert np.array_equal(back.view(np.uint32), want.astype(np.uint32) << 16)
    assert np.isnan(back[2]) and back[0] == np.inf and back[1] == -np.inf


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_rounding_is_unbiased_and_draws_by_index_step_and_array(kind):
    n = 400_000
    x = np.full(n, 1.0 + 2.0**-9, np.float32)  # a quarter of the way from 1 to the next bf16
    kept = Bf16State(n, n, np, kind, 0)
    kept.store(slice(0, n), x, 0, 1)
    up = (kept.read(slice(0, n)) > 1.0).mean()
    assert abs(up - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n), up
    first = kept.held.copy()
    for flat, step, array in ((1, 1, 0), (0, 2, 0)):
        other = Bf16State(n, n, np, kind, array)
        other.store(slice(0, n), x, flat, step)
        assert not np.array_equal(other.held, first)
    other = Bf16State(n, n, np, kind, 0)
    other.store(slice(0, n), x, 0, 1)
    assert np.array_equal(other.held, first)  # reproducible
    exact = np.full(n, 1.5, np.float32)  # a bf16 value stays itself
    other.store(slice(0, n), exact, 0, 1)
    assert (other.read(slice(0, n)) == 1.5).all()


@pytest.mark.parametrize("n", [1, SIBLING(3), 4])
def test_every_rule_against_its_model_on_n_ranks(n, tmp_path):
    out = run_mpi(n, "state_dtypes.py", str(tmp_path), timeout=400).stdout
    assert f"OK state_dtypes on {n} ranks" in out, out


@pytest.mark.mpi_independent
@pytest.mark.parametrize("options, text", [
    ({"state_dtype": "float16"}, "state_dtype='float16' is not understood"),
    ({"state_dtype": None}, "state_dtype=None is not understood: use 'float32'"),
])
def test_bad_values_name_the_value_and_the_fix(options, text):
    from mpi4py import MPI
    with pytest.raises(ValueError, match=text.replace("(", r"\(")):
        ZeroAdamW({"w": np.ones(4, np.float32)}, MPI.COMM_SELF, **options)


def segments_of(sizes, small=()):
    """Back-to-back segments of ``sizes``, those at the indices ``small`` kept in fp32."""
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append((at, at + n, i not in small))
        at += n
    return out


def state_values(n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([1e-9, 1e-3, 1.0], n)).astype(np.float32)
    x[256:512] = np.abs(x[256:512])  # an unsigned block
    x[512:768] = 0  # a zero block
    x[800], x[1100] = np.inf, np.nan  # bad blocks
    return x


@pytest.mark.mpi_independent
def test_the_dynamic_maps():
    for signed, low in ((False, 0.0), (True, -0.9927)):
        codes = CODES[signed]
        assert codes.size == 256 and (np.diff(codes) > 0).all(), signed
        assert codes[-1] == 1.0 and abs(codes[0] - low) < 1e-3 and 0.0 in codes
        tiny = np.abs(codes[codes != 0]).min()
        assert 1e-7 < tiny < 1e-6  # seven decades below 1
    assert np.array_equal(BOUNDS[True], ref.int8_state_bounds(CODES[True]))


@pytest.mark.mpi_independent
@pytest.mark.parametrize("signed", [False, True])
def test_a_first_code_and_one_step_give_every_values_code(signed):
    """The encoders' shortcut (``FIRST_CODES`` of the top half, then one bound): for both
    ends of every top half of |x| <= 1 (the code is monotone in x), the count of bounds below."""
    from zero1_mpi.state.int8_blocks import FIRST_CODES, PAST
    tops = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    for low in (0, 0xFFFF):
        x = (tops | np.uint32(low)).view(np.float32)
        x = x[np.isfinite(x) & (np.abs(x) <= 1)]
        first = FIRST_CODES[signed][x.view(np.uint32) >> 16].astype(np.int64)
        one_step = first + (PAST[signed][first] < x)
        assert np.array_equal(one_step, np.searchsorted(BOUNDS[signed], x, "left"))


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_8bit_state_equals_its_float64_model(kind):
    sizes = [3000, 700, 5000]  # ragged segments, the middle one kept in fp32
    n = sum(sizes)
    kept = Int8State(n, segments_of(sizes, small={1}), 5000, np, kind)
    x = state_values(n)
    x[3000:3700] = np.random.default_rng(4).standard_normal(700)  # the fp32 segment's
    for (start, stop, q), at in zip(segments_of(sizes, {1}), (0, 0, 0)):
        st = slice(start, stop)
        got = kept.load(st, at)
        got[...] = x[st]
        kept.store(st, got, start, 1)
    for start, stop, q in segments_of(sizes, {1}):
        st = slice(start, stop)
        back = kept.read(st)
        if not q:
            assert np.array_equal(back, x[st])
            continue
        codes, scales = ref.int8_state_encode(x[st], CODES[False], CODES[True])
        assert np.array_equal(kept.held[st], codes)
        want = ref.int8_state_decode(codes, scales, CODES[False], CODES[True])
        assert np.array_equal(back, want, equal_nan=True)
    assert np.isnan(kept.read(slice(768, 1024))).all() and (kept.read(slice(512, 768)) == 0).all()
    # within 8% of a value, or 0.5% of its block's largest (the map's decades below 0.1)
    block = np.arange(3000) // 256
    ok = ~np.isin(block, [3, 4])  # not the blocks holding inf, nan
    largest = np.array([np.abs(x[b * 256 : b * 256 + 256]).max() for b in block])
    err = np.abs(kept.read(slice(0, 3000)) - x[:3000])
    assert (err[ok] <= 0.08 * np.abs(x[:3000][ok]) + 0.005 * largest[ok]).all()
    assert kept.nbytes == n + 4 * (12 + 20) + 4 * 700  # codes, scales, the fp32 segment


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_8bit_state_reads_and_writes_any_range(kind):
    sizes = [1000, 300, 2000]
    n = sum(sizes)
    kept = Int8State(n, segments_of(sizes, small={1}), 2000, np, kind)
    x = state_values(n, seed=3)
    x = np.where(np.isfinite(x), x, 0).astype(np.float32)
    kept.write(slice(0, n), x)  # whole: each block quantized once
    first = kept.read(slice(0, n))
    assert np.array_equal(first[1000:1300], x[1000:1300])
    assert np.array_equal(kept.read(slice(123, 2999)), first[123:2999])  # across segments
    kept.write(slice(100, 1200), first[100:1200])  # values it holds, in part of a block
    assert np.array_equal(kept.read(slice(0, n)), first)  # ... unchanged
    for bad in (slice(1, 300), slice(900, 1100)):  # not a kernel call's range
        with pytest.raises(AssertionError, match="not a kernel call's range"):
            kept.load(bad, 0)


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kind", KINDS)
def test_8bit_state_writes_what_it_decoded_bit_for_bit(kind):
    """What a checkpoint holds (the decoded state) loads back to the same decoded values: also
    in a block whose largest magnitude is negative (the signed map has no -1, so a plain encode
    of its decoded values takes a new scale) and in a signed block whose negative values all
    decode to 0; values no encoding holds are encoded as a step stores them."""
    rng = np.random.default_rng(11)
    n = 9 * 256 + 100  # a partial last block
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 1.0], n)).astype(np.float32)
    x[:256] = -np.abs(x[:256])
    x[7] = -3 * np.abs(x[:256]).max()  # the largest magnitude negative
    x[256:512] = np.abs(x[256:512])
    x[300] = -1e-12  # the only negative value, decoding to 0
    x[512:768] = rng.uniform(-1, 1, 256).astype(np.float32)
    x[600] = np.float32(-2.0)
    x[768:1024] = 0
    x[1100] = np.nan
    kept = Int8State(n, [(0, n, True)], n, np, kind)
    kept.store(slice(0, n), x.copy(), 0, 1)
    decoded = kept.read(slice(0, n))
    loaded = Int8State(n, [(0, n, True)], n, np, kind)
    loaded.write(slice(0, n), decoded)
    assert np.array_equal(loaded.read(slice(0, n)).view(np.uint32), decoded.view(np.uint32))
    plain = Int8State(n, [(0, n, True)], n, np, kind)
    plain.write(slice(0, n), x)
    assert np.array_equal(plain.held, kept.held)
    assert np.array_equal(plain.scales, kept.scales, equal_nan=True)


@pytest.mark.mpi_independent
def test_8bit_state_twins_agree():
    """Stored last segment first (a call owns its blocks, in any order), whole blocks and a
    block of one value last."""
    sizes = [70_000, 5, 32 * 256, 9_000, 32 * 256 + 1]
    n = sum(sizes)
    x = state_values(n, seed=5)
    held = []
    for kind in KINDS:
        kept = Int8State(n, segments_of(sizes), 70_000, np, kind)
        for start, stop, _ in reversed(segments_of(sizes)):
            kept.store(slice(start, stop), x[start:stop].copy(), start, 1)
        held.append((kept.held.copy(), kept.scales.copy(), kept.read(slice(0, n))))
    for a, b in zip(*held):
        assert np.array_equal(a, b, equal_nan=True)
