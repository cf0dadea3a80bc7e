"""An optimizer's inputs, checked and agreed on every rank before anything is allocated.

``configure(params, comm, rule, defaults, options)`` builds the communicator (or takes the
``Communicator`` passed), checks the rule, the param groups, the arrays and every engine option
(``options.check_options``), raises any rank's error on every rank, checks that all ranks passed
the same options and rule settings, and builds the flat layout and checks that every rank built
the same one, naming the first difference. It returns a ``Setup``. Collectives: all ranks, in
the same order whatever the inputs, so that a bad value on one rank cannot leave another
waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.communicator import CollectiveError, Communicator
from ..flat.inputs import check_arrays, group_options, normalize_groups
from ..flat.layout import Layout, build_layout
from ..rules.protocol import missing_members
from .options import EngineOptions, check_options, python_scalar

__all__ = ["Setup", "configure"]


@dataclass(frozen=True)
class Setup:
    """The optimizer's inputs, checked and agreed on every rank: the communicator (and
    whether the optimizer built it), the param groups, the arrays by name, their backend
    (``"numpy"`` or ``"cupy"``), the engine options and the layout."""

    comm: Communicator
    owns_comm: bool
    groups: list
    arrays: dict
    backend: str
    options: EngineOptions
    layout: Layout


def configure(params, comm, rule, defaults: dict, given: dict) -> Setup:
    """Check every input, raise any error on every rank, and check that all ranks passed the
    same options and parameters (collectives: on all ranks, before any other)."""
    owns_comm = not isinstance(comm, Communicator)
    if owns_comm:
        comm = Communicator(comm, cuda_aware=python_scalar(given.get("cuda_aware")))
    node = comm.node_ranks()
    error = None  # the try binds the rest, or agree() raises on every rank
    try:
        if missing_members(rule):
            raise TypeError(
                f"rule={rule!r} lacks {', '.join(missing_members(rule))}: "
                "subclass zero1_mpi.rules.Rule and define them"
            )
        settings = rule.settings()
        groups, arrays = normalize_groups(params, defaults, rule)
        backend = check_arrays(arrays)
        options = check_options(
            given, {"arrays": arrays, "comm": comm, "comm_given": not owns_comm, "node": node}
        )
        layout = build_layout(
            {name: tuple(a.shape) for name, a in arrays.items()},
            options.shard_group_size,
            options.param_dtype.name,
            bucket_elements=options.bucket_elements,
            param_group_tensors=[len(g["names"]) for g in groups],
            units=None if options.units is None else dict(options.units),
        )
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    comm.agree(error)
    comm.check_same(
        {
            **settings,
            "backend": backend,
            "param group options": [group_options(g, rule) for g in groups],
            **options.agreed(),
        },
        "an option",
        "construct the optimizer with the same arguments on every rank",
    )
    _check_layouts_agree(comm, layout)
    return Setup(comm, owns_comm, groups, arrays, backend, options, layout)


def _check_layouts_agree(comm: Communicator, layout) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built one layout."""
    try:
        comm.check_same(
            layout.fingerprint,
            "the parameter layout",
            "every rank must pass the same tensors in the same param groups, in the same order",
        )
    except CollectiveError:
        described = comm.allgather_objects(
            ([(t.name, t.shape) for t in layout.tensors], ("param_dtype", layout.dtype))
        )
        mine = described[0]
        for other, theirs in enumerate(described):
            if theirs == mine:
                continue
            if len(theirs[0]) != len(mine[0]):
                diff = (f"{len(mine[0])} tensors", f"{len(theirs[0])} tensors")
            else:
                diff = next(
                    (
                        (a, b)
                        for a, b in zip(mine[0] + [mine[1]], theirs[0] + [theirs[1]])
                        if a != b
                    ),
                    ("one grouping of the tensors", "another"),
                )
            raise CollectiveError(
                f"ranks passed different parameters: rank 0 has {diff[0]}, rank {other} "
                f"has {diff[1]}: every rank must pass the same names, shapes and dtypes "
                "in the same order"
            ) from None
        raise
