"""ZeRO stage 3's parameters: each rank keeps only its shard; a unit is gathered whole while used.

``OwnedParams``: this rank's shard in one shard-sized array, addressed by flat positions as the
full buffer is (``params[lo:hi]``, a range it owns: what placements and checkpoints index).
``UnitGathers`` is stage 3's ``ParamGathers``: the update writes the shard in place and gathers
nothing; ``gathered(unit)`` all-gathers a unit into a pooled working buffer, read-only views by
name for the block (nested blocks share it). Opening the unit at position ``k`` of the order
the last step opened them in starts the gather of the one at ``k + 1`` (prefetch); an order
that changes completes and drops the prefetch and gathers what is asked (correct, no hang).
Methods that gather (``gathered``, ``start`` of an open unit, ``gather_all``, ``close``): all
ranks, in the same order."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..comm.watchdog import Watchdog
from ..kernels import backend

__all__ = ["OwnedParams", "UnitGathers", "UnitViews", "check_shard_params", "default_units"]


class OwnedParams:
    """This rank's shard (``rank``) of every bucket of ``layout``, in flat positions."""

    def __init__(self, layout, rank: int, xp, dtype):
        self.layout, self.rank = layout, rank
        #: The shard of every bucket, back to back (as the state arrays hold theirs).
        self.local = backend.zeros(xp, layout.shard_total, dtype)
        self.dtype, self.nbytes = self.local.dtype, self.local.nbytes

    def __getitem__(self, key: slice):
        """The view of flat ``[key.start, key.stop)``, a range of one bucket's owned shard."""
        start, stop = key.start, key.stop
        bucket = self.layout.buckets[self.layout.bucket_at(start)]
        lo, hi = bucket.shard(self.rank)
        if key.step is not None or not lo <= start <= stop <= hi:
            raise IndexError(
                f"flat [{start}, {stop}) is not in rank {self.rank}'s shard [{lo}, {hi}) of "
                f"bucket {bucket.index}: with shard_params=True a rank holds only its shard"
            )
        at = bucket.state.start + start - lo
        return self.local[at : at + stop - start]

    def __setitem__(self, key: slice, value) -> None:
        self[key][...] = value


@dataclass
class _Open:
    """A unit in a working buffer: gathered (``requests`` done) or still travelling."""

    unit: int
    buffer: Any
    views: dict
    requests: list = field(default_factory=list)
    users: int = 0


