"""What the user passes in, checked and normalized: parameters, param groups, hyperparameters.

Pure and local (no MPI): each function returns normalized values or raises TypeError or
ValueError with a message that names the value and the fix. The optimizer runs them on every
rank and turns any failure into the same error everywhere before the first collective.

``params`` is either a mapping name -> array (one group) or a list of group dicts
``{"params": {name: array}, "lr": ..., ...}`` as in ``torch.optim``, with the options of the
update rule (``rule.options``, checked by ``rule.check_options``); options missing from a group
take the optimizer's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from ..kernels import backend

__all__ = [
    "normalize_groups",
    "group_options",
    "group_record",
    "group_extras",
    "restore_options",
    "decay_groups",
    "check_arrays",
    "check_param_dtype",
]


def normalize_groups(params, defaults: dict, rule) -> tuple[list[dict], dict]:
    """``(groups, arrays)``: groups as ``{"names": (...), <the rule's options>}`` in order, and
    all arrays by name in that same order."""
    if isinstance(params, Mapping):
        raw = [{"params": params}]
    elif (
        isinstance(params, (list, tuple)) and params and all(isinstance(g, Mapping) for g in params)
    ):
        raw = list(params)
    else:
        raise TypeError(
            f"params must be a mapping of name -> array or a non-empty list of "
            f"group dicts, got {type(params).__name__}: pass e.g. {{'w': w, 'b': b}} "
            "or [{'params': {'w': w}}, {'params': {'b': b}, 'weight_decay': 0.0}]"
        )
    groups, arrays = [], {}
    for index, group in enumerate(raw):
        where = "params" if isinstance(params, Mapping) else f"params[{index}]"
        unknown = sorted(set(group) - {"params", *rule.options})
        if unknown:
            raise ValueError(
                f"{where} has unknown keys {unknown}: a group may set 'params' "
                f"and {', '.join(rule.options)}"
            )
        members = group.get("params")
        if not isinstance(members, Mapping):
            raise TypeError(
                f"{where}['params'] must be a mapping of name -> array, got "
                f"{type(members).__name__}"
            )
        for name, array in members.items():
            if name in arrays:
                raise ValueError(
                    f"parameter {name!r} appears in more than one group: put "
                    "each parameter in exactly one"
                )
            arrays[name] = array
        options = {key: group.get(key, defaults[key]) for key in rule.options}
        groups.append({"names": tuple(members), **rule.check_options(**options)})
    if not arrays:
        raise ValueError("params is empty: pass at least one named array")
    return groups, arrays


def group_options(group: dict, rule, kind=list):
    """A group's rule options, as a list of ``(key, value)`` pairs or (``kind=dict``) a dict."""
    pairs = [(key, group.get(key)) for key in rule.options]
    return dict(pairs) if kind is dict else pairs


def group_record(group: dict, rule) -> dict:
    """A param group as plain JSON values: its names, its (checked) options and the other
    plain values a caller keeps in it (an LR scheduler's ``initial_lr``: ``group_extras``)."""
    options = rule.check_options(**{key: group[key] for key in rule.options})
    return {
        "names": list(group["names"]),
        **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        **group_extras(group, rule),
    }


def group_extras(group: Mapping, rule, strict: bool = True) -> dict:
    """The values of ``group`` other than its tensors (``names``/``params``) and the rule's
    options, as JSON values (a 0-d array as a float, tuples as lists), for checkpoints; a
    ValueError names a value that has none (an object, an array, inf or nan), which
    ``strict=False`` leaves out instead."""
    extras = {}
    for key, value in group.items():
        if key in ("names", "params") or key in rule.options:
            continue
        try:
            extras[key] = _plain(value)
        except ValueError:
            if not strict:
                continue
            raise ValueError(
                f"param group value {key!r}={value!r} cannot be saved in a checkpoint: keep "
                "only numbers, strings, None or lists of them in param groups (or remove it)"
            ) from None
    return extras


def _plain(value):
    """``value`` as a JSON value (finite numbers, strings, bools, None, lists of them)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if getattr(value, "shape", None) == () and hasattr(value, "dtype"):
        value = value.item()  # a 0-d NumPy/JAX array or torch tensor
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (float, np.floating)) and np.isfinite(value):
        return float(value)
    raise ValueError(f"{value!r} is not a plain value")


def restore_options(groups: list[dict], records: list[dict], rule) -> list[dict]:
    """The checked options of saved ``records`` for ``groups`` (same names), with the records'
    other values (``group_extras``), to apply later."""
    if [list(g["names"]) for g in groups] != [list(r["names"]) for r in records]:
        raise ValueError(
            f"the saved param groups ({[len(r['names']) for r in records]} tensors "
            "per group) differ from the optimizer's: build it with the same groups"
        )
    return [
        {
            **group_extras(r, rule),
            **rule.check_options(**{key: r[key] for key in rule.options}),
        }
        for r in records
    ]


def decay_groups(params: Mapping, weight_decay: float = 1e-2, no_decay=None) -> list[dict]:
    """Two param groups: weight decay for matrices, none for biases and norm scales.

    ``no_decay(name, array) -> bool`` picks the exempt parameters; by default those with
    fewer than two dimensions. Pass the result as ``params`` to ``ZeroAdamW``.
    """
    exempt = no_decay or (lambda name, array: np.ndim(array) < 2)
    decay = {k: v for k, v in params.items() if not exempt(k, v)}
    rest = {k: v for k, v in params.items() if exempt(k, v)}
    return [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0},
        )
        if g["params"]
    ]


def check_arrays(arrays: Mapping) -> str:
    """The backend name (``"numpy"`` or ``"cupy"``) of valid parameter arrays."""
    backends = set()
    for name, array in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter name {name!r} must be a str")
        kind = backend.backend_name(array)
        if kind is None:
            raise TypeError(
                f"params[{name!r}] is a {type(array).__name__}: pass a NumPy or "
                "CuPy array (convert other frameworks' tensors with np.asarray or "
                "cupy.from_dlpack)"
            )
        if array.dtype.kind != "f" and array.dtype != backend.BFLOAT16:
            raise TypeError(
                f"params[{name!r}] has dtype {array.dtype}: parameters must be "
                "floating point (float32, float16 or bfloat16)"
            )
        if array.size and not bool(backend.xp_for(kind).isfinite(array).all()):
            raise ValueError(
                f"params[{name!r}] holds non-finite values (inf or nan): "
                "initialize it with finite numbers"
            )
        backends.add(kind)
    if len(backends) > 1:
        raise TypeError(
            "params mixes NumPy and CuPy arrays: put all of them on the host or all on the GPU"
        )
    return backends.pop()


def check_param_dtype(arrays: Mapping, param_dtype) -> np.dtype:
    """The parameters' dtype for ``param_dtype=`` (None: the arrays' one dtype) that holds
    every value of ``arrays`` (checked by ``check_arrays``)."""
    if param_dtype is None:
        dtypes = {np.dtype(array.dtype) for array in arrays.values()}
        if len(dtypes) > 1:
            names = ", ".join(sorted(d.name for d in dtypes))
            raise ValueError(
                f"params have several dtypes ({names}): pass "
                "param_dtype='float32', 'float16' or 'bfloat16'"
            )
        (param_dtype,) = dtypes
        if param_dtype.name not in backend.PARAM_DTYPES:
            raise ValueError(
                f"params have dtype {param_dtype.name}, which is not a parameter "
                "dtype: pass param_dtype='float32', 'float16' or 'bfloat16'"
            )
    dtype = backend.resolve_dtype(param_dtype)
    limit = float(ml_dtypes.finfo(dtype).max)
    for name, array in arrays.items():
        peak = float(abs(array).max()) if array.size else 0.0
        if peak > limit:
            raise ValueError(
                f"params[{name!r}] holds {peak:g}, beyond the largest {dtype.name} "
                f"({limit:g}): scale the initial values or choose a wider "
                "param_dtype"
            )
    return dtype
