"""What a step reports, advances and agrees on: records that the step and persistence share.

``StepInfo``: what one ``step()`` did (the norm, a skip, the loss scale, clipping, a stop on a
signal). ``Counters``: what a step reads and advances and a checkpoint saves and restores (the
step count, the loss scaler, the param groups, the clipping norm). ``Agreement``: what one
step's ``Allreduce`` sums over the ranks, by name. Pure data: no arrays, no MPI of its own.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

from ..scaler import LossScaler

__all__ = ["StepInfo", "Counters", "Agreement"]


@dataclass(frozen=True)
class StepInfo:
    """What one ``step()`` did."""

    grad_norm: float  # global L2 norm of the averaged, unscaled gradient, before clipping
    skipped: bool  # True when the gradients overflowed and nothing was updated
    loss_scale: float  # the scale the gradients of this step were multiplied by
    clip_coef: float  # the factor clipping applied (1.0 when it did not clip)
    step: int  # optimizer steps taken so far (skipped ones not counted)
    stop: bool = False  # a signal of checkpoint_on_signal arrived: checkpoint saved, stop
    checkpoint: Path | None = None  # the checkpoint saved after this step, when ``stop``


@dataclass
class Counters:
    """What a step reads and advances, and a checkpoint records and restores beside the
    sharded state: the step count, the loss scaler, the param groups (whose rule options may
    change between steps) and the clipping norm."""

    param_groups: list
    scaler: LossScaler
    max_grad_norm: float | None
    step: int = 0

    def restore(self, step: int, scaler: LossScaler, group_options: list) -> None:
        """Set the step count, the loss scaler and each param group's rule options, as a
        checkpoint or export saved them."""
        self.step, self.scaler = step, scaler
        for group, saved in zip(self.param_groups, group_options):
            group.update(saved)


@dataclass(frozen=True)
class Agreement:
    """What one step's ``Allreduce`` sums over the ranks, by name (this rank's values, or after
    ``summed`` every rank's total). A digest ``h`` is the same on all N ranks exactly when
    ``N * sum(h^2) == sum(h)^2``."""

    sum_sq: float = 0.0  # the squares of the reduced gradients (inf/nan: an overflow)
    problems: float = 0.0  # ranks that found a bad option or hand-over
    options: float = 0.0  # a digest of the param groups' options
    options_sq: float = 0.0
    order: float = 0.0  # a digest of the order the reductions started in
    order_sq: float = 0.0
    signals: float = 0.0  # ranks with a checkpoint_on_signal signal pending
    writing: float = 0.0  # ranks still writing their part of a non-blocking save

    def summed(self, comm) -> Agreement:
        """Every rank's record added up (one ``Allreduce``); all ranks."""
        return self if comm.size == 1 else Agreement(*comm.allreduce_sum(astuple(self)))

    @staticmethod
    def same(total: float, total_sq: float, ranks: int) -> bool:
        return ranks * int(total_sq) == int(total) ** 2
