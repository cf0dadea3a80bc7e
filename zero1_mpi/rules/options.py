"""Checks shared by the rules' ``check_options``: each returns the value normalized or raises a
ValueError that names the value and what it must be."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["number", "non_negative", "betas"]


def number(value, name: str) -> float:
    """A finite real number, as a float: a Python or NumPy int or float, or a 0-d array of a
    real dtype (NumPy, JAX, a torch tensor: an LR schedule's output). Bools are refused."""
    real = float(value) if _real_scalar(value) else math.nan
    if not math.isfinite(real):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return real


def _real_scalar(value) -> bool:
    """Is ``value`` one real number: an int or float, or a 0-d array or tensor of an integer or
    floating dtype (not bool, not complex, not a JAX tracer)?"""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, float, np.integer, np.floating)):
        return True
    if getattr(value, "shape", None) != () or type(value).__name__.endswith("Tracer"):
        return False
    dtype: Any = getattr(value, "dtype", None)
    if hasattr(dtype, "is_floating_point"):  # a torch.dtype
        return not dtype.is_complex and str(dtype) != "torch.bool"
    try:
        return np.dtype(dtype).kind in "fiu"
    except TypeError:
        return False


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
