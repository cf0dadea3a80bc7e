"""Where every tensor lives in the flat buffers, and which slice each rank owns.

Pure data: no arrays, no MPI. Tensors are placed back to back (unit by unit, where ``units``
group them: runs of tensors gathered together in stage 3, each beginning a bucket and ending
padded) into one flat range cut into buckets (the unit of communication) of multiples of
``group_size * align`` elements, each bucket into ``group_size`` equal contiguous shards, so one
count serves every rank in ``Reduce_scatter_block`` / ``Allgather``; tensors may straddle
shards and buckets (as in Megatron-LM and DeepSpeed). A tensor's ``packed`` position (back to
back in the order given) and param group are its own, whatever the units: checkpoints record
packed positions. ``Layout.fingerprint`` lets ranks check that they built the same layout.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "Layout",
    "Bucket",
    "TensorSlot",
    "build_layout",
    "check_bucket_elements",
    "check_units",
    "Unit",
    "DEFAULT_ALIGN",
    "DEFAULT_BUCKET_ELEMENTS",
]

#: Shards are whole multiples of this many elements (aligned, vector-friendly).
DEFAULT_ALIGN = 64
#: Default bucket size, in elements (4M: 8 MiB of 16-bit gradients; `tools/bench.py comm`).
DEFAULT_BUCKET_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class TensorSlot:
    """One named tensor: ``numel`` elements at ``offset`` of the flat buffer; ``packed``: its
    position with the tensors back to back in the order given (the same in every layout of
    them), ``group``: its param group's index."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    packed: int = -1
    group: int = 0

    def __post_init__(self):
        if self.packed < 0:
            object.__setattr__(self, "packed", self.offset)


@dataclass(frozen=True)
class Bucket:
    """``size`` elements at ``offset`` (``used`` real ones, then padding), in equal shards."""

    index: int
    offset: int
    used: int
    size: int
    group_size: int
    #: The unit this bucket belongs to (0 without units: one unit of every bucket).
    unit: int = 0

    @property
    def shard_size(self) -> int:
        return self.size // self.group_size

    @property
    def state(self) -> slice:
        """Where this bucket's shard lives in a rank's shard-sized (optimizer state) arrays."""
        start = self.offset // self.group_size
        return slice(start, start + self.shard_size)

    def shard(self, rank: int) -> tuple[int, int]:
        """Flat ``(start, stop)`` of the slice of this bucket that ``rank`` owns."""
        start = self.offset + rank * self.shard_size
        return start, start + self.shard_size

    def owned_real(self, rank: int) -> int:
        """How many real (non-padding) elements ``rank``'s shard of this bucket holds."""
        start, stop = self.shard(rank)
        return max(0, min(stop, self.offset + self.used) - start)


@dataclass(frozen=True)
class Unit:
    """A unit: the tensors gathered together (stage 3), in buckets ``[first, stop)``."""

    name: str
    tensors: tuple[str, ...]
    first: int
    stop: int


