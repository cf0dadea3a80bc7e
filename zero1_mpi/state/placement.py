"""Where this rank's shard of the optimizer state lives, and the kernels that update it there.

``WithParams`` keeps the shard beside the parameters (the device, or the host for NumPy): each
bucket's shard is one part, updated by one kernel. ``OffloadedShare`` (``offload="cpu"``) keeps
the positions from ``cut`` on on the host (the share ``offload_fraction``): each bucket's shard
is a device part and a host part, the host parts updated by a threaded CPU kernel between the
copies of ``host.HostShard``. Each is built whole from a ``ShardSpec`` (no later call sets
anything) and answers what ``ShardedState`` asks: its ``parts``, ``masters``, ``stored`` rows,
``kernel_of(part)``, ``inputs``, ``landed``, ``arrays``, the bytes it holds, ``close()``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import numba_forms
from .encodings import FUSED_STATE_DTYPES, state_for
from .host import (
    DeviceHostRow,
    HostShard,
    ParamsAsMasters,
    ThreadedKernel,
    host_start,
    keeps_host_share,
)
from .int8_blocks import MIN_8BIT_SIZE
from .masters import Fp32Masters, masters_for

__all__ = ["ShardRange", "ShardSpec", "WithParams", "OffloadedShare", "placement_for"]


@dataclass(frozen=True)
class ShardRange:
    """``[a, b)`` of this rank's shard of ``bucket``, updated in one place (``on_host``);
    ``index``: its place in the placement's ``parts``."""

    bucket: Any
    a: int
    b: int
    index: int
    on_host: bool = False


@dataclass(frozen=True)
class ShardSpec:
    """What a placement keeps: this rank's shard (``shard_rank``) of ``layout``, whose
    ``pieces`` are each bucket's ``(tensor, group, a, b)`` on this rank; ``flat``, the parameter
    buffer (``mixed``: 16-bit); ``rule``'s state kept as ``state_dtype``, masters as
    ``masters_kind``, updated by ``kernels`` (``KernelFamilies``); ``xp`` the parameters'."""

    layout: Any
    shard_rank: int
    pieces: list
    flat: Any
    mixed: bool
    rule: Any
    xp: Any
    kernels: Any
    masters_kind: str
    state_dtype: str

    def segments(self) -> list:
        """The 8-bit state's segments: ``(start, stop, quantized)`` of each tensor piece in the
        shard's positions (tensors under ``MIN_8BIT_SIZE`` keep fp32)."""
        tensors = self.layout.tensors
        return [
            (bucket.state.start + a, bucket.state.start + b, tensors[t].numel >= MIN_8BIT_SIZE)
            for bucket, pieces in zip(self.layout.buckets, self.pieces)
            for t, _, a, b in pieces
        ]

    def with_params(self, masters, stored, bucket, a: int, b: int, at: int, gathers) -> tuple:
        """``(master, states, param or None)`` over ``[a, b)`` of the shard of ``bucket`` kept
        beside the parameters (``stored`` after the kernel): for fp32 parameters the master is
        the parameter range itself; a 16-bit output goes to the gather's ``target``."""
        lo, _ = bucket.shard(self.shard_rank)
        st = slice(bucket.state.start + a, bucket.state.start + b)
        states = [kept.load(st, at) for kept in stored.values()]
        if self.mixed:
            master = masters.load(st, at, self.flat[lo + a : lo + b])
            return master, states, gathers.target(bucket)[a:b]
        return self.flat[lo + a : lo + b], states, None


