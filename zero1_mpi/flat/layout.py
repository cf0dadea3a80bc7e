"""Where every tensor lives in the flat buffers, and which slice each rank owns.

Pure data: no arrays, no MPI. Tensors are packed back to back, in order, into one flat range,
padded at the end to a multiple of ``group_size * align`` elements (``group_size``: the ranks
the state is sharded over). The range is cut into buckets (the unit of communication) whose
sizes are multiples of that quantum, and each bucket into ``group_size`` equal contiguous
shards, so one count serves every rank in ``Reduce_scatter_block`` / ``Allgather``. Tensors
may straddle shards and buckets (as in Megatron-LM and DeepSpeed), so the padding stays below
one quantum and the communication scratch is bounded by the bucket size.
``Layout.fingerprint`` lets ranks check that they built the same layout.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

__all__ = [
    "Layout",
    "Bucket",
    "TensorSlot",
    "build_layout",
    "check_bucket_elements",
    "DEFAULT_ALIGN",
    "DEFAULT_BUCKET_ELEMENTS",
]

#: Shards are whole multiples of this many elements (aligned, vector-friendly).
DEFAULT_ALIGN = 64
#: Default bucket size, in elements (4M: 8 MiB of 16-bit gradients; `tools/bench.py comm`).
DEFAULT_BUCKET_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class TensorSlot:
    """One named tensor: ``numel`` elements at ``offset`` of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """``size`` elements at ``offset`` (``used`` real ones, then padding), in equal shards."""

    index: int
    offset: int
    used: int
    size: int
    group_size: int

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
class Layout:
    """The tensors, the buckets and the param groups' flat ranges, for ``group_size`` shards."""

    tensors: tuple[TensorSlot, ...]
    buckets: tuple[Bucket, ...]
    group_size: int
    align: int
    dtype: str
    #: Flat ``(start, stop)`` of each param group: consecutive, covering ``[0, total)``.
    groups: tuple[tuple[int, int], ...] = ()

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
        starts = [group_lo for group_lo, _ in self.groups]
        pieces = []
        for index, t in enumerate(self.tensors):
            a, b = max(lo, t.offset), min(hi, t.offset + t.numel)
            if a < b:
                group = sum(start <= t.offset for start in starts) - 1
                pieces.append((index, group, a - lo, b - lo))
        return pieces

    def owned_real(self, rank: int) -> int:
        return sum(b.owned_real(rank) for b in self.buckets)

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """``(start, stop, state_start)`` of each flat range of real elements ``rank`` owns,
        in order, with where that range begins in the rank's shard-sized state arrays."""
        ranges = []
        for bucket in self.buckets:
            start, stop = bucket.shard(rank)
            stop = min(stop, self.numel)
            if start < stop:
                ranges.append((start, stop, bucket.state.start))
        return ranges

    @property
    def fingerprint(self) -> str:
        """A digest of everything that must agree across ranks before the first collective."""
        text = repr(
            (
                self.group_size,
                self.align,
                self.dtype,
                [(t.name, t.shape, t.offset) for t in self.tensors],
                [(b.offset, b.used, b.size) for b in self.buckets],
                self.groups,
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


def build_layout(
    shapes,
    group_size: int,
    dtype: str,
    *,
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
    align: int = DEFAULT_ALIGN,
    param_group_tensors=None,
) -> Layout:
    """Pack ``shapes`` (an ordered mapping name -> shape) into a padded, bucketed flat range.

    ``group_size`` is the number of shards per bucket (the ranks the state is sharded over);
    ``param_group_tensors`` counts the tensors of each param group, in order (default: one group).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    check_bucket_elements(bucket_elements)
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r} must be a positive integer (default {DEFAULT_ALIGN})")
    quantum = group_size * align

    tensors, offset = [], 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        tensors.append(TensorSlot(name, tuple(shape), offset, numel))
        offset += numel
    total = max(1, math.ceil(offset / quantum)) * quantum
    bucket_size = math.ceil(bucket_elements / quantum) * quantum
    buckets = tuple(
        Bucket(index, start, max(0, min(offset - start, size)), size, group_size)
        for index, start in enumerate(range(0, total, bucket_size))
        for size in [min(bucket_size, total - start)]
    )
    counts = [len(tensors)] if param_group_tensors is None else list(param_group_tensors)
    if sum(counts) != len(tensors) or min(counts, default=0) < 0:
        raise ValueError(f"param_group_tensors={counts!r} must count the {len(tensors)} tensors")
    bounds, first = [0], 0
    for count in counts[:-1]:
        first += count
        bounds.append(tensors[first].offset if first < len(tensors) else offset)
    bounds.append(total)  # the padding belongs to the last group
    groups = tuple(itertools.pairwise(bounds))
    return Layout(tuple(tensors), buckets, group_size, align, dtype, groups)
