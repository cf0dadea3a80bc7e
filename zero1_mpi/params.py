"""What the user passes in, checked and normalized: parameters, param groups, hyperparameters.

Pure and local (no MPI): each function returns normalized values or raises TypeError or
ValueError with a message that names the value and the fix. The optimizer runs them on every
rank and turns any failure into the same error everywhere before the first collective.

``params`` is either a mapping name -> array (one group) or a list of group dicts
``{"params": {name: array}, "lr": ..., "betas": ..., "eps": ..., "weight_decay": ...}`` as in
``torch.optim``; options missing from a group take the optimizer's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from . import backend

GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay")
REDUCE_DTYPES = ("float32", "float16")


def normalize_groups(params, defaults: dict) -> tuple[list[dict], dict]:
    """``(groups, arrays)``: groups as ``{"names": (...), lr, betas, eps, weight_decay}`` in
    order, and all arrays by name in that same order."""
    if isinstance(params, Mapping):
        raw = [{"params": params}]
    elif isinstance(params, (list, tuple)) and params and all(isinstance(g, Mapping)
                                                              for g in params):
        raw = list(params)
    else:
        raise TypeError(f"params must be a mapping of name -> array or a non-empty list of "
                        f"group dicts, got {type(params).__name__}: pass e.g. {{'w': w, 'b': b}} "
                        "or [{'params': {'w': w}}, {'params': {'b': b}, 'weight_decay': 0.0}]")
    groups, arrays = [], {}
    for index, group in enumerate(raw):
        where = "params" if isinstance(params, Mapping) else f"params[{index}]"
        unknown = sorted(set(group) - {"params", *GROUP_OPTIONS})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}: a group may set 'params' "
                             f"and {', '.join(GROUP_OPTIONS)}")
        members = group.get("params")
        if not isinstance(members, Mapping):
            raise TypeError(f"{where}['params'] must be a mapping of name -> array, got "
                            f"{type(members).__name__}")
        for name, array in members.items():
            if name in arrays:
                raise ValueError(f"parameter {name!r} appears in more than one group: put "
                                 "each parameter in exactly one")
            arrays[name] = array
        options = {key: group.get(key, defaults[key]) for key in GROUP_OPTIONS}
        groups.append({"names": tuple(members), **check_hyperparameters(**options)})
    if not arrays:
        raise ValueError("params is empty: pass at least one named array")
    return groups, arrays


def group_record(group: dict) -> dict:
    """A param group as plain JSON values: its names and its (checked) Adam options."""
    options = check_hyperparameters(**{key: group[key] for key in GROUP_OPTIONS})
    return {"names": list(group["names"]), **options, "betas": list(options["betas"])}


def restore_options(groups: list[dict], records: list[dict]) -> list[dict]:
    """The checked options of saved ``records`` for ``groups`` (same names), to apply later."""
    if [list(g["names"]) for g in groups] != [list(r["names"]) for r in records]:
        raise ValueError(f"the saved param groups ({[len(r['names']) for r in records]} tensors "
                         "per group) differ from the optimizer's: build it with the same groups")
    return [check_hyperparameters(**{key: r[key] for key in GROUP_OPTIONS}) for r in records]


def decay_groups(params: Mapping, weight_decay: float = 1e-2, no_decay=None) -> list[dict]:
    """Two param groups: weight decay for matrices, none for biases and norm scales.

    ``no_decay(name, array) -> bool`` picks the exempt parameters; by default those with
    fewer than two dimensions. Pass the result as ``params`` to ``ZeroAdamW``.
    """
    exempt = no_decay or (lambda name, array: np.ndim(array) < 2)
    decay = {k: v for k, v in params.items() if not exempt(k, v)}
    rest = {k: v for k, v in params.items() if exempt(k, v)}
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def check_arrays(arrays: Mapping, param_dtype) -> tuple[np.dtype, str]:
    """``(param dtype, backend name)`` for valid arrays."""
    backends, dtypes = set(), set()
    for name, array in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter name {name!r} must be a str")
        kind = backend.backend_name(array)
        if kind is None:
            raise TypeError(f"params[{name!r}] is a {type(array).__name__}: pass a NumPy or "
                            "CuPy array (convert other frameworks' tensors with np.asarray or "
                            "cupy.from_dlpack)")
        if array.dtype.kind != "f" and array.dtype != backend.BFLOAT16:
            raise TypeError(f"params[{name!r}] has dtype {array.dtype}: parameters must be "
                            "floating point (float32, float16 or bfloat16)")
        if array.size and not bool(backend.xp_for(kind).isfinite(array).all()):
            raise ValueError(f"params[{name!r}] holds non-finite values (inf or nan): "
                             "initialize it with finite numbers")
        backends.add(kind)
        dtypes.add(np.dtype(array.dtype))
    if len(backends) > 1:
        raise TypeError("params mixes NumPy and CuPy arrays: put all of them on the host or "
                        "all on the GPU")
    if param_dtype is None:
        if len(dtypes) > 1:
            names = ", ".join(sorted(d.name for d in dtypes))
            raise ValueError(f"params have several dtypes ({names}): pass "
                             "param_dtype='float32', 'float16' or 'bfloat16'")
        (param_dtype,) = dtypes
        if param_dtype.name not in backend.PARAM_DTYPES:
            raise ValueError(f"params have dtype {param_dtype.name}, which is not a parameter "
                             "dtype: pass param_dtype='float32', 'float16' or 'bfloat16'")
    dtype = backend.resolve_dtype(param_dtype)
    limit = float(ml_dtypes.finfo(dtype).max)
    for name, array in arrays.items():
        peak = float(abs(array).max()) if array.size else 0.0
        if peak > limit:
            raise ValueError(f"params[{name!r}] holds {peak:g}, beyond the largest {dtype.name} "
                             f"({limit:g}): scale the initial values or choose a wider "
                             "param_dtype")
    return dtype, backends.pop()


def check_hyperparameters(lr, betas, eps, weight_decay) -> dict:
    """The four Adam options as floats, or a ValueError naming the bad one."""
    def number(value, name):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")
        return float(value)

    lr, eps = number(lr, "lr"), number(eps, "eps")
    weight_decay = number(weight_decay, "weight_decay")
    if lr < 0:
        raise ValueError(f"lr={lr!r} must be >= 0")
    if eps < 0:
        raise ValueError(f"eps={eps!r} must be >= 0 (torch's default is 1e-8)")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas={betas!r} must be a pair such as (0.9, 0.999)") from None
    beta1, beta2 = number(beta1, "betas[0]"), number(beta2, "betas[1]")
    for i, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta!r} must be in [0, 1)")
    return {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay}


def check_reduce_dtype(reduce_dtype, dtype: np.dtype) -> str:
    try:
        name = reduce_dtype if isinstance(reduce_dtype, str) else np.dtype(reduce_dtype).name
    except TypeError:
        name = None
    if name not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} is not supported: use 'float32' "
                         "(default) or 'float16' (float16 parameters only)")
    if name == "float16" and dtype != np.float16:
        raise ValueError(f"reduce_dtype='float16' needs float16 gradients, but param_dtype is "
                         f"{dtype.name}: use reduce_dtype='float32'")
    return name


def check_max_grad_norm(max_grad_norm) -> float | None:
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0, or "
                         "None for no clipping")
    return float(max_grad_norm)