class WithParams:
    """The shard beside the parameters: each bucket's shard whole, one kernel. Where the
    kernel is a Numba or CuPy twin that takes the stored forms (``fused``: fp32 or remainder
    masters, fp32, bf16 or 8-bit state; an elementwise rule), ``update_fused`` runs it over them
    as they are, in one pass."""

    on_host = False

    def __init__(self, spec: ShardSpec):
        self.spec = spec
        n, largest = spec.layout.shard_total, spec.layout.largest_shard
        whole = spec.rule.tensor_sums > 0
        self.parts = [ShardRange(b, 0, b.shard_size, b.index) for b in spec.layout.buckets]
        #: The kernel family of the update (and of the gathers' decoding).
        self.kernel_kind = kind = spec.kernels.device
        self.kernel = spec.rule.kernel(kind, largest)
        #: Whether the kernel reads and writes the stored forms itself (``numba_forms``).
        self.fused = fused = (
            kind in ("numba", "cupy")
            and not whole
            and spec.state_dtype in FUSED_STATE_DTYPES
            and callable(getattr(self.kernel, "fused", None))
        )
        #: The masters for 16-bit parameters (fp32 ones: the parameter buffer's range).
        self.masters: Any = (
            masters_for(spec.masters_kind, n, largest, spec.xp, kind, whole, fused)
            if spec.mixed
            else None
        )
        segments, dtype = spec.segments(), spec.state_dtype
        self.stored: dict = {
            name: state_for(dtype, n, largest, spec.xp, kind, i, whole, segments, fused)
            for i, name in enumerate(spec.rule.state_names)
        }
        #: Where a two-phase rule's partial sums are added.
        self.sums_xp = spec.xp

    def kernel_of(self, part):
        return self.kernel

    def inputs(self, reduced):
        """``(part, its reduced gradients)`` for each part in order (``reduced``: each bucket's
        summed shard); for ``reduced`` None, ``(part, None)`` (a second phase reads none)."""
        if reduced is None:
            return ((part, None) for part in self.parts)
        return ((part, reduced[part.bucket.index][part.a : part.b]) for part in self.parts)

    def landed(self, part) -> list[int]:
        """The buckets whose new shard is in the parameter buffer once ``part``'s update is
        done (None: after the last), so that their all-gathers may start."""
        return [] if part is None else [part.bucket.index]

    def arrays(self, bucket, a: int, b: int, at: int, gathers) -> tuple:
        """``(master, states, param or None)`` where the kernel updates ``[a, b)`` of
        ``bucket``'s shard (``ShardSpec.with_params``)."""
        return self.spec.with_params(self.masters, self.stored, bucket, a, b, at, gathers)

    def update_fused(self, bucket, a: int, b: int, grads, scalars, gathers, step: int) -> None:
        """``fused``: the kernel's one pass over ``[a, b)`` of ``bucket``'s shard (``grads``
        from ``a``), on the masters and state as they are stored; the new 16-bit parameters
        go to the gather's target (for remainder masters, the parameter buffer itself)."""
        lo = bucket.shard(self.spec.shard_rank)[0] + a
        st = slice(bucket.state.start + a, bucket.state.start + b)
        states = tuple(kept.form(st, lo, step) for kept in self.stored.values())
        if self.masters is None:  # fp32 parameters: the parameter range is the master
            master, param = numba_forms.master_form(fp32=self.spec.flat[lo : lo + b - a]), None
        else:
            master, param = self.masters.form(st), gathers.target(bucket)[a:b]
        ties = self.kernel.fused(grads, master, states, param, scalars)
        if self.masters is not None:
            self.masters.record_ties(st, ties)

    def scratch_bytes(self) -> tuple[int, int]:
        """``(with the parameters, on the host)``: the kernel's and the rows' decoding buffers."""
        kept = sum(k.scratch_bytes for k in (self.masters, *self.stored.values()) if k is not None)
        return self.kernel.scratch_bytes + kept, 0

    def host_bytes(self, owned: int) -> tuple[int, int, float]:
        """``(held, real, share)`` of the masters and state on the host: none here."""
        return 0, 0, 0.0

    def close(self) -> None:
        pass


