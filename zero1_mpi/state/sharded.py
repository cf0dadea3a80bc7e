"""The sharded state: this rank's full copy of the parameters, and for its own shard the master
weights and the rule's state, with the kernel that updates them.

``ShardedState`` composes a placement (``placement.py``: beside the parameters, or a share
offloaded to the host) that keeps the shard and its kernels; ``sharded_state`` builds one. Its
interface is all the rest of the package sees: ``params`` (views by name), ``rows``, ``views``,
``write`` (what checkpoints and exports read and write, then ``publish()``), ``seed(arrays)``
(rank 0's initial values), ``update(reduced, scalars, step)`` (the rule's kernel over each of
``parts``, each bucket's all-gather started as its shard lands) and ``wait()`` for those
gathers. It knows no rule's math. Methods that start or complete collectives: all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from ..flat.views import Closed
from ..kernels import backend
from ..wire.param_gathers import ParamGathers, param_buffer, param_gathers
from ..wire.unit_gathers import OwnedParams
from .host import each_tensor_sums
from .placement import OffloadedShare, ShardSpec, WithParams, placement_for

__all__ = ["ShardedState", "sharded_state", "FP32"]

FP32 = np.dtype(np.float32)


class ShardedState:
    """The parameters and this rank's shard of the optimizer state, kept with the parameters.

    Args:
        layout, topology: the flat layout and the shard groups (``topology.Topology``).
        rule: the update rule (``zero1_mpi.rules.protocol.Rule``); its kernel runs here.
        xp: the parameters' array module (NumPy or CuPy).
        watch: the ``Watchdog`` told where this rank waits; ``counters``: the step's
            ``Counters`` (the step a wait belongs to).
        options: the checked ``EngineOptions`` (dtype, masters, state encoding, gathers,
            offload); ``kernels``: the ``KernelFamilies`` that run the update.
    """

    def __init__(self, layout, topology, rule, xp, watch, counters, options, kernels):
        dtype = options.param_dtype
        self.layout, self.topology, self.rule, self.dtype = layout, topology, rule, dtype
        self.shard_rank, self.watch, self._xp = topology.shard_rank, watch, xp
        self._counters = counters
        self.mixed = dtype != FP32
        #: Whether this rank keeps only its shard of the parameters (stage 3).
        self.params_sharded = options.shard_params
        self.state_dtype = options.state_dtype
        #: The flat parameter buffer (every rank's full copy; with ``shard_params`` this
        #: rank's shard, ``OwnedParams``); ``params``: the views by name.
        self.flat = param_buffer(options, layout, self.shard_rank, xp)
        largest = layout.largest_shard
        #: Each bucket's tensor pieces on this rank: ``(tensor, group, a, b)``, ``[a, b)`` in
        #: the bucket's shard; a two-phase rule's calls, and the 8-bit state's segments.
        self._pieces = [layout.tensor_pieces(b, self.shard_rank) for b in layout.buckets]
        #: Where the shard lives and what updates it there (``placement.py``).
        self.place: WithParams | OffloadedShare = placement_for(
            options,
            ShardSpec(
                layout=layout,
                shard_rank=self.shard_rank,
                pieces=self._pieces,
                flat=self.flat,
                mixed=self.mixed,
                rule=rule,
                xp=xp,
                kernels=kernels,
                masters_kind=options.masters,
                state_dtype=options.state_dtype,
            ),
        )
        #: What the update runs over, in order: ranges of a bucket's shard (each a ``ShardRange``).
        self.parts = self.place.parts
        #: Each part's tensor pieces, and its elementwise kernel calls: ``(param group, a, b)``,
        #: per group, or per tensor piece for the 8-bit state (whose blocks start at each).
        self._part_pieces = [
            [p for p in self._pieces[part.bucket.index] if part.a <= p[2] < part.b]
            for part in self.parts
        ]
        self._ranges = [
            [(g, a, b) for _, g, a, b in pieces]
            if self.state_dtype == "int8"
            else _group_runs(part, pieces)
            for part, pieces in zip(self.parts, self._part_pieces)
        ]
        #: The most elements one kernel call takes (remainder masters: a cache-sized chunk).
        kept = [self.masters, *self.stored.values()]
        self._chunk = max(1, min([largest] + [k.chunk for k in kept if k is not None]))
        self._step = 0  # the step being updated (stochastic rounding draws by it)
        self.gathers: ParamGathers = param_gathers(
            options, layout, self.flat, topology.shard_comm, watch, xp, self.place.kernel_kind
        )
        self.params: Mapping = self.gathers.views(self.wait)  # gathers done first

    on_host = property(lambda self: self.place.on_host, doc="Whether a share is on the host.")
    masters = property(lambda self: self.place.masters, doc="The masters (None: fp32 params).")
    stored = property(lambda self: self.place.stored, doc="The rule's state rows, by name.")
    kernel_kind = property(lambda self: self.place.kernel_kind, doc="The update's kernel family.")

    # -- what checkpoints and exports read and write -------------------------------------------

    @property
    def rows(self) -> tuple[str, ...]:
        """The names of the views ``views`` gives, in order: ``"master"``, the rule's
        ``state_names``, and for 16-bit parameters ``"param"`` (what checkpoints store)."""
        return ("master", *self.rule.state_names) + (("param",) if self.mixed else ())

    @property
    def writes(self) -> bool:
        """Whether this rank writes its shard to a checkpoint (the first shard group does)."""
        return self.topology.replica == 0

    def views(self, lo: int, hi: int, state: int, names=None) -> dict:
        """This rank's state over the flat range ``[lo, hi)``, a range it owns that starts at
        ``state`` in its shard arrays (``layout.owned(shard_rank)`` lists them): by name for
        each of ``rows`` (or of ``names``), an fp32 array (a view, or a copy decoded where a
        row is kept otherwise) or the 16-bit ``param``. ``write`` changes them, then
        ``publish()``."""
        s, param = slice(state, state + hi - lo), self.flat[lo:hi]
        views = {}
        for name in self.rows if names is None else names:
            if name == "param":
                views[name] = param
            elif name == "master":
                views[name] = param if self.masters is None else self.masters.read(s, param)
            else:
                views[name] = self.stored[name].read(s)
        return views

    def write(self, lo: int, hi: int, state: int, values: dict) -> None:
        """Set the rows of ``values`` (by name, fp32 or wider values) over ``[lo, hi)`` as
        ``views`` names them; with ``"master"`` and no ``"param"``, the 16-bit parameters
        become the masters rounded (remainder masters always round them). Exact casts;
        ``publish()`` after."""
        s, param = slice(state, state + hi - lo), self.flat[lo:hi]
        for name, value in values.items():
            if name in self.stored:
                self.stored[name].write(s, value)
        if "master" not in values:
            return
        if self.masters is None:  # fp32 parameters: the parameter is the master
            param[...] = backend.like(param, values["master"])
            return
        self.masters.write(s, values["master"], param, values.get("param"))

    def gathered(self, unit: str):
        """A context giving unit ``unit``'s tensors by name: the gathers' (in flight ones
        completed first). All ranks."""
        self.wait()
        return self.gathers.gathered(unit)

    def publish(self) -> None:
        """All-gather the parameters, blocking, after ``views`` were written; all ranks."""
        self.gathers.gather_all()

    def seed(self, arrays: dict) -> None:
        """Broadcast rank 0's ``arrays`` (by name) into the parameters, bucket by bucket; fp32
        (or wider) values seed the fp32 masters at full precision. All ranks."""
        xp, layout, comm = self._xp, self.layout, self.topology.comm
        whole = not isinstance(self.flat, OwnedParams)  # (else: this rank's shard alone)
        staging = None
        if self.mixed or not whole:
            staging = xp.zeros(max(b.size for b in layout.buckets), FP32)
        for bucket in layout.buckets:
            span = slice(bucket.offset, bucket.offset + bucket.size)
            target = self.flat[span] if staging is None else staging[: bucket.size]
            target[bucket.used :] = 0  # the padding (the reused staging held the last bucket)
            if comm.rank == 0:
                for t, lo, hi in layout.pieces(bucket.offset, bucket.offset + bucket.size):
                    values = xp.asarray(arrays[t.name]).reshape(-1)
                    target[lo - bucket.offset : hi - bucket.offset] = values[
                        lo - t.offset : hi - t.offset
                    ]
            comm.bcast(target)
            if staging is not None:
                lo, hi = (span.start, span.stop) if whole else bucket.shard(self.shard_rank)
                self.flat[lo:hi] = target[lo - span.start : hi - span.start].astype(self.dtype)
            if self.masters is not None:
                lo, hi = bucket.shard(self.shard_rank)
                piece = target[lo - bucket.offset : hi - bucket.offset]
                param = self.flat[lo:hi] if self.mixed else None  # (rounded above: again)
                self.masters.write(bucket.state, piece, param)

    # -- the update ------------------------------------------------------------------------------

    def update(self, reduced: list, scalars: list, step: int) -> tuple[float, float]:
        """Run the rule's kernel over this rank's shard of every bucket (``reduced``: the
        summed gradient shards; ``scalars``: each param group's, for ``step``), starting each
        bucket's all-gather as its new shard lands. Returns the seconds spent updating and
        starting gathers. A two-phase rule first sums over each tensor (one Allreduce)."""
        clock, update = time.perf_counter, 0.0
        self._step = step
        shards: list | None = reduced  # None: a second phase reads no gradients
        kernel_scalars: list | dict = scalars  # a two-phase rule's: by tensor
        if self.rule.tensor_sums:
            t0 = clock()
            kernel_scalars = self._per_tensor_scalars(self.place.inputs(reduced), scalars, step)
            update, shards = clock() - t0, None
        gather, t0 = 0.0, clock()  # (offloaded, the wait for a gradient's copy is update's)
        for part, grads in self.place.inputs(shards):
            self.watch.bucket = part.bucket.index
            self._update_part(part, grads, kernel_scalars)
            t1 = clock()
            for index in self.place.landed(part):
                self.gathers.start(index)
            t2 = clock()
            update, gather, t0 = update + t1 - t0, gather + t2 - t1, t2
        for index in self.place.landed(None):
            self.gathers.start(index)
        return update, gather + clock() - t0

    def scratch_bytes(self) -> tuple[int, int]:
        """Bytes held for the update beside the arrays: ``(with the parameters, on the host)``."""
        device, host = self.place.scratch_bytes()
        return device + self.gathers.scratch_bytes, host

    def host_bytes(self, owned: int) -> tuple[int, int, float]:
        """``(held, real, share)``: the bytes of the masters and state kept on the host
        (offload), those of their real elements, and the share of this rank's ``owned`` real
        elements they hold."""
        return self.place.host_bytes(owned)

    def wait(self) -> None:
        """Complete the all-gathers in flight: before the parameters are read (``params``'
        views call it), saved or reduced again. Timed by the watchdog as the last step's
        gather where no step is timed already; a rank that fails here ends the job (the others
        would wait forever). All ranks."""
        armed = self.watch.arm(self._counters.step, "gather")
        try:
            with self.topology.comm.abort_on_error("while gathering the parameters"):
                self.gathers.wait()
        finally:
            if armed:
                self.watch.disarm()

    def close(self) -> None:
        """Complete the gathers in flight and free what they and the placement hold; the
        views, which call ``wait``, let go of the state (idempotent; all ranks)."""
        self.place.close()
        self.gathers.close()
        self.params = Closed(type(self).__name__)  # (a reference cycle otherwise)

    # -- internals ---------------------------------------------------------------------------

    def _stored(self, bucket, a: int, b: int, master, param, states=None) -> None:
        """Keep what the kernel wrote over ``[a, b)`` of ``bucket`` (the placement's ``arrays``; the
        ``states`` where it wrote them)."""
        st = slice(bucket.state.start + a, bucket.state.start + b)
        if param is not None:
            self.masters.store(st, master, param)
        if states is not None:
            flat = bucket.shard(self.shard_rank)[0] + a
            for kept, values in zip(self.stored.values(), states):
                kept.store(st, values, flat, self._step)

    def _update_part(self, part, grads, scalars) -> None:
        """Update ``part`` (``grads`` from its start): per param group, or per tensor piece (a
        two-phase rule; the 8-bit state, whose blocks start at each piece)."""
        bucket, kernel = part.bucket, self.place.kernel_of(part)
        if self.rule.tensor_sums:
            for index, _, a, b in self._part_pieces[part.index]:
                for c, d in self._calls(a, b):
                    master, states, param = self.place.arrays(bucket, c, d, 0, self.gathers)
                    kernel.apply(master, *states, param, scalars[index])
                    self._stored(bucket, c, d, master, param)
            return
        place = self.place
        for group, a, b in self._ranges[part.index]:
            for c, d in self._calls(a, b):
                if isinstance(place, WithParams) and place.fused:  # stored forms, one pass
                    g = grads[c - part.a : d - part.a]
                    place.update_fused(bucket, c, d, g, scalars[group], self.gathers, self._step)
                    continue
                master, states, param = self.place.arrays(bucket, c, d, 0, self.gathers)
                kernel(grads[c - part.a : d - part.a], master, *states, param, scalars[group])
                self._stored(bucket, c, d, master, param, states)

    def _calls(self, a: int, b: int):
        """``[a, b)`` cut into the ranges of one elementwise kernel call each (the bits do
        not depend on the cut)."""
        return ((c, min(b, c + self._chunk)) for c in range(a, b, self._chunk))

    def _per_tensor_scalars(self, shards, scalars, step: int) -> dict:
        """Phase one of a two-phase rule: the kernel's partial sums over each tensor piece
        this rank owns (updating the rule's state), added per tensor, summed over the group in
        one ``Allreduce``; returns the scalars (``rule.tensor_scalars``) of each tensor this
        rank owns a piece of, by tensor index (``shards``: as the placement's ``inputs`` gives
        them)."""
        all_pieces = self._pieces
        sums = self.place.sums_xp.zeros(
            (len(self.layout.tensors), self.rule.tensor_sums), np.float64
        )
        for part, grads in shards:
            calls, bucket, pieces = [], part.bucket, self._part_pieces[part.index]
            for _, group, a, b in pieces:
                master, states, _ = self.place.arrays(
                    bucket, a, b, a, self.gathers
                )  # whole: one sum a piece
                calls.append((grads[a - part.a : b - part.a], master, *states, scalars[group]))
            for (index, _, a, b), partial, call in zip(
                pieces, each_tensor_sums(self.place.kernel_of(part), calls), calls
            ):
                sums[index] += backend.like(sums, partial)
                self._stored(bucket, a, b, None, None, call[2:-1])  # the state it updated
        totals = backend.to_numpy(sums)
        if self.topology.group_size > 1:  # the group's shards cover every tensor once
            self.watch.arm(step, "update")
            totals = self.topology.shard_comm.allreduce_sum(totals)
            self.watch.disarm()
        return {
            index: self.rule.tensor_scalars(scalars[group], totals[index])
            for pieces in all_pieces
            for index, group, _, _ in pieces
        }


def _group_runs(part, pieces) -> list[tuple[int, int, int]]:
    """``(param group, a, b)``: ``part``'s tensor pieces (``(tensor, group, a, b)``, in order)
    merged where they follow each other in one group, each clipped to the part."""
    runs: list[list[int]] = []
    for _, group, a, b in pieces:
        a, b = max(a, part.a), min(b, part.b)
        if runs and runs[-1][0] == group and runs[-1][2] == a:
            runs[-1][2] = b
        elif a < b:
            runs.append([group, a, b])
    return [(g, a, b) for g, a, b in runs]


def sharded_state(options, layout, topology, rule, xp, watch, counters, kernels) -> ShardedState:
    """The sharded state of the checked ``options`` (``options.EngineOptions``), updated by
    ``kernels`` (``KernelFamilies``)."""
    return ShardedState(layout, topology, rule, xp, watch, counters, options, kernels)
