"""Checks shared by the rules' ``check_options``: each returns the value normalized or raises a
ValueError that names the value and what it must be."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["number", "non_negative", "betas"]


def number(value, name: str) -> float:
    """A finite number, as a float (bools are refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.floating))
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return float(value)


def non_negative(value, name: str, hint: str = "") -> float:
    """A finite number >= 0, as a float; ``hint`` is appended to the error."""
    value = number(value, name)
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0{hint}")
    return value


def betas(value, example: str) -> tuple[float, float]:
    """A pair of numbers in [0, 1); ``example`` shows a good pair in the error."""
    try:
        beta1, beta2 = value
    except (TypeError, ValueError):
        raise ValueError(f"betas={value!r} must be a pair such as {example}") from None
    pair = number(beta1, "betas[0]"), number(beta2, "betas[1]")
    for i, beta in enumerate(pair):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta!r} must be in [0, 1)")
    return pair
