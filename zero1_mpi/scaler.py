"""Loss scaling for fp16 training: an immutable ``LossScaler`` record and its update rule.

The user multiplies the loss by ``scale`` before backward; the optimizer divides the gradients
by it inside the fused kernel. ``update(overflow)`` returns the next scaler: a dynamic one backs
off after an overflow and grows after ``growth_interval`` overflow-free steps (as
``torch.cuda.amp.GradScaler``); a fixed one never changes. ``state()`` / ``from_state`` keep every
field, for checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

__all__ = ["LossScaler", "FLOAT32_MAX"]

FLOAT32_MAX = 3.4028234663852886e38  # gradients are at most fp32: a larger scale is useless


@dataclass(frozen=True)
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"LossScaler {field}={getattr(self, field)!r} {why}")

        for field in ("scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                bad(field, "must be a finite number > 0")
        if self.growth_factor < 1:
            bad("growth_factor", "must be >= 1 (the scale grows after good steps)")
        if self.backoff_factor >= 1:
            bad("backoff_factor", "must be < 1 (the scale shrinks after an overflow)")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            bad("growth_interval", "must be an integer >= 1")
        if self.dynamic and self.scale < self.min_scale:
            bad("scale", f"must be >= min_scale={self.min_scale!r}")

    @classmethod
    def fixed(cls, scale: float = 1.0) -> LossScaler:
        return cls(scale=scale)

    @classmethod
    def dynamic_scaler(
        cls,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> LossScaler:
        return cls(
            scale=init_scale,
            dynamic=True,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
        )

    @classmethod
    def from_option(cls, loss_scale) -> LossScaler:
        """``None`` (no scaling), a number (fixed), ``"dynamic"``, or a ``LossScaler``."""
        if isinstance(loss_scale, LossScaler):
            return loss_scale
        if loss_scale is None:
            return cls()
        if loss_scale == "dynamic":
            return cls.dynamic_scaler()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            if not (math.isfinite(loss_scale) and loss_scale > 0):
                raise ValueError(
                    f"loss_scale={loss_scale!r} must be a finite number > 0 (a fixed scale), "
                    "None or 'dynamic'"
                )
            return cls.fixed(float(loss_scale))
        raise ValueError(
            f"loss_scale={loss_scale!r} is not understood: use None, a number "
            "(fixed scale), 'dynamic', or LossScaler.dynamic_scaler(...)"
        )

    @property
    def at_minimum(self) -> bool:
        """True when an overflow can no longer be answered by a smaller scale."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, overflow: bool) -> LossScaler:
        if not self.dynamic:
            return self
        if overflow:
            return replace(
                self, scale=max(self.min_scale, self.scale * self.backoff_factor), good_steps=0
            )
        if self.good_steps + 1 >= self.growth_interval:
            grown = self.scale * self.growth_factor
            return replace(self, scale=grown if grown <= FLOAT32_MAX else self.scale, good_steps=0)
        return replace(self, good_steps=self.good_steps + 1)

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> LossScaler:
        return cls(**state)
