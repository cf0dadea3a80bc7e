"""One optimizer step: reduce, agree, update, gather.

``StepPipeline.run`` takes the gradients' reduced shards from the gradient source, agrees with
every rank in one ``Allreduce`` of an ``Agreement`` (a named record: the global norm, which is
inf or nan on overflow, bad options or hand-overs, digests of the options and of the reduction
order, a pending signal, a save still being written), raises an error found on any rank on
every rank with nothing updated, skips an overflowed step (dynamic loss scaling), folds
unscaling, the mean and clipping into the kernel's gradient factor, and has the sharded state
update and all-gather, advancing the ``Counters`` (``records``). All ranks.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import replace

import numpy as np

from ..comm.communicator import CollectiveError
from ..flat.inputs import group_options
from ..kernels.backend import xp_of, zeros
from ..rules.options import number
from .records import Agreement, Counters, StepInfo

__all__ = ["StepPipeline", "CLIP_EPS", "check_max_grad_norm"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6)


#: The problem of gradients given after ``clip_grad_norm_`` reduced the step's.
_LATE = (
    "{} came after clip_grad_norm_() had reduced this step's gradients, which it "
    "would miss: call clip_grad_norm_() after the last backward of the step, just before "
    "step() (nothing was updated)"
)


class StepPipeline:
    """The step of an optimizer made of ``state`` (``state.ShardedState``: its shard groups'
    communicator and watchdog are the step's), ``gradients`` (a ``gradients.GradientSource``),
    ``persistence`` (``persistence.Persistence``: a signal's checkpoint, a non-blocking save to
    publish) and ``counters``; ``rule``: the update rule; ``reductions``: the sum of squares."""

    def __init__(self, rule, state, gradients, persistence, counters: Counters, reductions):
        self.rule, self.state, self.gradients = rule, state, gradients
        self.persistence, self.counters, self.reductions = persistence, counters, reductions
        self.comm, self.watch = state.topology.comm, state.watch
        #: Host seconds of the last completed step by phase: reduce (the gradient reduction),
        #: agree (sum of squares + the one Allreduce), update (the kernel), gather (all-gather).
        #: CuPy work is asynchronous: there the phases are the host's, not the device's.
        self.last_step_seconds: dict = {}
        self._reduced: list | None = None  # this step's reduced shards, once reduced
        self._sum_sq: float | None = None  # ... and their sum of squares
        self._clip_to: float | None = None  # clip_grad_norm's max_norm for this step
        self._late: str | None = None  # gradients given after clip_grad_norm reduced them

    def run(self, wait: bool = True, problem: str | None = None) -> StepInfo:
        """``ShardedOptimizer.step``: armed on the watchdog by the caller."""
        clock, counters, comm = time.perf_counter, self.counters, self.comm
        reduced, agreed, started, reduced_at = self._reduce_and_agree(problem)
        agreed_at = clock()

        scale = counters.scaler.scale
        grad_norm = self._grad_norm(agreed)
        if not math.isfinite(grad_norm):
            self._discard()
            if counters.scaler.at_minimum:
                raise FloatingPointError(
                    f"the gradients hold inf or nan (grad_norm={grad_norm}) at loss scale "
                    f"{scale:g}, which cannot back off further, after {counters.step} steps: "
                    "nothing was updated. Check the loss for divergence, lower the learning "
                    "rate, or use loss_scale='dynamic' (fp16)"
                )
            counters.scaler = counters.scaler.update(overflow=True)
            return self.persistence.stop_if_asked(
                StepInfo(grad_norm, True, scale, 1.0, counters.step), agreed
            )

        clip = self._clip_coef(grad_norm)
        factor = clip / (comm.size * scale)
        self.watch.disarm()  # the update is this rank's own work (the first may compile)
        with comm.abort_on_error("in step() while updating the parameters"):
            scalars = [
                self.rule.scalars(counters.step + 1, group_options(g, self.rule, dict), factor)
                for g in counters.param_groups
            ]
            update, gather = self.state.update(reduced, scalars, counters.step + 1)
            self.zero_grad()
        if wait:
            t0 = clock()
            self.watch.arm(counters.step + 1, "gather")  # (this step's, not the last one's)
            self.state.wait()
            self.watch.disarm()
            gather += clock() - t0
        self.last_step_seconds = {
            "reduce": reduced_at - started,
            "agree": agreed_at - reduced_at,
            "update": update,
            "gather": gather,
        }
        counters.step += 1
        counters.scaler = counters.scaler.update(overflow=False)
        if counters.scaler.scale != scale:  # the residuals are in the loss scale's units
            self.gradients.rescale_feedback(counters.scaler.scale / scale)
        return self.persistence.stop_if_asked(
            StepInfo(grad_norm, False, scale, clip, counters.step), agreed
        )

    def clip_grad_norm(self, max_norm: float | None, problem: str | None = None) -> float:
        """``ShardedOptimizer.clip_grad_norm_``: the step's reduction and agreement now (the
        reduction once: ``run`` and a second call agree again on what it found), the global
        norm of the averaged, unscaled gradient returned; the coming ``run`` clips to
        ``max_norm`` too (None: clips no more). Armed on the watchdog by the caller."""
        try:
            if max_norm is not None and number(max_norm, "max_norm") <= 0:
                raise ValueError(f"max_norm={max_norm!r} must be > 0 (None: no clipping)")
        except ValueError as exc:
            problem = problem or f"clip_grad_norm_(): {exc}"
        agreed = self._reduce_and_agree(problem)[1]
        if max_norm is not None:
            self._clip_to = float(max_norm)
        return self._grad_norm(agreed)

    def reduced_grads(self, problem: str | None = None) -> dict:
        """``ShardedOptimizer.reduced_grads``: the step's reduction and agreement now (as
        ``clip_grad_norm``), every bucket's shard scaled as the update will take it (the mean,
        unscaled, clipped) and all-gathered over the shard group into a new fp32 buffer;
        ``{name: view}`` of it. Armed on the watchdog by the caller."""
        reduced, agreed = self._reduce_and_agree(problem)[:2]
        scale = self.comm.size * self.counters.scaler.scale
        factor = self._clip_coef(self._grad_norm(agreed)) / scale
        layout, topology = self.state.layout, self.state.topology
        flat = zeros(xp_of(reduced[0]), layout.total, np.float32)
        self.watch.arm(self.counters.step + 1, "gather")  # (agreeing may have disarmed it)
        self.watch.phase = "gather"
        for bucket, shard in zip(layout.buckets, reduced):
            whole = flat[bucket.offset : bucket.offset + bucket.size]
            lo = topology.shard_rank * bucket.shard_size
            whole[lo : lo + bucket.shard_size] = shard * np.float32(factor)
            self.watch.bucket = bucket.index
            topology.shard_comm.allgather_inplace(whole)
        return {
            t.name: flat[t.offset : t.offset + t.numel].reshape(t.shape) for t in layout.tensors
        }

    def ready(self, names) -> None:
        """``gradients.ready``, or after ``clip_grad_norm`` a problem for the step."""
        if self._reduced is None:
            self.gradients.ready(names)
        else:
            self._late = self._late or _LATE.format(f"grads_ready({names!r})")

    def add(self, name: str, grad) -> None:
        """``gradients.add``, or after ``clip_grad_norm`` a problem for the step."""
        if self._reduced is None:
            self.gradients.add(name, grad)
        else:
            self._late = self._late or _LATE.format(f"the gradient of {name!r}")

    def zero_grad(self) -> None:
        """Zero the gradients and forget a reduction ``clip_grad_norm`` made."""
        self.gradients.zero()
        self._reduced = self._late = self._clip_to = self._sum_sq = None

    def _reduce_and_agree(self, problem: str | None) -> tuple[list, Agreement, float, float]:
        """Every bucket's reduced shard (reduced once per step), the agreement of all ranks
        on them, the times the reduction began and ended; raises on every rank what any rank
        found."""
        comm = self.comm
        self.state.wait()  # what step(wait=False) left in flight
        started = time.perf_counter()
        group_problem = self._check_param_groups()
        with comm.abort_on_error("in step() while reducing the gradients"):
            if self._reduced is None:
                self._reduced, self._sum_sq = self.gradients.reduce_all(), None
            problem = problem or self.gradients.problem or group_problem or self._late
            reduced_at = time.perf_counter()
            self.watch.phase, self.watch.bucket = "agree", None
            if self._sum_sq is None:  # replicas hold the same sums: the norm counts one
                self._sum_sq = (
                    float(sum(self.reductions.sum_of_squares(r) for r in self._reduced))
                    if self.state.topology.replica == 0
                    else 0.0
                )
            agreed = self._agreement(problem).summed(comm)
            self.persistence.agreed(agreed)
        self._raise_disagreement(agreed, problem)
        return self._reduced, agreed, started, reduced_at

    def _grad_norm(self, agreed: Agreement) -> float:
        """The global norm of the averaged, unscaled gradient (inf or nan on overflow)."""
        return math.sqrt(agreed.sum_sq) / (self.comm.size * self.counters.scaler.scale)

    def _clip_coef(self, grad_norm: float) -> float:
        """The step's clipping coefficient for ``grad_norm``: by ``max_grad_norm`` and by
        ``clip_grad_norm_``'s ``max_norm``, as torch's (1.0: none)."""
        clip = 1.0
        for max_norm in (self.counters.max_grad_norm, self._clip_to):
            if max_norm is not None:
                clip = min(clip, max_norm / (grad_norm + CLIP_EPS))
        return clip

    def _agreement(self, problem: str | None) -> Agreement:
        """This rank's part of the step's agreement."""
        sum_sq = self._sum_sq or 0.0
        options, order = self._options_digest(), self.gradients.order_digest
        return replace(
            self.persistence.poll(),
            sum_sq=sum_sq,
            problems=float(bool(problem)),
            options=options,
            options_sq=options * options,
            order=order,
            order_sq=order * order,
        )

    def _raise_disagreement(self, agreed: Agreement, problem: str | None) -> None:
        """Raise on every rank, nothing updated, what any rank found wrong."""
        ranks = self.comm.size
        if agreed.problems:
            self._discard()
            self.comm.agree(problem)
        if not Agreement.same(agreed.options, agreed.options_sq, ranks):
            self._discard()
            raise CollectiveError(
                f"param_groups options ({', '.join(self.rule.options)}) "
                "differ between ranks: set them to the same values on every "
                "rank (nothing was updated)"
            )
        if not Agreement.same(agreed.order, agreed.order_sq, ranks):
            self._discard()
            raise CollectiveError(
                "the ranks handed their gradients over in different orders, "
                "so their reductions did not match: hand the same tensors "
                "over in the same order on every rank (nothing was updated)"
            )

    def _discard(self) -> None:
        """Drop this step's gradients, and the residuals their quantizing left (error
        feedback): nothing of the step is applied."""
        self.zero_grad()
        self.gradients.rescale_feedback(0.0)

    def _check_param_groups(self) -> str | None:
        """A message if a group's options were set to invalid values since the last step
        (valid ones are stored back normalized: NumPy scalars become plain floats)."""
        problem = None
        for index, group in enumerate(self.counters.param_groups):
            try:
                group.update(self.rule.check_options(**group_options(group, self.rule, dict)))
            except Exception as exc:  # noqa: BLE001 - reported on every rank by the step
                problem = problem or f"param_groups[{index}]: {exc}"
        return problem

    def _options_digest(self) -> int:
        """A 20-bit digest of every group's options, to compare across ranks."""
        text = repr([group_options(g, self.rule) for g in self.counters.param_groups]).encode()
        return int(hashlib.sha256(text).hexdigest()[:5], 16)


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_max_grad_norm(value, checked):
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"max_grad_norm={value!r} must be a finite number > 0, or None for no clipping"
        )
    return float(value)
