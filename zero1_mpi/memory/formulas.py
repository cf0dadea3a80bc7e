"""The ZeRO formulas: bytes per rank of each stage, their tables, and parameter counts.

Formulas give bytes per rank (floats: the reference chapter divides) for Ψ parameters and N
ranks, Adam with 16-bit params/grads and fp32 master, m, v by default; ``k`` is the bytes per
parameter of the sharded part for other update rules (``rules.registry.rule_bytes_per_param``
gives each built-in rule's). ``format_table``/``format_modes_table`` tabulate them; counts are
read and written as ``7B``, ``350M``. Stdlib only: no numpy, no MPI, no rules.
"""

from __future__ import annotations

import math
import numbers
import operator
from decimal import Decimal, InvalidOperation

__all__ = [
    "STAGES",
    "STAGE1_FP32",
    "MIXED_DTYPES",
    "FP32_DTYPES",
    "MASTER_BYTES",
    "STATE_BYTES",
    "bytes_per_param",
    "stage_terms",
    "replicated_terms",
    "per_rank_bytes",
    "stage_bytes",
    "baseline_bytes",
    "stage1_bytes",
    "stage2_bytes",
    "stage3_bytes",
    "stage1_fp32_bytes",
    "format_param_count",
    "parse_param_count",
    "format_table",
    "format_modes_table",
    "MODES",
]

#: Bytes per parameter of each stage: (fully replicated terms, terms divided among N ranks),
#: in the seed's order: 16-bit params, 16-bit grads, fp32 master, fp32 m, fp32 v.
STAGES = {
    "Baseline": ((2, 2, 4, 4, 4), ()),
    "Stage 1": ((2, 2), (4, 4, 4)),
    "Stage 2": ((2,), (2, 4, 4, 4)),
    "Stage 3": ((), (2, 2, 4, 4, 4)),
}
#: Stage 1 with fp32 params: the param shard is its own master copy (fp32 params, grads; m, v).
STAGE1_FP32 = ((4, 4), (4, 4))

#: Parameter dtypes with an fp32 master copy in the shard (the seed's 16-bit case) and without.
MIXED_DTYPES, FP32_DTYPES = ("float16", "bfloat16"), ("float32",)
#: Bytes per parameter of the master weights kept apart from 16-bit params, by ``masters``:
#: fp32, or (bf16 params) the 16 bits the parameter lacks (ties apart: ``zero1_mpi.state.masters``).
MASTER_BYTES = {"fp32": 4, "remainder": 2}
#: Bytes per element of each of the rule's state arrays, by ``state_dtype`` (int8: a code and
#: an fp32 scale per 256; tensors under 4096 elements keep fp32, beside the formula).
STATE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}

_UNITS = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))


def _check(psi, n):
    if (
        isinstance(psi, bool)
        or not isinstance(psi, numbers.Real)
        or not math.isfinite(psi)
        or psi < 0
    ):
        raise ValueError(f"psi={psi!r} must be a finite number of parameters >= 0, e.g. 7e9")
    if isinstance(n, bool):
        raise ValueError(f"n={n!r} must be an integer number of ranks >= 1, e.g. 8")
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(
            f"n={n!r} must be an integer number of ranks >= 1, e.g. 8; pass int(n)"
        ) from None
    if n < 1:
        raise ValueError(f"n={n!r} must be an integer number of ranks >= 1, e.g. 8")
    return float(psi), n


def _check_k(k):
    if isinstance(k, bool) or not isinstance(k, numbers.Real) or not math.isfinite(k) or k < 0:
        raise ValueError(
            f"k={k!r} must be a finite number of bytes per parameter >= 0, e.g. 12 for Adam"
        )
    return k


def bytes_per_param(
    state_names, param_dtype: str = "float16", masters: str = "fp32", state_dtype: str = "float32"
) -> int | float:
    """K, the bytes per parameter of the sharded part: ``STATE_BYTES[state_dtype]`` (4 for
    fp32) per state array in ``state_names``, plus the master's for 16-bit params
    (``MASTER_BYTES[masters]``: fp32's 4, a remainder's 2; fp32 params are their own)."""
    if masters not in MASTER_BYTES:
        raise ValueError(f"masters={masters!r} is not known: use one of {', '.join(MASTER_BYTES)}")
    if state_dtype not in STATE_BYTES:
        raise ValueError(
            f"state_dtype={state_dtype!r} is not known: use one of {', '.join(STATE_BYTES)}"
        )
    if param_dtype in MIXED_DTYPES:
        master = MASTER_BYTES[masters]
    elif param_dtype in FP32_DTYPES:
        master = 0
    else:
        raise ValueError(
            f"no stage-1 formula for param_dtype={param_dtype!r}; known: "
            f"{', '.join(MIXED_DTYPES + FP32_DTYPES)}"
        )
    return master + STATE_BYTES[state_dtype] * len(tuple(state_names))


