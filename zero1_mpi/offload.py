"""State offload: this rank's fp32 master weights and rule state on the host, updated there,
while the device keeps the parameters, gradients and communication scratch (ZeRO-Offload).

``HostShard`` owns the host arrays and the copies: ``fetched(reduced)`` brings each bucket's
reduced gradient shard into one of two host slots, the next bucket's copy in flight while this
one is updated; ``push(bucket)`` sends the new parameter shard back and returns the buckets
whose copies are complete (their all-gathers may start). CuPy parameters: page-locked slots and
two copy streams of the shard's own. NumPy parameters: the same steps as explicit host copies.
``ThreadedKernel`` splits a host kernel over threads, bitwise the one-thread kernel.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import deque
from typing import Any

import numpy as np

from . import backend

__all__ = ["HostShard", "ThreadedKernel", "resolve_threads", "each_tensor_sums"]

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
    """This rank's offloaded shard: host ``master`` (fp32), ``state`` arrays (by name) and, for
    16-bit parameters, ``params16`` (the kernel's rounded output), over ``layout.shard_total``
    elements; and the copies between them and the device buffers.

    Args:
        layout, shard_rank: the layout and this rank's place in its shard group.
        params: the flat parameter buffer (NumPy or CuPy): where ``push`` writes.
        state_names: the rule's state arrays.
        mixed: 16-bit parameters (else fp32: the host master is what ``push`` sends).
    """

    def __init__(self, layout, shard_rank: int, params, state_names, mixed: bool):
        self.layout, self.shard_rank, self._params = layout, shard_rank, params
        self._device = backend.is_device_array(params)
        n = layout.shard_total
        # What a copy reads or writes on the host is page-locked on a GPU (async copies).
        self.master = self._host(n, FP32, pinned=not mixed)
        self.state = {name: np.zeros(n, FP32) for name in state_names}
        self.params16 = self._host(n, params.dtype, pinned=True) if mixed else None
        largest = max(b.shard_size for b in layout.buckets)
        # A reduced gradient shard is at most fp32 (16-bit ones are summed in fp32).
        self._slots = [
            backend.pinned_empty(largest * FP32.itemsize, self._device) for _ in range(2)
        ]
        self._pushed: deque[tuple[int, Any]] = deque()  # (bucket, event or None), oldest first
        if self._device:
            cupy = backend.xp_for("cupy")
            self._to_host = cupy.cuda.Stream(non_blocking=True)
            self._to_device = cupy.cuda.Stream(non_blocking=True)
            event = functools.partial(cupy.cuda.Event, disable_timing=True)  # recorded again
            self._fetches = [event(), event()]  # each slot's copy in flight
            self._pushes = [event() for _ in layout.buckets]  # each bucket's copy back
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
        """Bytes of the copy buffers: the two gradient slots and the 16-bit output."""
        return sum(slot.nbytes for slot in self._slots) + (
            0 if self.params16 is None else self.params16.nbytes
        )

    def fetched(self, reduced):
        """Yield ``(bucket, host copy of its reduced gradient shard)`` in bucket order, the
        next bucket's copy started before this one is yielded. A copy is valid until the
        generator is advanced twice; ``reduced`` as ``BucketPipeline.reduce_all`` gives it."""
        buckets = self.layout.buckets
        self._after_current_stream()
        self._fetch(0, reduced[0])
        for i, bucket in enumerate(buckets):
            if i + 1 < len(buckets):
                self._fetch(i + 1, reduced[i + 1])
            yield bucket, self._fetched(i, reduced[i])

    def push(self, bucket) -> list[int]:
        """Start copying ``bucket``'s new parameter shard to the device; return the indices of
        the buckets whose copies are now complete, oldest first (all but the newest)."""
        lo, hi = bucket.shard(self.shard_rank)
        source = (self.master if self.params16 is None else self.params16)[bucket.state]
        target = self._params[lo:hi]
        event = None
        if self._device:  # as bytes: CuPy's set() would compare bf16 dtypes of two libraries
            target.view(np.uint8).set(source.view(np.uint8), stream=self._to_device)
            event = self._to_device.record(self._pushes[bucket.index])
        else:
            np.copyto(target, source)
        self._pushed.append((bucket.index, event))
        return self._complete(keep=1)

    def drain(self) -> list[int]:
        """Complete every copy ``push`` started; return their bucket indices."""
        return self._complete(keep=0)

    def push_all(self) -> None:
        """Copy the whole shard to the device parameters, blocking (after a load)."""
        self._after_current_stream()
        for bucket in self.layout.buckets:
            self.push(bucket)
        self.drain()

    # -- internals ---------------------------------------------------------------------------

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
