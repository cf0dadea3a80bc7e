"""The memory tool: ``zero1-memory --params 7B --ranks 64`` (or ``python -m zero1_mpi.memory``).

Prints, per rank count, each rank's memory (GB = 1e9 bytes) for Ψ parameters: the baseline
(plain data parallelism), stages 1, 2 and 3 (2 with ``shard_gradients=True``, 3 with
``shard_params=True``), then the formulas in words. ``--rule``: the update rule, its bytes
per parameter K of the sharded part from ``zero1_mpi.rules.registry``; ``--param-dtype``;
``--offload cpu``: stage 1's device/host split (as ``MemoryReport``; ``--offload-fraction F``:
that share on the host); ``--shard-group-size G``:
the state sharded over G ranks. Bad input: argparse's one-line error, exit status 2.
``table_options`` and ``describe`` serve tools/memory_table.py too. It sits above the rules
(``zero1_mpi.memory`` imports none) and starts no MPI.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..memory import (
    FP32_DTYPES,
    MIXED_DTYPES,
    format_modes_table,
    format_param_count,
    format_table,
    parse_param_count,
)
from ..rules.registry import builtin_rules, get, rule_bytes_per_param, rule_states

__all__ = [
    "DEFAULT_MOMENTUM",
    "DEFAULT_RANKS",
    "describe",
    "formulas",
    "main",
    "momentum_arg",
    "param_count_arg",
    "table_options",
]

#: The reference chapter's table: 7B parameters on these rank counts.
DEFAULT_PARAMS, DEFAULT_RANKS = 7 * 10**9, (1, 4, 8, 16, 32, 64, 128)
DEFAULT_MOMENTUM = 0.9


def describe(rule: str = "adam", momentum: float = DEFAULT_MOMENTUM) -> str:
    """``ZeroAdam``, ``ZeroSGD (momentum 0.9)``, ...: the optimizer class that runs ``rule``."""
    name = get(rule).optimizer.__name__
    return f"{name} (momentum {momentum:g})" if rule == "sgd" else name


def masters_of(param_dtype: str, offload: bool | float) -> str:
    """How the engine keeps the masters by default (``masters="auto"``): bf16 parameters'
    as remainders, unless offloaded."""
    return "remainder" if param_dtype == "bfloat16" and not offload else "fp32"


def _k(rule: str, param_dtype: str, momentum: float, offload: bool | float = False) -> int | float:
    masters = masters_of(param_dtype, offload)
    return rule_bytes_per_param(rule, param_dtype, momentum != 0, masters)


def _num(x) -> str:
    return f"{x:g}"


def _stage1_label(k, param_dtype: str, offload: bool | float, divisor: str = "N") -> str:
    """``2Ψ+2Ψ+12Ψ/N``, or offloaded ``device 2Ψ+2Ψ, host 12Ψ/N`` (fp32: k + 4 on the host;
    a share ``offload`` < 1 of it: ``device 2Ψ+2Ψ+6Ψ/N, host 6Ψ/N``)."""
    replicated = "4Ψ+4Ψ" if param_dtype in FP32_DTYPES else "2Ψ+2Ψ"
    if offload:
        share = float(offload)
        host = share * (k + (4 if param_dtype in FP32_DTYPES else 0))
        device = f"+{_num((1 - share) * k)}Ψ/{divisor}" if share < 1 else ""
        return f"device {replicated}{device}, host {_num(host)}Ψ/{divisor}"
    return f"{replicated}+{_num(k)}Ψ/{divisor}"


def table_options(
    rule: str = "adam",
    param_dtype: str = "float16",
    momentum: float = DEFAULT_MOMENTUM,
    offload: bool | float = False,
) -> dict:
    """``format_table``'s keywords for a rule: ``k`` and a ``label`` naming the class, K and
    stage 1's formula (none for Adam on 16-bit params: the reference chapter's title)."""
    k = _k(rule, param_dtype, momentum, offload)
    options: dict[str, object] = {"k": k}
    if param_dtype != "float16":
        options["param_dtype"] = param_dtype
    if offload:
        options["offload"] = offload
    if rule != "adam" or k != 12:
        options["label"] = (
            f"{describe(rule, momentum)}, K = {k} (stage 1: "
            f"{_stage1_label(k, param_dtype, offload)})"
        )
    return options


def formulas(
    rule: str = "adam",
    param_dtype: str = "float16",
    momentum: float = DEFAULT_MOMENTUM,
    offload: bool | float = False,
    shard_group: int | None = None,
    params=None,
) -> str:
    """The table's formulas in words, one line per stage (``params``: Ψ, named if given)."""
    states = rule_states(rule, momentum != 0)
    k = _k(rule, param_dtype, momentum, offload)
    fp32 = param_dtype in FP32_DTYPES
    p = g = 4 if fp32 else 2
    master = (
        "2-byte remainder master"
        if masters_of(param_dtype, offload) == "remainder"
        else ("fp32 master")
    )
    held = ", ".join(([] if fp32 else [master]) + list(states)) or "nothing"
    n = "N" if shard_group is None else "G"
    over = (
        "N ranks"
        if shard_group is None
        else f"G = {shard_group} ranks (replicated across the N/G groups)"
    )
    where = (
        ""
        if not offload
        else ", on the host"
        if float(offload) == 1
        else f", {float(offload):.0%} of it on the host"
    )
    own = (
        ""
        if not fp32
        else "; offloaded, a 4-byte fp32 master joins them on the host"
        if offload
        else " (float32 params are their own master)"
    )
    psi = "" if params is None else f" = {format_param_count(params)}"
    rows = [
        (
            "Baseline",
            f"{p}Ψ+{g}Ψ+{_num(k)}Ψ = {_num(p + g + k)}Ψ",
            "plain data parallelism: all of it on every rank",
        ),
        (
            "Stage 1",
            _stage1_label(k, param_dtype, offload, n),
            f"zero1_mpi: {param_dtype} params, grads on every rank; K sharded over " + over + where,
        ),
        (
            "Stage 2",
            f"{p}Ψ+{_num(g + k)}Ψ/{n}",
            "zero1_mpi with shard_gradients=True: the grads sharded too",
        ),
        (
            "Stage 3",
            f"{_num(p + g + k)}Ψ/{n}",
            "zero1_mpi with shard_params=True: params too, + the units gathered",
        ),
    ]
    width = max(len(formula) for _, formula, _ in rows) + 3
    head = (
        f"Per rank, Ψ{psi} parameters, N ranks; K = {_num(k)} bytes per parameter "
        f"sharded: {held}{own}"
    )
    return "\n".join(
        [head] + [f"  {name:<10}{formula:<{width}}{words}" for name, formula, words in rows]
    )