@dataclass(frozen=True)
class Layout:
    """The tensors (in flat order) and the buckets, for ``group_size`` shards."""

    tensors: tuple[TensorSlot, ...]
    buckets: tuple[Bucket, ...]
    group_size: int
    align: int
    dtype: str
    #: The units, in order (empty: the tensors packed back to back, no unit given).
    units: tuple[Unit, ...] = ()

    @property
    def given_order(self) -> tuple[TensorSlot, ...]:
        """The tensors in the order given (by ``packed``): what checkpoints record."""
        return tuple(sorted(self.tensors, key=lambda t: t.packed))

    @property
    def numel(self) -> int:
        """Ψ: the number of real parameter elements."""
        return sum(t.numel for t in self.tensors)

    @property
    def total(self) -> int:
        """Elements in each flat buffer, padding included."""
        return sum(b.size for b in self.buckets)

    @property
    def padding(self) -> int:
        return self.total - self.numel

    @property
    def largest_shard(self) -> int:
        """Elements of the largest shard of a bucket: what scratch for one bucket's shard
        holds."""
        return max((b.shard_size for b in self.buckets), default=0)

    @property
    def shard_total(self) -> int:
        """Elements one rank owns over all buckets (padding included); equal on every rank."""
        return self.total // self.group_size

    def pieces(self, start: int, stop: int):
        """``(tensor, lo, hi)`` for each tensor overlapping flat ``[start, stop)``, clipped."""
        for t in self.tensors:
            lo, hi = max(start, t.offset), min(stop, t.offset + t.numel)
            if lo < hi:
                yield t, lo, hi

    def tensor_pieces(self, bucket: Bucket, rank: int) -> list[tuple[int, int, int, int]]:
        """``(tensor index, param group index, a, b)`` for each piece ``[a, b)`` of a tensor in
        ``rank``'s shard of ``bucket`` (positions within the shard; padding left out)."""
        lo, hi = bucket.shard(rank)
        pieces = []
        for index, t in enumerate(self.tensors):
            a, b = max(lo, t.offset), min(hi, t.offset + t.numel)
            if a < b:
                pieces.append((index, t.group, a - lo, b - lo))
        return pieces

    def owned_real(self, rank: int) -> int:
        return sum(b.owned_real(rank) for b in self.buckets)

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """``(start, stop, state_start)`` of each flat range of real elements ``rank`` owns,
        in order, with where that range begins in the rank's shard-sized state arrays."""
        ranges = []
        for bucket in self.buckets:
            start, stop = bucket.shard(rank)
            stop = min(stop, bucket.offset + bucket.used)
            if start < stop:
                ranges.append((start, stop, bucket.state.start))
        return ranges

    def owned_packed(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``owned(rank)`` in packed positions: ``(packed start, packed stop, state_start,
        flat start)`` of each run of an owned range whose packed positions follow each other
        (without units, the owned ranges, where packed and flat positions are one)."""
        runs: list[list[int]] = []
        for start, stop, state in self.owned(rank):
            first = len(runs)
            for t, lo, hi in sorted(self.pieces(start, stop), key=lambda piece: piece[1]):
                packed = t.packed + lo - t.offset
                if len(runs) > first and runs[-1][1] == packed:  # (flat: they follow)
                    runs[-1][1] = packed + hi - lo
                else:
                    runs.append([packed, packed + hi - lo, state + lo - start, lo])
        return [(a, b, c, d) for a, b, c, d in runs]

    def unit_named(self, name: str) -> Unit:
        """The unit called ``name``, or a KeyError naming the units there are."""
        found = next((unit for unit in self.units if unit.name == name), None)
        if found is None:
            known = [unit.name for unit in self.units]
            shown = ", ".join(map(repr, known[:8])) + (", ..." if len(known) > 8 else "")
            raise KeyError(
                f"no unit {name!r}: the units are {shown} (opt.options.units)"
                if known
                else f"no unit {name!r}: the optimizer has no units: pass units= (or "
                "shard_params=True)"
            )
        return found

    def bucket_at(self, position: int) -> int:
        """The index of the bucket holding flat ``position``."""
        return bisect.bisect_right([b.offset for b in self.buckets], position) - 1

    @property
    def fingerprint(self) -> str:
        """A digest of everything that must agree across ranks before the first collective."""
        text = repr(
            (
                self.group_size,
                self.align,
                self.dtype,
                [(t.name, t.shape, t.offset, t.packed, t.group) for t in self.tensors],
                [(b.offset, b.used, b.size) for b in self.buckets],
                [(u.name, u.first, u.stop) for u in self.units],
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()


def check_bucket_elements(value) -> int:
    """``value`` if it is a bucket size in elements (a positive integer), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"bucket_elements={value!r} must be a positive integer "
            f"(default {DEFAULT_BUCKET_ELEMENTS})"
        )
    return value


