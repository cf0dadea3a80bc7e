"""What a pytree of parameters becomes for the core optimizer (``zero1_mpi.jax``'s input side).

``leaf_names(tree)`` names each leaf by its path (an nnx ``Variable``'s ``.value`` left out).
``core_inputs(params, cls, groups, mask, options)`` checks the leaves (floating-point arrays
only: any other leaf is named, with the fix) and returns a ``CoreInputs``: the names, the tree
structure, the core's ``params`` (param groups from selectors, split by optax's ``mask`` of
weight decay, each group's whole 64-byte leaves first), the options with optax's names
replaced (``spellings``) and each schedule given as ``lr`` replaced by its value at count 0,
and those schedules by core group index. Local: errors are TypeError or ValueError naming the
leaf, the group or the option, which the caller raises on every rank. Imports JAX.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..kernels.backend import BFLOAT16
from ..moved import warn_deprecated
from .optax_names import spell
from .schedules import is_schedule

try:
    import jax
except ImportError:  # the module still imports (tools, docs); its functions need JAX
    jax, _TRACER = None, ()
else:
    _TRACER = getattr(jax.core, "Tracer", ())

__all__ = [
    "ALIGNMENT",
    "CoreInputs",
    "core_inputs",
    "leaf_names",
    "old_leaf_names",
    "warn_old_names",
    "path_name",
    "is_tracer",
]

#: Bytes: XLA:CPU makes a JAX array of host memory without a copy only at this alignment.
ALIGNMENT = 64


class CoreInputs(NamedTuple):
    """What ``core_inputs`` found: the leaf names and tree structure of ``params``, and the
    core optimizer's ``params``, options and schedules (by core group index)."""

    names: list[str]
    treedef: Any
    params: Any
    options: dict
    schedules: dict[int, Callable]
    #: 0.1.0's name -> today's, for the leaves whose name changed (nnx Variables').
    old_names: dict[str, str]