def param_count_arg(text: str) -> int:
    try:
        return parse_param_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rank_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rank count >= 1; write e.g. 64, 8 64 or 8,64"
        )
    return counts


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a group size >= 1, e.g. 8")
    return value


def momentum_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a momentum >= 0, e.g. 0.9 or 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:  # (nan fails the comparison too)
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a share from 0 to 1, e.g. 0.5 (0: nothing on the host)"
        )
    return value


def _prog() -> str:
    name = os.path.basename(sys.argv[0] or "")
    return "python -m zero1_mpi.memory" if name in ("", "__main__.py", "-c") else name


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), print the table and the formulas, return 0
    (argparse exits with status 2 on bad input)."""
    names = tuple(builtin_rules())
    parser = argparse.ArgumentParser(
        prog=_prog(),
        usage="%(prog)s [-h] [--params PSI] [--ranks N [N ...]] [--rule RULE] [options]",
        description="Per-rank memory of ZeRO data parallelism (GB = 1e9 bytes): baseline, "
        "stages 1, 2 (shard_gradients=True) and 3 (shard_params=True).",
    )
    parser.add_argument(
        "--params",
        type=param_count_arg,
        default=DEFAULT_PARAMS,
        metavar="PSI",
        help="parameter count Ψ: 7B, 1.5B, 350M, 125000000, 1.3e9 (default 7B)",
    )
    parser.add_argument(
        "--ranks",
        type=_rank_counts,
        nargs="+",
        default=None,
        metavar="N",
        help="rank counts, a table row each: 64, or 8 64, or 8,64 (default "
        f"{' '.join(map(str, DEFAULT_RANKS))})",
    )
    parser.add_argument(
        "--rule",
        choices=names,
        default="adam",
        help="update rule: its bytes per parameter K of the sharded part "
        "(default adam: K = 12 on 16-bit params)",
    )
    parser.add_argument(
        "--momentum",
        type=momentum_arg,
        default=None,
        help=f"SGD's momentum (default {DEFAULT_MOMENTUM:g}; 0: no momentum "
        f"buffer); only with --rule sgd",
    )
    parser.add_argument(
        "--param-dtype",
        choices=MIXED_DTYPES + FP32_DTYPES,
        default="float16",
        help="parameter (and gradient) dtype (default float16; bfloat16 keeps its masters as "
        "2-byte remainders, as the engine does by default unless offloaded; float32 params "
        "are their own master)",
    )
    parser.add_argument(
        "--offload",
        choices=("cpu",),
        default=None,
        help="stage 1's master weights and state on the host: adds its device and host columns",
    )
    parser.add_argument(
        "--offload-fraction",
        type=_fraction,
        default=None,
        metavar="F",
        help="with --offload cpu: the share of them on the host, 0 to 1 (default 1; 0: the "
        "table without offload)",
    )
    parser.add_argument(
        "--shard-group-size",
        type=_positive,
        default=None,
        metavar="G",
        help="hierarchical sharding: the state sharded over groups of G ranks, "
        "replicated across groups (each N must be a multiple of G)",
    )
    parser.add_argument(
        "--modes",
        action="store_true",
        help="one column per way of keeping the sharded state of bf16 parameters (fp32; "
        "remainder masters; and bf16 or 8-bit state), stage 1 (and 2 with --stage 2)",
    )
    parser.add_argument(
        "--stage", type=int, choices=(1, 2), default=1, help="the stage of --modes (default 1)"
    )
    args = parser.parse_args(argv)

    if args.momentum is not None and args.rule != "sgd":
        parser.error(f"--momentum is SGD's: pass --rule sgd (not {args.rule})")
    momentum = DEFAULT_MOMENTUM if args.momentum is None else args.momentum
    ranks = list(DEFAULT_RANKS) if args.ranks is None else [n for ns in args.ranks for n in ns]
    group = args.shard_group_size
    if group is not None:
        if args.ranks is None:
            ranks = [n for n in ranks if n % group == 0] or [group]
        bad = [n for n in ranks if n % group]
        if bad:
            parser.error(
                f"--shard-group-size {group} does not divide --ranks "
                f"{' '.join(map(str, bad))}: pass multiples of {group}"
            )
    if args.offload_fraction is not None and args.offload is None:
        parser.error("--offload-fraction is the share --offload cpu moves: pass that too")
    offload: bool | float = args.offload == "cpu"
    if offload and args.offload_fraction is not None and args.offload_fraction < 1:
        offload = args.offload_fraction
    if args.modes:
        if offload or group is not None or args.param_dtype == "float32":
            parser.error("--modes takes bf16 parameters, no --offload, no --shard-group-size")
        states = rule_states(args.rule, momentum != 0)
        print(format_modes_table(args.params, ranks, states, args.stage))
        return 0
    print(
        format_table(
            args.params,
            ranks,
            shard_group=group,
            **table_options(args.rule, args.param_dtype, momentum, offload),
        )
    )
    print()
    print(formulas(args.rule, args.param_dtype, momentum, offload, group, args.params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