class OffloadedShare:
    """The share ``fraction`` of the shard on the host (ZeRO-Offload; all of it for 1): the
    positions from ``cut``, a tensor piece's start (``host.host_start``). The device parts
    come first, updated by the device's kernel; then each host part's reduced gradients are
    copied to the host, updated there by ``threads`` threads of the CPU kernel, and its new
    parameters copied back, neighbouring parts' copies overlapping the kernel
    (``host.HostShard``). Each row is kept on both sides (``host.DeviceHostRow``) as
    ``state_dtype`` says; the masters as ``masters_kind`` says on the device, fp32 on the host."""

    on_host = True

    def __init__(self, spec: ShardSpec, fraction: float, threads: int):
        self.spec = spec
        layout, xp, whole = spec.layout, spec.xp, spec.rule.tensor_sums > 0
        n, largest = layout.shard_total, layout.largest_shard
        pieces = [
            (bucket.state.start + a, b - a)
            for bucket, found in zip(layout.buckets, spec.pieces)
            for _, _, a, b in found
        ]
        self.cut = cut = host_start(pieces, n, fraction)
        #: The real elements of the host part.
        self.host_real = sum(size for position, size in pieces if position >= cut)
        self.parts = _cut_parts(layout.buckets, cut)
        #: Each bucket's host part (at most one), by bucket index.
        self._host_parts = {part.bucket.index: part for part in self.parts if part.on_host}
        #: The host arrays and the copies between them and the device.
        self.copies = HostShard(
            layout, spec.shard_rank, spec.flat, spec.mixed, list(self._host_parts.values()), cut
        )
        self.kernel_kind, device_kind = spec.kernels.host, spec.kernels.device
        # A side that keeps nothing (the cut at either end) gets no decoding buffers.
        on_device_largest, on_host_largest = (largest if cut else 0), (largest if n > cut else 0)
        on_device = (
            masters_for(spec.masters_kind, cut, on_device_largest, xp, device_kind, whole)
            if spec.mixed
            else ParamsAsMasters()
        )
        self.masters = DeviceHostRow(
            on_device, Fp32Masters(self.copies.master), cut, self.host_real
        )
        segments = spec.segments()  # (the cut is a piece's start: none is split)
        host_segments = [(a - cut, b - cut, q) for a, b, q in segments if a >= cut]
        device_segments = [s for s in segments if s[0] < cut]

        def row(i: int) -> DeviceHostRow:
            dtype = spec.state_dtype
            return DeviceHostRow(
                state_for(
                    dtype, cut, on_device_largest, xp, device_kind, i, whole, device_segments
                ),
                state_for(
                    dtype, n - cut, on_host_largest, np, self.kernel_kind, i, whole, host_segments
                ),
                cut,
                self.host_real,
            )

        self.stored = {name: row(i) for i, name in enumerate(spec.rule.state_names)}
        self.kernel = spec.rule.kernel(device_kind, on_device_largest) if cut else None
        self.host_kernel = ThreadedKernel(
            lambda: spec.rule.kernel(self.kernel_kind, on_host_largest), threads if n > cut else 1
        )
        self.sums_xp = np if cut == 0 else xp

    def kernel_of(self, part):
        return self.host_kernel if part.on_host else self.kernel

    def inputs(self, reduced):
        """As ``WithParams.inputs``: the device parts' gradients where they are, then the host
        parts' as their copies land (``HostShard.fetched``)."""
        if reduced is None:
            return ((part, None) for part in self.parts)
        return itertools.chain(
            (
                (part, reduced[part.bucket.index][part.a : part.b])
                for part in self.parts
                if not part.on_host
            ),
            self.copies.fetched(reduced),
        )

    def landed(self, part) -> list[int]:
        if part is None:
            return self.copies.drain()
        if part.on_host:
            return self.copies.push(part)
        return [part.bucket.index] if part.b == part.bucket.shard_size else []

    def arrays(self, bucket, a: int, b: int, at: int, gathers) -> tuple:
        """On the device, as ``WithParams``; on the host: the fp32 master, the state (decoded
        where it is kept otherwise), the 16-bit output in the slot ``push`` sends (fp32: the
        master is sent)."""
        first = bucket.state.start + a
        if first < self.cut:
            return self.spec.with_params(self.masters, self.stored, bucket, a, b, at, gathers)
        st, part = slice(first, first + b - a), self._host_parts[bucket.index]
        output = self.copies.output(part)
        return (
            self.copies.master[first - self.cut : first - self.cut + b - a],
            [kept.load(st, at) for kept in self.stored.values()],
            None if output is None else output[a - part.a : b - part.a],
        )

    def scratch_bytes(self) -> tuple[int, int]:
        rows = [self.masters, *self.stored.values()]  # (their codecs' decoding buffers)
        device = 0 if self.kernel is None else self.kernel.scratch_bytes
        device += sum(row.device.scratch_bytes for row in rows)
        host = self.copies.scratch_bytes + self.host_kernel.scratch_bytes
        return device, host + sum(row.host.scratch_bytes for row in rows)

    def host_bytes(self, owned: int) -> tuple[int, int, float]:
        kept = [self.masters, *self.stored.values()]
        share = self.host_real / owned if owned else float(self.cut == 0)
        return (
            sum(row.host.nbytes for row in kept),
            sum(row.host.real_bytes(self.host_real) for row in kept),
            share,
        )

    def close(self) -> None:
        self.host_kernel.close()


def _cut_parts(buckets, cut: int) -> list[ShardRange]:
    """Each bucket's shard cut at the shard position ``cut``: the device part, then the host
    part (each where it is not empty)."""
    parts: list[ShardRange] = []
    for bucket in buckets:
        split = min(max(cut - bucket.state.start, 0), bucket.shard_size)
        for a, b, on_host in ((0, split, False), (split, bucket.shard_size, True)):
            if a < b:
                parts.append(ShardRange(bucket, a, b, len(parts), on_host))
    return parts


def placement_for(options, spec: ShardSpec) -> WithParams | OffloadedShare:
    """The placement the checked ``options`` ask for (offload with a share above 0, else
    beside the parameters)."""
    if keeps_host_share(options.offload, options.offload_fraction):
        return OffloadedShare(spec, options.offload_fraction, options.offload_threads)
    return WithParams(spec)
