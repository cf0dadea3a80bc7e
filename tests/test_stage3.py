"""Parameter sharding (``shard_params=True``, ZeRO stage 3).

The multi-rank case (tests/cases/stage3.py) holds stage 3 to stages 1 and 2 bit for bit for
every rule of the registry and dtype, on uneven units, with the units opened as a model's
forward and backward would; prefetching along a changed order; checkpoints across the stages;
misuse; memory. Here, in one process: the units' layout and their checks.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import run_mpi
from zero1_mpi import ZeroAdamW
from zero1_mpi.flat.layout import build_layout
from zero1_mpi.wire.unit_gathers import OwnedParams, default_units


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stage3_equals_stages_1_and_2_on_n_ranks(n, tmp_path):
    out = run_mpi(n, "stage3.py", str(tmp_path), "rules", "layouts", "features", "prefetch",
                  "checkpoints", "misuse", "memory", timeout=300).stdout
    assert f"OK stage 3 on {n} ranks: 22 rule/dtype cases, 15 against the plain layout, " \
           "3 features, prefetch, checkpoints across the stages, misuse, memory" in out, out


def test_stage3_with_hierarchical_sharding(tmp_path):
    """4 ranks in 2 shard groups: each unit gathered within its group."""
    out = run_mpi(4, "stage3.py", str(tmp_path), "hierarchical", timeout=300).stdout
    assert "OK stage 3 on 4 ranks: shard_group_size=2" in out, out


SHAPES = {"a.w": (5, 13), "a.b": (13,), "b.w": (300,), "c": (), "d.w": (0, 3)}


@pytest.mark.mpi_independent
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_elements", [1, 64, 200, 1 << 20])
@pytest.mark.parametrize("units", [
    {"A": ["a.w", "a.b"], "B": ["b.w"], "C": ["c", "d.w"]},
    {"B": ["c", "a.b"], "A": ["d.w", "a.w", "b.w"]},  # across the two param groups
])
def test_each_unit_is_whole_buckets_padded_at_its_end(world, bucket_elements, units):
    groups = [2, 3]  # param groups: a.w, a.b | b.w, c, d.w
    layout = build_layout(SHAPES, world, "float32", bucket_elements=bucket_elements,
                          units=units, param_group_tensors=groups)
    plain = build_layout(SHAPES, world, "float32", bucket_elements=bucket_elements,
                         param_group_tensors=groups)
    quantum = world * 64
    order = list(SHAPES)
    expected = sorted(((name, sorted(members, key=order.index))
                       for name, members in units.items()),
                      key=lambda unit: order.index(unit[1][0]))
    assert [(u.name, list(u.tensors)) for u in layout.units] == expected
    assert layout.units[0].first == 0 and layout.units[-1].stop == len(layout.buckets)
    for index, unit in enumerate(layout.units):
        buckets = layout.buckets[unit.first:unit.stop]
        assert [b.unit for b in buckets] == [index] * len(buckets)
        assert all(a.offset + a.size == b.offset for a, b in zip(buckets, buckets[1:]))
        assert all(b.size % quantum == 0 and b.state.start == b.offset // world
                   for b in buckets)
        numel = sum(int(np.prod(SHAPES[m])) for m in unit.tensors)
        assert sum(b.used for b in buckets) == numel
        assert sum(b.size for b in buckets) - numel < quantum  # padded once, at the end
        slots = [t for t in layout.tensors if t.name in unit.tensors]
        assert [t.name for t in slots] == list(unit.tensors)
        assert slots[0].offset == buckets[0].offset  # a unit starts its first bucket
    # each tensor keeps its packed position and group, those of the layout without units
    mine = {t.name: (t.packed, t.group, t.numel) for t in layout.tensors}
    assert mine == {t.name: (t.offset, t.group, t.numel) for t in plain.tensors}
    assert [t.name for t in layout.given_order] == order
    assert [t.group for t in plain.tensors] == [0, 0, 1, 1, 1]
    # every rank's owned runs, in packed positions, cover [0, Ψ) once and map each packed
    # position to the flat position holding that element
    owned = sorted((lo, hi, flat) for r in range(world)
                   for lo, hi, _, flat in layout.owned_packed(r))
    assert [lo for lo, _, _ in owned] == [0] + [hi for _, hi, _ in owned[:-1]]
    assert owned[-1][1] == layout.numel == sum(int(np.prod(s)) for s in SHAPES.values())
    for lo, hi, flat in owned:
        for t, a, b in layout.pieces(flat, flat + hi - lo):
            assert t.packed + a - t.offset == lo + a - flat
    assert plain.units == ()
    assert [r[:3] for r in plain.owned_packed(1 % world)] == [
        (lo, hi, st) for lo, hi, st in plain.owned(1 % world)]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("units, text", [
    ("a", "units='a' must be None or a non-empty mapping"),
    ({}, "must be None or a non-empty mapping"),
    ({"A": "a.w"}, "unit 'A' -> 'a.w': a unit is a string naming a list of tensor names"),
    ({"A": []}, "unit 'A' names no tensor"),
    ({"A": ["a.w", "x"]}, "unit 'A' names 'x', which is not a parameter"),
    ({"A": ["a.w", "a.b"], "B": ["a.b"]}, "tensor 'a.b' is in unit 'A' and in 'B'"),
    ({"A": ["a.w", "a.b"]}, "tensor 'b.w' is in no unit (3 are not)"),
])
def test_bad_units_are_refused_naming_the_unit(units, text):
    with pytest.raises(ValueError, match="units=") as found:
        build_layout(SHAPES, 2, "float32", units=units)
    assert text in str(found.value)


@pytest.mark.mpi_independent
def test_units_are_found_by_name_in_the_order_of_their_first_tensor():
    layout = build_layout(SHAPES, 2, "float32",
                          units={"C": ["d.w", "c"], "A": ["a.b", "a.w"], "B": ["b.w"]})
    assert [(u.name, u.tensors) for u in layout.units] == [
        ("A", ("a.w", "a.b")), ("B", ("b.w",)), ("C", ("c", "d.w"))]
    assert layout.unit_named("B").tensors == ("b.w",)
    with pytest.raises(KeyError, match="no unit 'D': the units are 'A', 'B', 'C'"):
        layout.unit_named("D")
    with pytest.raises(KeyError, match="has no units: pass units="):
        build_layout(SHAPES, 2, "float32").unit_named("A")


@pytest.mark.mpi_independent
def test_default_units_are_the_modules_runs():
    assert default_units(["a.w", "a.b", "b.w", "c", "a.x", "d.e.w", "d.e.b"]) == {
        "a": ["a.w", "a.b"], "b": ["b.w"], "c": ["c"], "a#2": ["a.x"],
        "d.e": ["d.e.w", "d.e.b"]}


@pytest.mark.mpi_independent
def test_owned_params_give_this_ranks_shard_alone():
    layout = build_layout(SHAPES, 2, "float32", bucket_elements=64,
                          units=default_units(list(SHAPES)))
    owned = OwnedParams(layout, 1, np, np.float32)
    assert owned.local.size == layout.shard_total and owned.nbytes == layout.shard_total * 4
    for bucket in layout.buckets:
        lo, hi = bucket.shard(1)
        owned[lo:hi] = bucket.index + 1
        assert (owned.local[bucket.state] == bucket.index + 1).all()
        with pytest.raises(IndexError, match="with shard_params=True a rank holds only its "
                                             "shard"):
            owned[bucket.shard(0)[0]:bucket.shard(0)[1]]


def test_stage3_options_are_checked_on_one_rank():
    params = {"l1.w": np.ones((3, 4), np.float32), "l1.b": np.zeros(4, np.float32),
              "l2.w": np.ones((4, 2), np.float32)}
    opt = ZeroAdamW(params, MPI.COMM_SELF, lr=1e-2, shard_params=True)
    assert opt.options.units == (("l1", ("l1.w", "l1.b")), ("l2", ("l2.w",)))
    assert opt.options.shard_gradients is True
    assert opt.grad_shard_dtype == np.float32
    with opt.gathered("l1") as p:
        assert (p["l1.w"] == 1).all() and (p["l1.b"] == 0).all()
    opt.close()
    with pytest.raises(ValueError, match="shard_params=1 must be True"):
        ZeroAdamW(params, MPI.COMM_SELF, shard_params=1)
    with pytest.raises(ValueError, match="shard_params=True with offload='cpu' is not "
                                         "supported yet"):
        ZeroAdamW(params, MPI.COMM_SELF, shard_params=True, offload="cpu",
                  param_dtype="bfloat16")
    stage1 = ZeroAdamW(params, MPI.COMM_SELF, units={"all": list(params)})
    with stage1.gathered("all") as p:  # stages 1 and 2: views of the full buffer
        assert p["l2.w"] is not None and (p["l2.w"] == 1).all()
    stage1.close()


@pytest.mark.mpi_independent
def test_a_unit_of_empty_tensors_and_the_counts_of_groups():
    """A unit whose tensors hold no element is one bucket of padding, none of it real; the
    param groups must count the tensors; eight units are named in full, a ninth is not."""
    shapes = {"none": (0, 3), **{f"u{i}.w": (3,) for i in range(8)}}
    layout = build_layout(shapes, 2, "float32", units={"E": ["none"], **{
        f"u{i}": [f"u{i}.w"] for i in range(8)}})
    empty = layout.buckets[layout.unit_named("E").first]
    assert empty.used == 0 and empty.owned_real(0) == empty.owned_real(1) == 0
    assert layout.numel == 24 and sum(layout.owned_real(r) for r in (0, 1)) == 24
    with pytest.raises(ValueError, match=r"param_group_tensors=\[1\] must count the 9 tensors"):
        build_layout(shapes, 2, "float32", param_group_tensors=[1])
    nine = build_layout(shapes, 2, "float32", units={"E": ["none"], **{
        f"u{i}": [f"u{i}.w"] for i in range(8)}})
    with pytest.raises(KeyError) as found:
        nine.unit_named("x")
    assert found.value.args[0].endswith("'u6', ... (opt.options.units)")
    eight = build_layout({f"u{i}.w": (3,) for i in range(8)}, 2, "float32",
                         units={f"u{i}": [f"u{i}.w"] for i in range(8)})
    with pytest.raises(KeyError) as found:
        eight.unit_named("x")
    assert found.value.args[0].endswith("'u7' (opt.options.units)")
