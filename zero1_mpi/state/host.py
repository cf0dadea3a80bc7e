"""State offload: this rank's fp32 master weights and rule state on the host, updated there,
while the device keeps the parameters, gradients and communication scratch (ZeRO-Offload).

``HostShard`` owns the host arrays of the shard's positions from ``start`` on, and the copies:
``fetched(parts, reduced)`` brings each host part's reduced gradients into one of two host slots,
the next part's copy in flight while this one is updated; ``push(part)`` sends its new
parameters back and returns the buckets whose copies are complete (their all-gathers may
start). CuPy parameters: page-locked slots and two copy streams of the shard's own. NumPy
parameters: the same steps as explicit host copies. ``ThreadedKernel`` splits a host kernel
over threads, bitwise the one-thread kernel.
"""

from __future__ import annotations

import functools
import numbers
import os
import weakref
from collections import deque
from typing import Any

import numpy as np

from ..kernels import backend

__all__ = [
    "HostShard",
    "DeviceHostRow",
    "ParamsAsMasters",
    "ThreadedKernel",
    "host_start",
    "keeps_host_share",
    "resolve_threads",
    "each_tensor_sums",
    "check_offload",
    "check_offload_threads",
    "check_offload_fraction",
]

FP32 = np.dtype(np.float32)


def resolve_threads(value, local_ranks: int) -> int:
    """The host kernel's threads for ``offload_threads=value``: None means the cores this rank
    may use (its CPU affinity, or where it is not bound, the node's cores divided among its
    ``local_ranks`` ranks)."""
    if value is None:
        cores = os.cpu_count() or 1
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
        if usable >= cores:  # not bound by the launcher: share the node
            usable //= max(1, local_ranks)
        return max(1, usable)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"offload_threads={value!r} must be an integer >= 1 (or None: the "
            "cores this rank may use)"
        )
    return value


def keeps_host_share(offload, fraction: float) -> bool:
    """Whether ``offload`` with ``offload_fraction=fraction`` keeps anything on the host (a
    share of 0 keeps nothing: the optimizer without offload)."""
    return offload is not None and fraction > 0


def host_start(pieces, n: int, fraction: float) -> int:
    """Where the host part of a shard of ``n`` positions begins for ``offload_fraction``: the
    start of a tensor piece (``pieces``: ``(position, elements)`` of each, in order), or ``n``,
    whose part from there on holds the share of the real elements nearest ``fraction`` (ties:
    the earlier); 0 for 1, ``n`` for 0. A piece is never split, so a two-phase rule sums each
    piece in one call, on one side, as without offload."""
    if fraction >= 1.0:
        return 0
    if fraction <= 0.0:
        return n
    owned = sum(size for _, size in pieces)
    best, after = (abs(fraction * owned), n), 0  # (distance, start); n: nothing on the host
    for position, size in reversed(pieces):
        after += size
        best = min(best, (abs(after - fraction * owned), position))
    return best[1]