def check_units(units, names) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """``units`` (None, or a mapping unit name -> the names of its tensors) as
    ``((unit, tensors), ...)``, checked against ``names`` (the tensors, in order): each tensor
    in exactly one unit; else a ValueError naming the unit or tensor and the fix. The units
    come in the order of their first tensor, their tensors in ``names``' order."""
    if units is None:
        return None
    if not isinstance(units, Mapping) or not units:
        raise ValueError(
            f"units={_short(units)} must be None or a non-empty mapping of unit name -> "
            "the names of its tensors, e.g. {'layer1': ['w1', 'b1'], 'layer2': ['w2', 'b2']}"
        )
    head = f"units={_short(units)}"
    known, order, checked = set(names), {n: i for i, n in enumerate(names)}, []
    seen: dict[str, str] = {}
    for unit, members in units.items():
        if not isinstance(unit, str) or isinstance(members, (str, bytes)):
            raise ValueError(
                f"{head}: unit {unit!r} -> {_short(members)}: a unit is a string naming a "
                "list of tensor names"
            )
        members = tuple(members) if isinstance(members, Iterable) else None
        if not members:
            raise ValueError(f"{head}: unit {unit!r} names no tensor: give it at least one")
        for name in members:
            if name not in known:
                raise ValueError(
                    f"{head}: unit {unit!r} names {name!r}, which is not a parameter "
                    f"(the parameters are {_short(list(names))})"
                )
            if name in seen:
                raise ValueError(
                    f"{head}: tensor {name!r} is in unit {seen[name]!r} and in {unit!r}: put "
                    "each tensor in one unit (a tensor two layers share: in a unit of its own)"
                )
            seen[name] = unit
        positions = sorted(order[n] for n in members)
        checked.append((unit, tuple(names[p] for p in positions)))
    missing = [n for n in names if n not in seen]
    if missing:
        raise ValueError(
            f"{head}: tensor {missing[0]!r} is in no unit ({len(missing)} are not): every "
            "tensor must be in one unit"
        )
    checked.sort(key=lambda unit: order[unit[1][0]])
    return tuple(checked)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def build_layout(
    shapes,
    group_size: int,
    dtype: str,
    *,
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
    align: int = DEFAULT_ALIGN,
    param_group_tensors=None,
    units=None,
) -> Layout:
    """Pack ``shapes`` (an ordered mapping name -> shape) into a padded, bucketed flat range.

    ``group_size`` is the number of shards per bucket (the ranks the state is sharded over);
    ``param_group_tensors`` counts the tensors of each param group, in order (default: one
    group); ``units`` (``check_units``' input) groups the tensors into units of whole buckets.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    check_bucket_elements(bucket_elements)
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r} must be a positive integer (default {DEFAULT_ALIGN})")
    quantum = group_size * align
    bucket_size = math.ceil(bucket_elements / quantum) * quantum
    names = list(shapes)
    counts = [len(names)] if param_group_tensors is None else list(param_group_tensors)
    if sum(counts) != len(names) or min(counts, default=0) < 0:
        raise ValueError(f"param_group_tensors={counts!r} must count the {len(names)} tensors")
    group_of = [g for g, count in enumerate(counts) for _ in range(count)]
    packed_at = list(itertools.accumulate((math.prod(shapes[n]) for n in names), initial=0))
    index = {name: i for i, name in enumerate(names)}
    grouped = check_units(units, names)
    runs = grouped or (("", tuple(names)),)

    tensors: list[TensorSlot] = []
    buckets: list[Bucket] = []
    unit_list: list[Unit] = []
    offset = 0
    for u, (unit, members) in enumerate(runs):
        start, first = offset, len(buckets)
        for name in members:
            i = index[name]
            numel = math.prod(shapes[name])
            slot = TensorSlot(name, tuple(shapes[name]), offset, numel, packed_at[i], group_of[i])
            tensors.append(slot)
            offset += numel
        used_total = offset - start
        total = max(1, math.ceil(used_total / quantum)) * quantum
        for at in range(start, start + total, bucket_size):
            size = min(bucket_size, start + total - at)
            used = max(0, min(start + used_total - at, size))
            buckets.append(Bucket(len(buckets), at, used, size, group_size, u))
        offset = start + total
        unit_list.append(Unit(unit, members, first, len(buckets)))
    kept_units = tuple(unit_list) if grouped is not None else ()
    return Layout(tuple(tensors), tuple(buckets), group_size, align, dtype, kept_units)
