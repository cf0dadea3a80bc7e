"""Where a step's gradients come from: one interface over the stage-1 bucket pipeline and the
stage-2 gradient shards.

``GradientSource`` is what the engine asks of either: the model's side (``grads`` views,
``ready`` for overlap, ``add`` for hand-overs, ``missing``), the step's (``reduce_all``: this
rank's reduced shard of every bucket; ``problem`` and ``order_digest`` for the agreement;
``zero``) and the ledger's (``buffer``, ``scratch_bytes``). ``gradient_source`` builds the one
the options ask for: ``buckets.BucketPipeline`` (the full gradient buffer, ZeRO stage 1) or
``grad_shards.GradientShards`` (``shard_gradients=True``, stage 2). Methods that start or
complete collectives must be called on all ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ..comm.watchdog import Watchdog
from ..wire.codec import codec_for
from ..wire.gradient_exchange import FP32, AcrossGroups, GroupExchange, Quantizer
from .stage1 import BucketPipeline
from .stage2 import GradientShards

__all__ = ["GradientSource", "gradient_source"]


class GradientSource(Protocol):
    """A step's gradients, reduced to this rank's shard of every bucket."""

    #: The views the model writes (stage 1), or a mapping that refuses (stage 2).
    grads: Mapping
    #: The array holding this rank's gradients: the full buffer, or (``sharded``) its shard.
    buffer: Any
    sharded: bool
    #: A bad hand-over found since the step began (raised on every rank by the step), or None.
    problem: str | None
    #: A digest of the order this step's reductions started in (0 where it is fixed).
    order_digest: int
    watch: Watchdog

    @property
    def scratch_bytes(self) -> int: ...

    @property
    def feedback_bytes(self) -> int:
        """Bytes of the error-feedback residuals (0 without ``error_feedback``)."""
        ...

    def rescale_feedback(self, factor: float) -> None:
        """Multiply the error-feedback residuals by ``factor``: the loss scale's change, or 0
        to forget them (a skipped step, a load)."""

    def ready(self, names) -> None:
        """Declare ``names``' gradients final (starting reductions), or refuse."""

    def add(self, name: str, grad) -> None:
        """Hand over ``name``'s gradient for this micro-batch, or refuse."""

    def missing(self) -> list[str]:
        """The tensors not yet handed over in the buckets this micro-batch has begun."""
        ...

    def reduce_all(self) -> list:
        """Complete every reduction; each bucket's summed gradient shard, in bucket order."""
        ...

    def zero(self) -> None:
        """Complete and forget what is in flight; zero the gradients."""

    def close(self) -> None:
        """Complete what is in flight and free what the collectives hold; idempotent."""


def gradient_source(
    options, layout, xp, topology, reductions, watch: Watchdog, kernels
) -> GradientSource:
    """The gradient source of the checked ``options`` (``options.EngineOptions``), with the
    wire format they ask for (``exchange``), its codec of the ``kernels.device`` family."""
    kind = kernels.device
    dtype, k = options.param_dtype, topology.group_size
    int8 = options.reduce_dtype == "int8"
    largest = max(b.size for b in layout.buckets)
    slots = min(options.grad_staging if options.shard_gradients else 2, len(layout.buckets))
    exchange = None
    # 16-bit gradients summed in fp32, and 8-bit ones: exchanged whole and summed here
    within_int8 = int8 and options.compress_hops == "all"
    if k > 1 and (within_int8 or (dtype != FP32 and options.reduce_dtype != "float16")):
        quantizer = (
            Quantizer(
                codec_for(kind, largest // k), xp, layout.total, dtype, options.error_feedback
            )
            if within_int8
            else None
        )
        exchange = GroupExchange(
            topology.shard_comm, xp, slots, largest, dtype, reductions, quantizer
        )
    across = None
    if topology.replica_comm is not None:
        if options.shard_gradients:
            shard_dtype = options.grad_shard_dtype
        else:
            shard_dtype = FP32 if exchange is not None else dtype
        shard = layout.largest_shard
        quantizer = (
            Quantizer(
                codec_for(kind, shard), xp, layout.shard_total, shard_dtype, options.error_feedback
            )
            if int8
            else None
        )
        across = AcrossGroups(topology.replica_comm, xp, shard, shard_dtype, quantizer)
    if options.shard_gradients:
        return GradientShards(
            layout,
            xp,
            dtype,
            options.grad_shard_dtype,
            topology,
            exchange,
            across,
            options.grad_staging,
            watch,
        )
    return BucketPipeline(layout, xp, dtype, topology, exchange, across, watch)