class DeviceHostRow:
    """One row of a partly offloaded shard (the masters, or one of the rule's state arrays):
    positions ``[0, cut)`` in ``device``, ``[cut, n)`` in ``host`` (each indexed from its own 0),
    both with the interface of ``masters.Fp32Masters`` or ``state_dtypes.Fp32State``.
    ``load`` and ``store`` take a range on one side; ``read`` (a copy where it crosses the
    cut) and ``write`` any range; ``host_real`` of the real elements are the host's."""

    def __init__(self, device, host, cut: int, host_real: int):
        self.device, self.host, self.cut, self.host_real = device, host, cut, host_real
        # (a side that keeps nothing has no chunk: it takes no call)
        self.chunk = min((side.chunk for side in (device, host) if side.chunk), default=1 << 62)

    @property
    def kind(self) -> str:
        """The masters' kind on the device (the host keeps fp32 ones)."""
        return self.device.kind

    @property
    def nbytes(self) -> int:
        return self.device.nbytes + self.host.nbytes

    def real_bytes(self, owned: int) -> int:
        return self.device.real_bytes(owned - self.host_real) + self.host.real_bytes(self.host_real)

    @property
    def held(self) -> np.ndarray:
        """Both sides' arrays, device first, as one NumPy copy (for tests)."""
        sides = [side.held for side in (self.device, self.host) if side.held is not None]
        return np.concatenate([backend.to_numpy(array) for array in sides])

    def load(self, st: slice, *args):
        side, local = self._side(st)
        return side.load(local, *args)

    def store(self, st: slice, *args) -> None:
        side, local = self._side(st)
        side.store(local, *args)

    def read(self, st: slice, *aligned):
        """``aligned``: arrays (or None) over ``st`` as the sides' ``read`` takes them."""
        if st.stop <= self.cut or st.start >= self.cut:
            side, local = self._side(st)
            return side.read(local, *aligned)
        (dev, head), (host, tail) = self._halves(st, aligned)
        return np.concatenate(
            [backend.to_numpy(self.device.read(dev, *head)), self.host.read(host, *tail)]
        )

    def write(self, st: slice, *aligned) -> None:
        """``aligned``: the values, then arrays (or None) over ``st`` as ``write`` takes them."""
        if st.stop <= self.cut or st.start >= self.cut:
            side, local = self._side(st)
            side.write(local, *aligned)
            return
        (dev, head), (host, tail) = self._halves(st, aligned)
        self.device.write(dev, *head)
        self.host.write(host, *tail)

    def _side(self, st: slice):
        if st.start >= self.cut:
            return self.host, slice(st.start - self.cut, st.stop - self.cut)
        if st.stop > self.cut:
            raise ValueError(f"positions {st.start}..{st.stop} cross the offload cut {self.cut}")
        return self.device, st

    def _halves(self, st: slice, aligned):
        k = self.cut - st.start
        head = [None if a is None else a[:k] for a in aligned]
        tail = [None if a is None else a[k:] for a in aligned]
        return (slice(st.start, self.cut), head), (slice(0, st.stop - self.cut), tail)


class ParamsAsMasters:
    """The device side of fp32 parameters' masters: the parameters themselves (no array)."""

    kind = "fp32"
    scratch_bytes = nbytes = 0
    chunk = 1 << 62
    held = None

    def real_bytes(self, owned: int) -> int:
        return 0

    def read(self, st: slice, param):
        return param

    def write(self, st: slice, values, param, rounded=None) -> None:
        if param is not None:
            param[...] = backend.like(param, values)


