"""optax's names of the update rules' options, for users who bring an optax call along.

``OPTAX`` is the one table: each optax name either means a zero1_mpi option (``learning_rate``
is ``lr``; ``b1`` and ``b2`` are the elements of ``betas``), or has no zero1_mpi counterpart,
in which case only its neutral value (what zero1_mpi does anyway: ``eps_root=0.0``,
``mu_dtype=None``, ``nesterov=False``) is taken, and dropped, and any other value is refused
naming the option and what to use instead. ``spell(given, own, defaults, where)`` applies it to
a dict of options. Names the optimizer takes itself (``nesterov`` of SGD) are never translated.
Same meaning only: optax's defaults (``adamw``'s ``weight_decay=1e-4``) are not zero1_mpi's.
Pure: no arrays, no MPI.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["Spelling", "OPTAX", "spell"]

_NONE = object()  # a Spelling with no neutral value


@dataclass(frozen=True)
class Spelling:
    """An optax option: ``ours``, the zero1_mpi option it is (``index``: one element of that
    pair), or None: no counterpart, where ``neutral`` is the one value that means what
    zero1_mpi does and ``hint`` says what to use instead of another."""

    ours: str | None
    index: int | None = None
    neutral: object = _NONE
    hint: str = ""


_STATE_DTYPE = "zero1_mpi stores all of the rule's state in state_dtype ('bfloat16' or 'int8')"

#: optax's names, by name.
OPTAX = {
    "learning_rate": Spelling("lr"),
    "b1": Spelling("betas", 0),
    "b2": Spelling("betas", 1),
    "eps_root": Spelling(
        None,
        neutral=0.0,
        hint="zero1_mpi adds eps outside the square root only (optax's eps): pass eps",
    ),
    "mu_dtype": Spelling(None, neutral=None, hint=_STATE_DTYPE),
    "accumulator_dtype": Spelling(None, neutral=None, hint=_STATE_DTYPE),
    "nesterov": Spelling(
        None,
        neutral=False,
        hint="only 'sgd' has Nesterov momentum (nesterov=True); Adam, Lion and LAMB have none",
    ),
}


def spell(given: Mapping, own: Collection[str], defaults: Mapping, where: str = "") -> dict:
    """``given`` with optax's names (``OPTAX``) replaced by zero1_mpi's; ``own``: the names the
    optimizer takes as they are; ``defaults``: where a pair takes the element not given
    (``b1`` alone: ``betas[1]``). ``where`` prefixes the errors (``"groups[0]: "``): a
    ValueError naming the option, for both spellings of one option or a value that has no
    zero1_mpi meaning."""
    out = {name: value for name, value in given.items() if name in own or name not in OPTAX}
    pairs: dict[str, dict[int, object]] = {}
    for name, value in given.items():
        if name in out:
            continue
        spelling = OPTAX[name]
        if spelling.ours is None:
            if not _is(value, spelling.neutral):
                raise ValueError(
                    f"{where}{name}={value!r} is an optax option zero1_mpi has not: "
                    f"{spelling.hint}; or drop it"
                )
            continue
        if spelling.ours in given:
            raise ValueError(
                f"{where}{name}= (optax's name) and {spelling.ours}= both given: pass one"
            )
        if spelling.index is None:
            out[spelling.ours] = value
        else:
            pairs.setdefault(spelling.ours, {})[spelling.index] = value
    for ours, parts in pairs.items():
        if ours not in defaults:
            named = " and ".join(n for n in OPTAX if OPTAX[n].ours == ours)
            raise ValueError(f"{where}{named} set {ours}, which this optimizer does not take")
        pair = list(defaults[ours])
        for index, value in parts.items():
            pair[index] = value
        out[ours] = tuple(pair)
    return out


def _is(value, neutral) -> bool:
    """Is ``value`` the neutral value (None and False by identity, a number by value)?"""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == neutral
