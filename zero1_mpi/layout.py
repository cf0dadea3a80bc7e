"""Where every tensor lives in the flat buffers, and which slice each rank owns.

Pure data: no arrays, no MPI. Tensors are packed back to back, in order, into one flat range,
padded at the end to a multiple of ``world_size * align`` elements. The range is cut into
buckets (the unit of communication) whose sizes are multiples of that quantum, and each bucket
into ``world_size`` equal contiguous shards, so one count serves every rank in
``Reduce_scatter_block`` / ``Allgather``. Tensors may straddle shards and buckets (as in
Megatron-LM and DeepSpeed), so the padding stays below one quantum and the communication scratch
is bounded by the bucket size, whatever the tensor sizes. ``Layout.fingerprint`` lets ranks
check that they built the same layout.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

#: Shards are whole multiples of this many elements (aligned, vector-friendly).
DEFAULT_ALIGN = 64
#: Default bucket size, in elements (4M: 8 MiB of 16-bit gradients; tools/comm_bench.py).
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
    world_size: int

    @property
    def shard_size(self) -> int:
        return self.size // self.world_size

    @property
    def state(self) -> slice:
        """Where this bucket's shard lives in a rank's shard-sized (optimizer state) arrays."""
        start = self.offset // self.world_size
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
    tensors: tuple[TensorSlot, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
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
    def shard_total(self) -> int:
        """Elements one rank owns over all buckets (padding included); equal on every rank."""
        return self.total // self.world_size

    def pieces(self, start: int, stop: int):
        """``(tensor, lo, hi)`` for each tensor overlapping flat ``[start, stop)``, clipped."""
        for t in self.tensors:
            lo, hi = max(start, t.offset), min(stop, t.offset + t.numel)
            if lo < hi:
                yield t, lo, hi

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
        text = repr((self.world_size, self.align, self.dtype,
                     [(t.name, t.shape, t.offset) for t in self.tensors],
                     [(b.offset, b.used, b.size) for b in self.buckets], self.groups))
        return hashlib.sha256(text.encode()).hexdigest()


def build_layout(shapes, world_size: int, dtype: str, *,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
                 align: int = DEFAULT_ALIGN, group_sizes=None) -> Layout:
    """Pack ``shapes`` (an ordered mapping name -> shape) into a padded, bucketed flat range.

    ``group_sizes`` counts the tensors of each param group, in order (default: one group).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if not isinstance(bucket_elements, int) or bucket_elements < 1:
        raise ValueError(f"bucket_elements={bucket_elements!r} must be a positive integer "
                         f"(default {DEFAULT_BUCKET_ELEMENTS})")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r} must be a positive integer (default {DEFAULT_ALIGN})")
    quantum = world_size * align

    tensors, offset = [], 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        tensors.append(TensorSlot(name, tuple(shape), offset, numel))
        offset += numel
    total = max(1, math.ceil(offset / quantum)) * quantum
    bucket_size = math.ceil(bucket_elements / quantum) * quantum
    buckets = tuple(Bucket(index, start, max(0, min(offset - start, size)), size, world_size)
                    for index, start in enumerate(range(0, total, bucket_size))
                    for size in [min(bucket_size, total - start)])
    group_sizes = [len(tensors)] if group_sizes is None else list(group_sizes)
    if sum(group_sizes) != len(tensors) or min(group_sizes, default=0) < 0:
        raise ValueError(f"group_sizes={group_sizes!r} must count the {len(tensors)} tensors")
    bounds, first = [0], 0
    for count in group_sizes[:-1]:
        first += count
        bounds.append(tensors[first].offset if first < len(tensors) else offset)
    bounds.append(total)  # the padding belongs to the last group
    groups = tuple(zip(bounds[:-1], bounds[1:]))
    return Layout(tuple(tensors), buckets, world_size, align, dtype, groups)
