"""The layout is pure data: equal aligned shards, tensors packed without overlap, fingerprints."""

import math

import pytest

from zero1_mpi.flat.layout import build_layout

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

AWKWARD = {"scalar": (), "empty": (0, 3), "one": (1,), "vec": (7,), "mat": (5, 13)}


def check_invariants(layout):
    world, quantum = layout.group_size, layout.group_size * layout.align
    position = 0
    for t in layout.tensors:  # packed back to back, in order, from 0
        assert t.offset == position and t.numel == math.prod(t.shape)
        position += t.numel
    assert position == layout.numel
    assert 0 <= layout.padding < quantum and layout.total % quantum == 0
    position = 0
    for bucket in layout.buckets:
        assert bucket.offset == position and bucket.size % quantum == 0
        assert bucket.used == max(0, min(bucket.size, layout.numel - bucket.offset))
        shards = [bucket.shard(r) for r in range(world)]
        assert shards[0][0] == bucket.offset and shards[-1][1] == bucket.offset + bucket.size
        assert all(stop - start == bucket.shard_size for start, stop in shards)
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
        assert bucket.state.start == position // world  # state arrays: shards back to back
        assert bucket.state.stop - bucket.state.start == bucket.shard_size
        assert sum(bucket.owned_real(r) for r in range(world)) == bucket.used
        covered = sum(hi - lo for _, lo, hi in layout.pieces(bucket.offset,
                                                              bucket.offset + bucket.size))
        assert covered == bucket.used
        position += bucket.size
    assert position == layout.total
    assert sum(layout.owned_real(r) for r in range(world)) == layout.numel
    assert layout.shard_total * world == layout.total
    owned = sorted((a, b) for r in range(world) for a, b, _ in layout.owned(r))
    assert [a for a, _ in owned] == [0] + [b for _, b in owned[:-1]]  # a partition of [0, Ψ)
    assert (owned[-1][1] if owned else 0) == layout.numel
    for r in range(world):
        assert sum(b - a for a, b, _ in layout.owned(r)) == layout.owned_real(r)
        for a, _, s in layout.owned(r):
            bucket = next(bk for bk in layout.buckets if bk.offset <= a < bk.offset + bk.size)
            assert s == bucket.state.start and a == bucket.shard(r)[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_elements", [1, 10, 50, 1 << 24])
def test_awkward_shapes_give_equal_shards(world, bucket_elements):
    layout = build_layout(AWKWARD, world, "float32", bucket_elements=bucket_elements)
    check_invariants(layout)
    assert layout.numel == 0 + 1 + 1 + 7 + 65


def test_fewer_elements_than_ranks():
    layout = build_layout({"s": ()}, 4, "float16")
    check_invariants(layout)
    assert layout.numel == 1 and layout.total == 4 * 64
    assert [layout.owned_real(r) for r in range(4)] == [1, 0, 0, 0]


def test_thousands_of_small_tensors_and_buckets():
    shapes = {f"t{i}": (1 + i % 5,) for i in range(5000)}
    layout = build_layout(shapes, 3, "bfloat16", bucket_elements=1000)
    check_invariants(layout)
    assert layout.numel == sum(1 + i % 5 for i in range(5000))
    bucket = math.ceil(1000 / 192) * 192  # rounded up to whole quanta of 3 ranks x 64
    assert [b.size for b in layout.buckets[:-1]] == [bucket] * (len(layout.buckets) - 1)
    assert len(layout.buckets) == math.ceil(layout.total / bucket)


def test_tensors_straddle_buckets_so_scratch_is_bounded():
    layout = build_layout({"a": (3,), "big": (1000,), "c": (2,)}, 2, "float32",
                          bucket_elements=128)
    check_invariants(layout)
    assert max(b.size for b in layout.buckets) == 128 and layout.total == 1024
    big = [(lo, hi) for t, lo, hi in layout.pieces(0, layout.total) if t.name == "big"]
    assert big == [(3, 1003)]
    assert [(t.name, lo, hi) for t, lo, hi in layout.pieces(896, 1024)] == [
        ("big", 896, 1003), ("c", 1003, 1005)]


def test_padding_is_only_at_the_end():
    layout = build_layout({"w": (130,)}, 2, "float32", align=64)
    assert layout.total == 256 and layout.padding == 126
    assert [layout.owned_real(r) for r in range(2)] == [128, 2]


def test_fingerprint_changes_with_anything_that_must_agree():
    base = build_layout(AWKWARD, 2, "float32")
    assert base.fingerprint == build_layout(dict(AWKWARD), 2, "float32").fingerprint
    others = [build_layout({**AWKWARD, "vec": (8,)}, 2, "float32"),
              build_layout(dict(reversed(AWKWARD.items())), 2, "float32"),
              build_layout(AWKWARD, 3, "float32"),
              build_layout(AWKWARD, 2, "float16"),
              build_layout(AWKWARD, 2, "float32", align=8),
              build_layout(AWKWARD, 2, "float32", align=8, bucket_elements=16),
              build_layout({**AWKWARD, "extra": ()}, 2, "float32")]
    assert len({base.fingerprint, *(o.fingerprint for o in others)}) == len(others) + 1


@pytest.mark.parametrize("kwargs, words", [
    ({"group_size": 0}, "group_size=0"),
    ({"bucket_elements": 0}, "bucket_elements=0"),
    ({"align": -1}, "align=-1"),
])
def test_bad_arguments_name_the_value(kwargs, words):
    args = {"group_size": 2, **kwargs}
    with pytest.raises(ValueError, match=words):
        build_layout(AWKWARD, args.pop("group_size"), "float32", **args)