class UnitGathers:
    """The stage-3 gathers of ``owned`` (an ``OwnedParams``) over ``shard_comm``, by unit."""

    exact = True

    def __init__(self, layout, owned: OwnedParams, shard_comm, watch: Watchdog, xp):
        self.layout, self._owned, self._comm, self._watch, self._xp = (
            layout,
            owned,
            shard_comm,
            watch,
            xp,
        )
        self._by_name = {unit.name: index for index, unit in enumerate(layout.units)}
        self._unit_of = {t: index for index, unit in enumerate(layout.units) for t in unit.tensors}
        self._largest = max(_size(layout, unit) for unit in layout.units)
        self._tensors = [
            [t for t in layout.tensors if t.name in set(u.tensors)] for u in layout.units
        ]
        self._pool: list = []  # free working buffers
        self._made = 0  # working buffers allocated (the working set's high-water mark)
        self._open: dict[int, _Open] = {}
        self._prefetched: _Open | None = None
        #: The order the last step opened its units in; this step's so far.
        self.order: list[int] = []
        self._recording: list[int] = []
        self._on_track = True
        #: Prefetches completed and dropped because the order changed (each a wasted gather).
        self.dropped = 0
        self._release = weakref.finalize(self, shard_comm.close, None)

    # -- as ParamGathers, for the update and the checkpoints ------------------------------

    @property
    def in_flight(self) -> int:
        """How many units' gathers are travelling (a prefetch not yet waited for)."""
        return int(self._prefetched is not None and bool(self._prefetched.requests))

    @property
    def scratch_bytes(self) -> int:
        """The working buffers allocated (each the largest unit's size)."""
        return self._made * self._largest * self._owned.dtype.itemsize

    def target(self, bucket):
        """Where the kernel writes this rank's new shard of ``bucket``: the shard itself."""
        lo, hi = bucket.shard(self._owned.rank)
        return self._owned[lo:hi]

    def start(self, index: int) -> None:
        """Bucket ``index`` was updated: a new step's order begins; a unit open across the
        step gathers that bucket again (its views show the new values)."""
        self._new_step()
        bucket = self.layout.buckets[index]
        entry = self._open.get(bucket.unit)
        if entry is not None:
            self._gather_bucket(entry, bucket).wait()

    def wait(self) -> None:
        """Nothing waits after an update (no gather starts there)."""

    def gather_all(self) -> None:
        """After the shard was written (a load): every open unit gathered again."""
        self._new_step()
        for entry in self._open.values():
            self._gather(entry)

    def close(self) -> None:
        """Complete a prefetch in flight and free the persistent requests; idempotent."""
        self._drop_prefetch()
        self._open.clear()
        self._pool.clear()
        self._release()

    # -- the units -----------------------------------------------------------------------

    def views(self, before_read=None) -> UnitViews:
        return UnitViews(self)

    def unit_of(self, name: str) -> str:
        return self.layout.units[self._unit_of[name]].name

    def is_open(self, name: str) -> dict | None:
        """The open unit holding tensor ``name``'s views, or None."""
        entry = self._open.get(self._unit_of[name])
        return None if entry is None else entry.views

    @contextlib.contextmanager
    def gathered(self, unit: str):
        """``with gathered("block3") as p:`` ``p[name]``: the unit's full tensors (read-only
        views of a working buffer) until the block ends; all ranks, the same units in the same
        order."""
        views = self.acquire(unit)
        try:
            yield views
        finally:
            self.release(unit)

    def acquire(self, unit: str, writable: bool = False) -> dict:
        """Unit ``unit`` gathered (or, open already, one more user of it): its tensors by name,
        read-only views of its working buffer (``writable``: views that a framework binding
        may wrap). Each ``acquire`` is ended by a ``release``; all ranks, in the same order."""
        index = self._index(unit)
        entry = self._open.get(index)
        if entry is None:
            entry = self._acquire(index)
        entry.users += 1
        if not writable:
            return entry.views
        start = self.layout.buckets[self.layout.units[index].first].offset
        return {
            t.name: entry.buffer[t.offset - start : t.offset - start + t.numel].reshape(t.shape)
            for t in self._tensors[index]
        }

    def release(self, unit: str) -> None:
        """One user of ``unit`` done; the last gives its working buffer back to the pool."""
        index = self._index(unit)
        entry = self._open.get(index)
        if entry is None:
            raise RuntimeError(f"release({unit!r}): the unit is not gathered")
        entry.users -= 1
        if entry.users == 0:
            del self._open[index]
            self._pool.append(entry.buffer)

    # -- internals -------------------------------------------------------------------------

    def _index(self, unit) -> int:
        index = self._by_name.get(unit)
        return self._by_name[self.layout.unit_named(unit).name] if index is None else index

    def _acquire(self, index: int) -> _Open:
        """Unit ``index`` gathered: the prefetched one where it is, else gathered now; then
        the next unit of the recorded order prefetched."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched.unit == index:
            entry = prefetched
            self._wait(entry)
        else:
            if prefetched is not None:  # the order changed: a correct, slower path
                self._wait(prefetched)
                self._pool.append(prefetched.buffer)
                self.dropped += 1
            entry = self._start(index)
            self._wait(entry)
        self._open[index] = entry
        k = len(self._recording)
        self._on_track = self._on_track and k < len(self.order) and self.order[k] == index
        self._recording.append(index)
        if self._on_track and k + 1 < len(self.order):
            following = self.order[k + 1]
            if following not in self._open:
                self._prefetched = self._start(following)
        return entry

    def _start(self, index: int) -> _Open:
        """Start gathering unit ``index`` into a working buffer."""
        unit = self.layout.units[index]
        buffer = self._pool.pop() if self._pool else self._new_buffer()
        start = self.layout.buckets[unit.first].offset
        views = {}
        for t in self._tensors[index]:
            view = buffer[t.offset - start : t.offset - start + t.numel].reshape(t.shape)
            if isinstance(view, np.ndarray):
                view.flags.writeable = False  # written by the optimizer alone
            views[t.name] = view
        entry = _Open(index, buffer, views)
        self._gather(entry, wait=False)
        return entry

    def _gather(self, entry: _Open, wait: bool = True) -> None:
        unit = self.layout.units[entry.unit]
        entry.requests = [
            self._gather_bucket(entry, self.layout.buckets[b]) for b in range(unit.first, unit.stop)
        ]
        if wait:
            self._wait(entry)

    def _gather_bucket(self, entry: _Open, bucket):
        """Copy this rank's shard of ``bucket`` into ``entry``'s buffer, start its gather."""
        start = self.layout.buckets[self.layout.units[entry.unit].first].offset
        lo, hi = bucket.shard(self._owned.rank)
        buffer = entry.buffer
        buffer[lo - start : hi - start] = self._owned[lo:hi]
        self._watch.bucket = bucket.index
        return self._comm.start_allgather(
            buffer[bucket.offset - start : bucket.offset - start + bucket.size]
        )

    def _wait(self, entry: _Open) -> None:
        self._watch.phase = "gather"
        for request in entry.requests:
            request.wait()
        entry.requests = []

    def _drop_prefetch(self) -> None:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            self._wait(prefetched)
            self._pool.append(prefetched.buffer)

    def _new_step(self) -> None:
        """At a step's update: this step's order becomes the one to prefetch along."""
        self._drop_prefetch()
        if self._recording:
            self.order, self._recording = self._recording, []
        self._on_track = True

    def _new_buffer(self):
        self._made += 1
        return backend.zeros(self._xp, self._largest, self._owned.dtype)


class UnitViews(Mapping):
    """``opt.params`` with ``shard_params``: a tensor's view while its unit is gathered."""

    def __init__(self, gathers: UnitGathers):
        self._gathers, self._names = gathers, [t.name for t in gathers.layout.tensors]

    def __getitem__(self, name):
        views = self._gathers.is_open(name) if name in self._gathers._unit_of else None
        if views is None:
            if name not in self._gathers._unit_of:
                raise KeyError(name)
            raise KeyError(
                f"opt.params[{name!r}]: with shard_params=True a rank holds only its shard; "
                f"read it inside `with opt.gathered({self._gathers.unit_of(name)!r}) as p:`"
            )
        return views[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def _size(layout, unit) -> int:
    return sum(layout.buckets[b].size for b in range(unit.first, unit.stop))


def default_units(names) -> dict:
    """The units of ``names`` when none are given: the tensors that share a name up to its
    last ``.`` (a module's), each run of them a unit; a name without ``.`` a unit of its own."""
    units: dict = {}
    previous = current = None
    for name in names:
        prefix = name.rpartition(".")[0] or name
        if prefix != previous:
            current, n = prefix, 2
            while current in units:
                current, n = f"{prefix}#{n}", n + 1
            units[current], previous = [], prefix
        units[current].append(name)
    return units


# -- the engine option this module owns (declared in config/options.py) ---------------


def check_shard_params(value, checked):
    if not isinstance(value, bool):
        raise ValueError(
            f"shard_params={value!r} must be True (ZeRO stage 3: the parameters sharded "
            "too, gathered a unit at a time) or False"
        )
    if value and checked["gather_dtype"] is not None:
        raise ValueError(
            f"shard_params=True with gather_dtype={checked['gather_dtype']!r}: the 8-bit "
            "gathers send each step's change against a copy every rank holds, which stage 3 "
            "does not keep: drop gather_dtype"
        )
    if value and checked["offload"] is not None:
        raise ValueError(
            "shard_params=True with offload='cpu' is not supported yet: drop one of them"
        )
    return value