def replicated_terms(param_dtype: str) -> tuple[int, int]:
    """The bytes per parameter of the params and of the grads for ``param_dtype``."""
    if param_dtype in MIXED_DTYPES:
        return 2, 2
    if param_dtype in FP32_DTYPES:
        return 4, 4
    raise ValueError(
        f"no ZeRO formula for param_dtype={param_dtype!r}; known: "
        f"{', '.join(MIXED_DTYPES + FP32_DTYPES)}"
    )


def stage_terms(k=12, param_dtype: str = "float16", grad_dtype: str | None = None) -> dict:
    """``STAGES`` for a rule whose sharded part is ``k`` bytes per parameter, with params and
    grads of ``param_dtype`` (4 bytes each for float32, whose ``k`` has no master: Adam's 8);
    ``grad_dtype``: the gradients' own dtype where it differs (an fp32 gradient shard)."""
    k = _check_k(k)
    param, grad = replicated_terms(param_dtype)
    if grad_dtype is not None:
        grad = replicated_terms(grad_dtype)[1]
    if k == 12 and param == 2 and grad == 2:
        return STAGES
    sharded = (4,) * int(k // 4) if k % 4 == 0 else (k,)
    return {
        "Baseline": ((param, grad) + sharded, ()),
        "Stage 1": ((param, grad), sharded),
        "Stage 2": ((param,), (grad,) + sharded),
        "Stage 3": ((), (param, grad) + sharded),
    }


def per_rank_bytes(terms, psi, n, unit=1):
    """The seed's arithmetic: replicated/unit + partitioned/n/unit, summed term by term."""
    psi, n = _check(psi, n)
    replicated, partitioned = terms
    rep = sum(psi * k for k in replicated)
    part = sum(psi * k for k in partitioned)
    return rep / unit + part / n / unit


def baseline_bytes(psi, k=12) -> float:
    """Plain data parallelism: (4 + k)Ψ on every rank (16Ψ for Adam)."""
    return per_rank_bytes(stage_terms(k)["Baseline"], psi, 1)


def stage1_bytes(psi, n, k=12) -> float:
    """ZeRO stage 1, 16-bit params: 2Ψ + 2Ψ + kΨ/N (Adam: k = 12)."""
    return per_rank_bytes(stage_terms(k)["Stage 1"], psi, n)


def stage_bytes(
    psi, n, stage: int, k=12, param_dtype: str = "float16", grad_dtype: str | None = None
) -> float:
    """Per-rank bytes of ZeRO ``stage`` (0: the baseline, 1, 2 or 3), as ``stage_terms`` gives
    them: what ``MemoryReport.formula_bytes`` holds stage 2 to, and the table's columns."""
    names = ("Baseline", "Stage 1", "Stage 2", "Stage 3")
    if stage not in range(4):
        raise ValueError(f"stage={stage!r} must be 0 (the baseline), 1, 2 or 3")
    terms = stage_terms(k, param_dtype, grad_dtype)[names[stage]]
    return per_rank_bytes(terms, psi, 1 if stage == 0 else n)


def stage2_bytes(psi, n, k=12) -> float:
    """ZeRO stage 2: 2Ψ + (2 + k)Ψ/N (Adam: 14Ψ/N)."""
    return per_rank_bytes(stage_terms(k)["Stage 2"], psi, n)


def stage3_bytes(psi, n, k=12) -> float:
    """ZeRO stage 3: (4 + k)Ψ/N (Adam: 16Ψ/N)."""
    return per_rank_bytes(stage_terms(k)["Stage 3"], psi, n)


def stage1_fp32_bytes(psi, n, k=8) -> float:
    """ZeRO stage 1, fp32 params (the param shard is its own master): 4Ψ + 4Ψ + kΨ/N
    (Adam: k = 8, its m and v)."""
    k = _check_k(k)
    return per_rank_bytes(STAGE1_FP32 if k == 8 else ((4, 4), (k,)), psi, n)


def format_param_count(psi) -> str:
    """``7e9`` -> ``7B``, ``1.3e9`` -> ``1.3B``, ``125e6`` -> ``125M``, ``512`` -> ``512``."""
    psi, _ = _check(psi, 1)
    for suffix, scale in _UNITS:
        if psi >= scale:
            return f"{psi / scale:.4g}{suffix}"
    return f"{psi:.4g}"


def parse_param_count(text: str) -> int:
    """``'7B'``, ``'125M'``, ``'10k'``, ``'1.3e9'``, ``'10000'`` -> a whole number of parameters."""
    raw = str(text).strip()
    scale = 1
    for suffix, unit in _UNITS:
        if raw.upper().endswith(suffix):
            raw, scale = raw[:-1], unit
            break
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        raise ValueError(
            f"parameter count {text!r} is not a number; write e.g. 7B, 125M, 10k, 1.3e9 or 10000"
        ) from None
    if not value.is_finite() or value < 0 or value != value.to_integral_value():
        raise ValueError(
            f"parameter count {text!r} must be a whole number >= 0, e.g. 7B, 1.3e9 or 10000"
        )
    return int(value)


def format_table(
    params,
    gpu_counts,
    k=12,
    label: str | None = None,
    shard_group: int | None = None,
    param_dtype: str = "float16",
    offload: bool | float = False,
) -> str:
    """The seed's per-GPU memory table (GB = 1e9 bytes) for ``params`` and each GPU count;
    ``k``: bytes per parameter of the optimizer's sharded part (``label`` names it in the
    title; Adam's 12 and no label give the seed's table). ``shard_group``: hierarchical
    sharding, the sharded terms divided among groups of that many GPUs (replicated across the
    groups) instead of all N; rows whose N it does not divide are left out. ``param_dtype``:
    float32 params and grads take 4 bytes each (``k`` then has no master: Adam's 8).
    ``offload``: stage 1 keeps its sharded part on the host (fp32 params then have a master
    there: k + 4), or a number, that share of it (``offload_fraction``); two more columns
    split stage 1 into device and host bytes."""
    counts = list(gpu_counts)
    for n in counts:
        _check(params, n)
    if shard_group is not None:
        _check(params, shard_group)
        counts = [n for n in counts if n % shard_group == 0]
    terms = dict(stage_terms(k, param_dtype))
    share = float(offload)
    replicated, sharded = terms["Stage 1"]
    k_host = sum(sharded) + (4 if param_dtype in FP32_DTYPES else 0)  # + fp32 params' master
    if offload and param_dtype in FP32_DTYPES:  # the host's fp32 master of fp32 params
        terms["Stage 1"] = (replicated, sharded + (4 * share,))
    title = f"Per-GPU memory (GB) for a {format_param_count(params)} parameter model"
    extra = [label] if label else []
    if param_dtype != "float16":
        extra.append(f"{param_dtype} parameters")
    if offload:
        extra.append(
            "stage 1 state offloaded to the host" + ("" if share == 1 else f" ({share:.0%} of it)")
        )
    if shard_group is not None:
        extra.append(f"sharded within groups of {shard_group} GPUs")
    head = f"{'GPUs':>6}{'Baseline':>12}{'Stage 1':>11}{'Stage 2':>11}{'Stage 3':>11}"
    lines = [
        title + "".join(f", {e}" for e in extra),
        head + (f"{'S1 device':>11}{'S1 host':>11}" if offload else ""),
        "-" * (74 if offload else 52),
    ]
    for n in counts:
        ways = n if shard_group is None else shard_group
        gb = [
            per_rank_bytes(terms[name], params, 1 if name == "Baseline" else ways, unit=1e9)
            for name in terms
        ]
        if offload:
            gb += [
                per_rank_bytes((replicated, ((1 - share) * sum(sharded),)), params, ways, unit=1e9),
                per_rank_bytes(((), (share * k_host,)), params, ways, unit=1e9),
            ]
        lines.append(f"{n:>6}{gb[0]:>11.1f}G" + "".join(f"{x:>10.1f}G" for x in gb[1:]))
    return "\n".join(lines)


#: The ways of keeping the sharded state of 16-bit (bf16) parameters, by column label:
#: ``(masters, state_dtype)``, the engine options that choose them.
MODES = {
    "fp32": ("fp32", "float32"),
    "remainder": ("remainder", "float32"),
    "+bf16 state": ("remainder", "bfloat16"),
    "+int8 state": ("remainder", "int8"),
}


def format_modes_table(params, gpu_counts, state_names=("exp_avg", "exp_avg_sq"), stage=1) -> str:
    """Per-GPU memory (GB = 1e9 bytes) of ZeRO ``stage`` 1 or 2 with 16-bit parameters for
    ``params`` and each GPU count, a column per way of keeping the sharded state (``MODES``;
    the first is the seed's); ``state_names``: the rule's state arrays (Adam's by default)."""
    ks = {label: bytes_per_param(state_names, "bfloat16", *mode) for label, mode in MODES.items()}
    title = (
        f"Per-GPU memory (GB) of ZeRO stage {stage} for a {format_param_count(params)} "
        "parameter model, bf16 parameters, by how the sharded state is kept (K)"
    )
    head = f"{'GPUs':>6}" + "".join(f"{f'{label} ({k:.3g})':>20}" for label, k in ks.items())
    lines = [title, head, "-" * len(head)]
    for n in gpu_counts:
        _check(params, n)
        gb = [stage_bytes(params, n, stage, k, "bfloat16") / 1e9 for k in ks.values()]
        lines.append(f"{n:>6}" + "".join(f"{x:>19.1f}G" for x in gb))
    return "\n".join(lines)