class ThreadedKernel:
    """``threads`` instances of a host kernel (each with its own scratch) behind one kernel.

    An elementwise call, or a two-phase rule's ``apply``, is split into contiguous ranges, one
    per thread; the kernels are elementwise, so the bits are the one-thread kernel's.
    ``tensor_sums`` is never split (a sum's order would change): ``each_tensor_sums`` runs
    whole pieces on the threads instead. Numba kernels release the GIL; NumPy ones in part.
    """

    MIN_ELEMENTS = 1 << 16  # per thread: below this a thread costs more than it saves

    def __init__(self, make, threads: int):
        self._kernels = [make() for _ in range(threads)]
        self._pool = None
        if threads > 1:
            # Imported here: concurrent.futures adds a hook to the interpreter's shutdown, and
            # with it a JAX process (XLA 0.10) sometimes aborted at exit ("terminate called
            # without an active exception"), in about 1 run of 20.
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zero1-offload")
            weakref.finalize(self, self._pool.shutdown, wait=False)

    def close(self) -> None:
        """Shut the threads down, waiting for them to exit (collection does the same without
        waiting); idempotent. The kernel cannot run afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    @property
    def threads(self) -> int:
        return len(self._kernels)

    @property
    def scratch_bytes(self) -> int:
        return sum(kernel.scratch_bytes for kernel in self._kernels)

    def __call__(self, grad, master, *states_param_scalars) -> None:
        *arrays, scalars = states_param_scalars
        self._split(
            master.size,
            lambda kernel, s: kernel(
                grad[s], master[s], *(None if a is None else a[s] for a in arrays), scalars
            ),
        )

    def apply(self, master, *states_param_scalars) -> None:
        *arrays, scalars = states_param_scalars
        self._split(
            master.size,
            lambda kernel, s: kernel.apply(
                master[s], *(None if a is None else a[s] for a in arrays), scalars
            ),
        )

    def tensor_sums(self, grad, master, *states_scalars):
        return self._kernels[0].tensor_sums(grad, master, *states_scalars)

    def tensor_sums_each(self, calls: list) -> list:
        """``[kernel.tensor_sums(*call) for call in calls]``, the calls spread over the
        threads (each call on one thread, so each result has the one-thread bits)."""
        if self._pool is None or len(calls) < 2:
            return [self._kernels[0].tensor_sums(*call) for call in calls]
        results = [None] * len(calls)

        def run(worker: int) -> None:
            for index in range(worker, len(calls), self.threads):
                results[index] = self._kernels[worker].tensor_sums(*calls[index])

        _all(self._pool.submit(run, worker) for worker in range(min(self.threads, len(calls))))
        return results

    def _split(self, n: int, work) -> None:
        parts = min(self.threads, max(1, n // self.MIN_ELEMENTS))
        if parts == 1 or self._pool is None:  # (parts > 1: threads > 1, which have a pool)
            work(self._kernels[0], slice(0, n))
            return
        bounds = [n * i // parts for i in range(parts + 1)]
        _all(
            self._pool.submit(work, self._kernels[i], slice(bounds[i], bounds[i + 1]))
            for i in range(parts)
        )


def _all(futures) -> None:
    """Wait for every future; raise the first error (after all have finished)."""
    futures = list(futures)
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def each_tensor_sums(kernel, calls: list) -> list:
    """``kernel.tensor_sums(*call)`` for each call, in order (threaded where the kernel is)."""
    if isinstance(kernel, ThreadedKernel):
        return kernel.tensor_sums_each(calls)
    return [kernel.tensor_sums(*call) for call in calls]


class HostShard:
    """This rank's offloaded positions ``[start, shard_total)`` of its shard: the host
    ``master`` (fp32, indexed from ``start``; the rule's state is kept beside it, by
    ``state_dtypes``); for 16-bit parameters, two slots for the kernel's rounded output
    (``output(part)``); and the copies to and from the device.

    Args:
        layout, shard_rank: the layout and this rank's place in its shard group.
        params: the flat parameter buffer (NumPy or CuPy): where ``push`` writes.
        mixed: 16-bit parameters (else fp32: the host master is what ``push`` sends).
        parts: the host parts (``placement.ShardRange``: ``[a, b)`` of this rank's shard of
            ``bucket``, a distinct ``index`` each), the positions from ``start`` on, in order.
    """

    def __init__(self, layout, shard_rank: int, params, mixed: bool, parts, start=0):
        self.layout, self.shard_rank, self._params = layout, shard_rank, params
        self.start, self.parts = start, list(parts)
        self._device = backend.is_device_array(params)
        n = layout.shard_total - start
        # What a copy reads or writes on the host is page-locked on a GPU (async copies).
        self.master = self._host(n, FP32, pinned=not mixed)
        # Slots of a bucket's whole shard (whatever the host's share of it: the scratch is the
        # same at every model size); a reduced gradient shard is at most fp32.
        largest = layout.largest_shard if self.parts else 0
        self._slots = [
            backend.pinned_empty(largest * FP32.itemsize, self._device) for _ in range(2)
        ]
        #: Each host part's turn: its gradient slot and output slot (the one before it may
        #: still be copying from the other).
        self._turn = {part.index: i % 2 for i, part in enumerate(self.parts)}
        self._outputs = [
            self._host(largest, params.dtype, pinned=True) for _ in range(2 if mixed else 0)
        ]
        self._pushed: deque[tuple[int, Any]] = deque()  # (bucket, event or None), oldest first
        if self._device:
            cupy = backend.xp_for("cupy")
            self._to_host = cupy.cuda.Stream(non_blocking=True)
            self._to_device = cupy.cuda.Stream(non_blocking=True)
            event = functools.partial(cupy.cuda.Event, disable_timing=True)  # recorded again
            self._fetches = [event(), event()]  # each slot's copy in flight
            self._pushes = {part.index: event() for part in self.parts}  # each part's copy back
            self._current = event()  # the work queued on the current stream before a step

    def _host(self, n: int, dtype, pinned: bool) -> np.ndarray:
        dtype = np.dtype(dtype)
        if pinned and self._device:
            array = backend.pinned_empty(n * dtype.itemsize, True).view(dtype)
            array.fill(0)
            return array
        return np.zeros(n, dtype)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the copy buffers: the two gradient slots and the two 16-bit output slots."""
        return sum(slot.nbytes for slot in self._slots + self._outputs)

    def output(self, part):
        """Where the kernel writes host ``part``'s new 16-bit parameters (from its start), for
        ``push``; None for fp32 parameters (``push`` sends the master)."""
        if not self._outputs:
            return None
        return self._outputs[self._turn[part.index]][: part.b - part.a]

    def positions(self, part) -> slice:
        """Where ``part`` lies in the host arrays."""
        first = part.bucket.state.start - self.start
        return slice(first + part.a, first + part.b)

    def fetched(self, reduced):
        """Yield ``(part, host copy of its reduced gradients)`` for each host part in order, the
        next part's copy started before this one is yielded. A copy is valid until the
        generator is advanced twice; ``reduced``: each bucket's summed gradient shard, as
        ``BucketPipeline.reduce_all`` gives them."""
        parts = self.parts
        if not parts:
            return
        self._after_current_stream()
        self._fetch(0, self._source(parts[0], reduced))
        for i, part in enumerate(parts):
            if i + 1 < len(parts):
                self._fetch(i + 1, self._source(parts[i + 1], reduced))
            yield part, self._fetched(i, self._source(part, reduced))

    def push(self, part) -> list[int]:
        """Start copying host ``part``'s new parameters to the device; return the indices of the
        buckets whose copies are now complete, oldest first (all but the newest)."""
        lo = part.bucket.shard(self.shard_rank)[0]
        output = self.output(part)
        source = self.master[self.positions(part)] if output is None else output
        target = self._params[lo + part.a : lo + part.b]
        event = None
        if self._device:  # as bytes: CuPy's set() would compare bf16 dtypes of two libraries
            target.view(np.uint8).set(source.view(np.uint8), stream=self._to_device)
            event = self._to_device.record(self._pushes[part.index])
        else:
            np.copyto(target, source)
        self._pushed.append((part.bucket.index, event))
        return self._complete(keep=1)

    def drain(self) -> list[int]:
        """Complete every copy ``push`` started; return their bucket indices."""
        return self._complete(keep=0)

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _source(part, reduced):
        return reduced[part.bucket.index][part.a : part.b]

    def _after_current_stream(self) -> None:
        """Order the copy streams after the work queued so far on the current stream (the
        reduction that wrote the gradients; kernels still reading the parameters)."""
        if self._device:
            done = backend.xp_for("cupy").cuda.get_current_stream().record(self._current)
            self._to_host.wait_event(done)
            self._to_device.wait_event(done)

    def _fetch(self, index: int, reduced) -> None:
        slot = self._slots[index % 2][: reduced.nbytes]
        if self._device:
            reduced.view(np.uint8).get(stream=self._to_host, out=slot, blocking=False)
            self._to_host.record(self._fetches[index % 2])
        else:
            np.copyto(slot, reduced.view(np.uint8))

    def _fetched(self, index: int, reduced) -> np.ndarray:
        if self._device:
            self._fetches[index % 2].synchronize()
        return self._slots[index % 2][: reduced.nbytes].view(backend.host_dtype(reduced))

    def _complete(self, keep: int) -> list[int]:
        done = []
        while len(self._pushed) > keep:
            index, event = self._pushed.popleft()
            if event is not None:
                event.synchronize()
            done.append(index)
        return done


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_offload(value, checked):
    if value is not None and value != "cpu":
        raise ValueError(
            f"offload={value!r} is not understood: use 'cpu' (master weights and "
            "the rule's state on the host) or None (all on the parameters' device)"
        )
    if value is not None and checked["gather_dtype"] is not None:
        raise ValueError(
            f"offload={value!r} with gather_dtype={checked['gather_dtype']!r} is not "
            "supported yet: choose one"
        )
    return value


def check_offload_threads(value, checked):
    if checked["offload"] is None:
        if value is not None:
            raise ValueError(
                f"offload_threads={value!r} sets the host kernel's threads, which "
                "only offload='cpu' has: pass offload='cpu' too, or drop it"
            )
        return None
    return resolve_threads(value, len(checked["node"]))


def check_offload_fraction(value, checked):
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or not 0.0 <= value <= 1.0:  # (nan fails the comparison too)
        raise ValueError(
            f"offload_fraction={value!r} must be a number from 0 to 1: the share of this "
            "rank's master weights and state kept and updated on the host"
        )
    if checked["offload"] is None and value != 1.0:
        raise ValueError(
            f"offload_fraction={value!r} sets the share that offload='cpu' moves to the "
            "host: pass offload='cpu' too, or drop it"
        )
    return float(value) + 0.0  # (-0.0 is 0)