def core_inputs(params, cls, groups, mask, options: dict) -> CoreInputs:
    """The core optimizer's inputs for a pytree ``params`` and ``ZeroOptimizer``'s ``groups``,
    ``mask`` and ``options``, ``cls`` being the optimizer class (the module's contract)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    names = leaf_names(params)
    arrays = _host_params(names, leaves)
    # 0.1.0's name -> today's, where they differ (an nnx Variable's)
    old = {o: n for o, n in zip(old_leaf_names(params), names) if o != n}
    options, groups = _spelled(cls, options, groups, mask is not None)
    exempt = _masked_out(mask, params, names, old)
    grouped = _grouped(arrays, groups, _itemsize(arrays, options), exempt, old)
    options, schedules = _scheduled(grouped, options)
    return CoreInputs(names, treedef, grouped, options, schedules, old)


def is_tracer(value) -> bool:
    """Is ``value`` a JAX tracer (inside ``jax.jit``)?"""
    return isinstance(value, _TRACER)


def leaf_names(tree) -> list[str]:
    """The name of each leaf of ``tree``, in ``jax.tree_util.tree_leaves`` order: its path's
    keys joined by ``/`` (dict keys, sequence indices, attribute names: ``"layers/0/w"``),
    but for a last attribute ``value`` (a ``flax.nnx.Variable``'s array): an nnx State's
    ``Param`` at ``model.lin.kernel`` is ``"lin/kernel"``, as in ``nnx.to_pure_dict(state)``."""
    return [path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def old_leaf_names(tree) -> list[str]:
    """``leaf_names`` as 0.1.0 gave them: an nnx Variable's array named ``lin/kernel/value``.
    Selectors, masks and checkpoints of those names are taken until 0.2.0, with a
    ``DeprecationWarning``."""
    return [path_name(p, True) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def warn_old_names(what: str) -> None:
    """The ``DeprecationWarning`` for 0.1.0's leaf names found in ``what``."""
    warn_deprecated(
        f"{what} uses 0.1.0's leaf names (an nnx Variable's ending in '/value'), taken until "
        "0.2.0: name leaves as leaf_names() does now ('lin/kernel', as nnx.to_pure_dict)"
    )


def path_name(path, as_in_0_1_0: bool = False) -> str:
    """A tree path's name: its keys joined by ``/`` (see ``leaf_names``); ``as_in_0_1_0``:
    as 0.1.0 named it, an nnx Variable's array with ``/value`` (``old_leaf_names``)."""
    if (
        not as_in_0_1_0
        and path
        and getattr(path[-1], "name", None) == "value"
        and not hasattr(path[-1], "key")
    ):
        path = path[:-1]  # an nnx Variable's array: named as the Variable
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


#: What to do with leaves that are not parameters.
_FILTER = (
    "pass only the parameters: with flax.nnx, nnx.split(model, nnx.Param, ...) or "
    "nnx.state(model, nnx.Param); with another pytree, leave those leaves out of it (a "
    "Python number that is a parameter: make it an array, jnp.asarray(x, jnp.float32))"
)


def _host_params(names: list[str], leaves: list) -> dict[str, np.ndarray]:
    """The leaves as NumPy arrays by name (read-only views of JAX arrays; the core copies
    them); TypeError naming the leaves that are not floating-point arrays, or ValueError
    naming two leaves of one name."""
    arrays, wrong = {}, []
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, _TRACER):
            raise TypeError(f"params[{name!r}] is a tracer: build ZeroOptimizer outside jax.jit")
        what = _not_a_parameter(leaf)
        if what:
            wrong.append(f"{name!r} ({what})")
        elif name in arrays:
            raise ValueError(
                f"two leaves of params have the same name {name!r}: rename one (names join "
                "the path's keys with '/')"
            )
        else:
            arrays[name] = np.asarray(leaf)
    if wrong:
        listed = ", ".join(wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise TypeError(
            f"params holds leaves that are not floating-point parameters: {listed}: {_FILTER}"
        )
    return arrays


def _not_a_parameter(leaf) -> str | None:
    """What ``leaf`` is when it is not a floating-point array (None when it is one)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return f"a Python {type(leaf).__name__}" if np.ndim(leaf) == 0 else type(leaf).__name__
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return f"a PRNG key array, {dtype}"
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return f"dtype {dtype}"
    if kind != "f" and np.dtype(dtype) != BFLOAT16:
        return f"dtype {np.dtype(dtype).name}"
    return None


def _signature(cls) -> tuple[set[str], dict, set[str]]:
    """Of the optimizer class ``cls``: the names its constructor takes, their defaults and
    the names of its rule's options (those before the keyword-only ones)."""
    taken = list(inspect.signature(cls).parameters.values())[2:]  # after params, comm
    names = {p.name for p in taken if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    defaults = {p.name: p.default for p in taken if p.default is not p.empty}
    return names, defaults, {p.name for p in taken if p.kind is p.POSITIONAL_OR_KEYWORD}


def _spelled(cls, options: dict, groups, masked: bool):
    """``options`` and the groups' options with optax's names replaced by zero1_mpi's
    (``spellings.spell``), and their schedules checked (``_check_schedules``)."""
    own, defaults, rule_options = _signature(cls)
    if options.get("shard_params"):
        raise ValueError(
            "shard_params=True is refused for JAX: a jitted step reads the whole parameter "
            "pytree at once, so every unit would be gathered together and nothing saved over "
            "shard_gradients=True (stage 2), which JAX takes; see docs/stage3.md"
        )
    options = spell(options, own, defaults)
    if masked and "weight_decay" not in rule_options:
        raise TypeError(
            f"mask= chooses the leaves weight decay applies to, but {cls.__name__} has no "
            "weight_decay option: drop mask"
        )
    _check_schedules(options, rule_options, "")
    if not isinstance(groups, (list, tuple)):
        return options, groups  # (None, or refused by _grouped)
    spelled, merged = [], {**defaults, **options}
    for index, group in enumerate(groups):
        if isinstance(group, Mapping) and "params" in group:  # (else refused by _grouped)
            where = f"groups[{index}]: "
            own_options = spell(
                {k: v for k, v in group.items() if k != "params"}, own, merged, where
            )
            _check_schedules(own_options, own_options, where)
            group = {"params": group["params"], **own_options}
        spelled.append(group)
    return options, spelled


def _check_schedules(options: dict, names: Collection[str], where: str) -> None:
    """A schedule given as ``lr`` must give a value at count 0 (ValueError), and no other
    option of ``names`` may be a function (TypeError); ``where`` prefixes the errors."""
    for name, value in options.items():
        if name == "lr" and is_schedule(value):
            try:
                value(0)
            except Exception as exc:
                raise ValueError(
                    f"{where}lr={value!r} is taken as a schedule, a function of the step "
                    f"count, but it raised at count 0: {type(exc).__name__}: {exc}"
                ) from exc
        elif name in names and is_schedule(value):
            raise TypeError(
                f"{where}{name}={value!r} is a function, but only lr (learning_rate) may be a "
                f"schedule: pass a number (and set opt.param_groups[i][{name!r}] between "
                "steps to change it)"
            )


def _masked_out(mask, params, names: list[str], old: Mapping[str, str]) -> set[str]:
    """The names of the leaves that ``mask`` (optax's: a pytree of bools like ``params``, or
    a prefix of it, or a function ``params -> such a pytree``; True where weight decay
    applies) exempts from weight decay; TypeError or ValueError naming the mask's leaf."""
    if mask is None:
        return set()
    tree = mask(params) if callable(mask) else mask
    given: dict[str, bool] = {}
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_name(path)
        if not _is_bool(value):
            raise TypeError(
                f"mask[{name!r}] is {value!r}: a mask's leaves must be True (weight decay "
                "applies) or False (none)"
            )
        if name in old and name not in names:
            warn_old_names(f"mask[{name!r}]")
            name = old[name]
        if name in given:
            raise ValueError(f"two leaves of mask have the same name {name!r}: rename one")
        given[name] = bool(value)
    exempt, used, missing = set(), set(), []
    for name in names:
        parts = name.split("/")
        cover = next(
            (p for p in ("/".join(parts[:k]) for k in range(len(parts), -1, -1)) if p in given),
            None,
        )
        if cover is None:
            missing.append(name)
            continue
        used.add(cover)
        if not given[cover]:
            exempt.add(name)
    extra = [m for m in given if m not in used]
    if missing or extra:
        what = "; ".join(
            part
            for part in (
                missing and f"it has no value for {missing[:3]}",
                extra and f"it has {extra[:3]} that params lacks",
            )
            if part
        )
        raise ValueError(
            f"mask is not a pytree like params (or a prefix of it): {what}: pass True or "
            "False for each leaf of params (or subtree), or a function params -> such a pytree"
        )
    return exempt


def _is_bool(value) -> bool:
    """Is ``value`` one bool (Python's, NumPy's or a 0-d array of dtype bool)?"""
    if isinstance(value, (bool, np.bool_)):
        return True
    return (
        not isinstance(value, _TRACER)
        and getattr(value, "dtype", None) == np.bool_
        and np.shape(value) == ()
    )


def _scheduled(core_params, options: dict) -> tuple[dict, dict[int, Callable]]:
    """``options`` and the groups of ``core_params`` (changed in place) with a schedule given
    as ``lr`` replaced by its value at count 0, and the schedule of each group by index."""
    default = options.get("lr")
    if is_schedule(default):
        options = {**options, "lr": default(0)}  # (each checked by _check_schedules)
    groups = [core_params] if isinstance(core_params, Mapping) else core_params
    schedules: dict[int, Callable] = {}
    for index, group in enumerate(groups):
        lr = group.get("lr", default) if group is not core_params else default
        if is_schedule(lr):
            schedules[index] = lr
            if group is not core_params and "lr" in group:
                group["lr"] = lr(0)
    return options, schedules


def _itemsize(arrays: dict, options: dict) -> int:
    """The bytes of one parameter element in the flat buffer, as far as known here (the core
    checks ``param_dtype`` and the leaves' dtypes)."""
    from ..kernels.backend import resolve_dtype

    try:
        if options.get("param_dtype") is not None:
            return np.dtype(resolve_dtype(options["param_dtype"])).itemsize
        return max(a.dtype.itemsize for a in arrays.values())
    except Exception:  # noqa: BLE001 - the core raises the real error
        return 1


def _grouped(arrays: dict, groups, itemsize: int, exempt: Collection[str] = (), old=None):
    """The core's ``params``: one mapping, or a list of groups (the leaves no group selects
    first; each split in two where ``exempt`` names some of its leaves but not all: those
    get ``weight_decay=0.0``), each ordered whole-64-byte leaves first."""
    if groups is None and not exempt:
        return _aligned_first(arrays, itemsize)
    groups = groups if groups is not None else []
    if isinstance(groups, Mapping) or not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"groups must be a list of {{'params': selector, <options>}} dicts, got "
            f"{type(groups).__name__}"
        )
    chosen: list[dict] = [{} for _ in groups]
    rest: dict = {}
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise TypeError(
                f"groups[{index}] must be a dict with a 'params' selector (a "
                "function (name, leaf) -> bool or a collection of names)"
            )
        selector = group["params"]
        if isinstance(selector, str) or not (
            callable(selector) or isinstance(selector, Collection)
        ):
            raise TypeError(
                f"groups[{index}]['params'] must be a function (name, leaf) -> bool "
                f"or a collection of leaf names, got {selector!r}"
            )
    selects = [_selects(group["params"], index, arrays, old or {}) for index, group in
               enumerate(groups)]  # fmt: skip
    for name, array in arrays.items():
        for index, chooses in enumerate(selects):
            if chooses(name, array):
                chosen[index][name] = array
                break
        else:
            rest[name] = array
    found = []
    for group, members in [({}, rest), *zip(groups, chosen)]:
        decayed = {n: a for n, a in members.items() if n not in exempt}
        others = {n: a for n, a in members.items() if n in exempt}
        if decayed:
            found.append({**group, "params": _aligned_first(decayed, itemsize)})
        if others:
            found.append({**group, "params": _aligned_first(others, itemsize), "weight_decay": 0.0})
    return found


def _selects(selector, index: int, arrays: dict, old: Mapping[str, str]):
    """Group ``index``'s ``selector`` as ``f(name, leaf) -> bool`` over today's names: a
    function, or a collection of names; 0.1.0's names (``old``: theirs -> today's) where today's
    select nothing, with a warning; a ValueError for names params lacks, or a selector that
    selects no leaf."""
    where = f"groups[{index}]['params']"
    if not callable(selector):
        names = set(selector)
        renamed = {old[n] for n in names if n not in arrays and n in old}
        if renamed:
            warn_old_names(where)
        unknown = sorted(n for n in names - set(arrays) if n not in old)
        if unknown:
            raise ValueError(
                f"{where} names leaves that params lacks: {unknown}; the names are {list(arrays)}"
            )
        names = (names & set(arrays)) | renamed
        if names:
            return lambda name, leaf: name in names
    elif any(selector(n, a) for n, a in arrays.items()):
        return selector
    else:
        today = {n: o for o, n in old.items()}
        if any(selector(today[n], a) for n, a in arrays.items() if n in today):
            warn_old_names(where)
            return lambda name, leaf: selector(today.get(name, name), leaf)
    first = list(arrays)[:6]
    raise ValueError(
        f"{where} selects no leaf of the {len(arrays)} of params, "
        f"named like {first}{' ...' if len(arrays) > 6 else ''} (leaf_names(params))"
    )


def _aligned_first(arrays: dict, itemsize: int) -> dict:
    """``arrays`` with those of a whole number of 64-byte lines first, each part in order."""
    whole = {n: a for n, a in arrays.items() if a.size * itemsize % ALIGNMENT == 0}
    return {**whole, **{n: a for n, a in arrays.items() if n not in whole}}
