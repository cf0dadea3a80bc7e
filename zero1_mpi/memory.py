"""Per-rank memory of ZeRO data parallelism: the seed's formulas and what one rank measures.

Formulas give bytes per rank (floats: the seed divides) for Ψ parameters and N ranks, Adam with
16-bit params/grads and fp32 master, m, v. ``MemoryReport`` is what one optimizer rank really
holds, in bytes, split so that every byte is counted once. Stdlib only: no numpy, no MPI.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation

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

_UNITS = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))


def _check(psi, n):
    if (isinstance(psi, bool) or not isinstance(psi, numbers.Real)
            or not math.isfinite(psi) or psi < 0):
        raise ValueError(f"psi={psi!r} must be a finite number of parameters >= 0, e.g. 7e9")
    if isinstance(n, bool):
        raise ValueError(f"n={n!r} must be an integer number of ranks >= 1, e.g. 8")
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(f"n={n!r} must be an integer number of ranks >= 1, e.g. 8; "
                         f"pass int(n)") from None
    if n < 1:
        raise ValueError(f"n={n!r} must be an integer number of ranks >= 1, e.g. 8")
    return float(psi), n


def _per_rank(terms, psi, n, unit=1):
    """The seed's arithmetic: replicated/unit + partitioned/n/unit, summed term by term."""
    psi, n = _check(psi, n)
    replicated, partitioned = terms
    rep = sum(psi * k for k in replicated)
    part = sum(psi * k for k in partitioned)
    return rep / unit + part / n / unit


def baseline_bytes(psi) -> float:
    """Plain data parallelism: 16Ψ on every rank."""
    return _per_rank(STAGES["Baseline"], psi, 1)


def stage1_bytes(psi, n) -> float:
    """ZeRO stage 1, 16-bit params: 2Ψ + 2Ψ + 12Ψ/N."""
    return _per_rank(STAGES["Stage 1"], psi, n)


def stage2_bytes(psi, n) -> float:
    """ZeRO stage 2: 2Ψ + 14Ψ/N."""
    return _per_rank(STAGES["Stage 2"], psi, n)


def stage3_bytes(psi, n) -> float:
    """ZeRO stage 3: 16Ψ/N."""
    return _per_rank(STAGES["Stage 3"], psi, n)


def stage1_fp32_bytes(psi, n) -> float:
    """ZeRO stage 1, fp32 params (the param shard is its own master): 4Ψ + 4Ψ + 8Ψ/N."""
    return _per_rank(STAGE1_FP32, psi, n)


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
    for suffix, value in _UNITS:
        if raw.upper().endswith(suffix):
            raw, scale = raw[:-1], value
            break
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        raise ValueError(f"parameter count {text!r} is not a number; write e.g. 7B, 125M, "
                         f"10k, 1.3e9 or 10000") from None
    if not value.is_finite() or value < 0 or value != value.to_integral_value():
        raise ValueError(f"parameter count {text!r} must be a whole number >= 0, "
                         f"e.g. 7B, 1.3e9 or 10000")
    return int(value)


def format_table(params, gpu_counts) -> str:
    """The seed's per-GPU memory table (GB = 1e9 bytes) for ``params`` and each GPU count."""
    counts = list(gpu_counts)
    for n in counts:
        _check(params, n)
    lines = [
        f"Per-GPU memory (GB) for a {format_param_count(params)} parameter model",
        f"{'GPUs':>6}{'Baseline':>12}{'Stage 1':>11}{'Stage 2':>11}{'Stage 3':>11}",
        "-" * 52,
    ]
    for n in counts:
        gb = [_per_rank(STAGES[name], params, 1 if name == "Baseline" else n, unit=1e9)
              for name in STAGES]
        lines.append(f"{n:>6}{gb[0]:>11.1f}G{gb[1]:>10.1f}G{gb[2]:>10.1f}G{gb[3]:>10.1f}G")
    return "\n".join(lines)


_BYTE_FIELDS = ("parameters", "gradients", "master_weights", "exp_avg", "exp_avg_sq",
                "padding", "comm_scratch")
_FORMULAS = {"float16": stage1_bytes, "bfloat16": stage1_bytes, "float32": stage1_fp32_bytes}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one optimizer rank holds; each byte in exactly one category.

    ``parameters``/``gradients``: the Ψ real elements of the replicated flat buffers.
    ``master_weights``/``exp_avg``/``exp_avg_sq``: the real elements of this rank's shard
    (``master_weights`` is 0 for float32 params). ``padding``: every padding element of all
    those buffers. ``comm_scratch``: everything else held for a step (staging, reduce buffers).
    So ``total`` is the nbytes of everything held, and summed over ranks
    ``total - formula_bytes`` equals ``padding + comm_scratch`` exactly.
    """

    parameters: int
    gradients: int
    master_weights: int
    exp_avg: int
    exp_avg_sq: int
    padding: int
    comm_scratch: int
    psi: int
    world_size: int
    rank: int
    param_dtype: str

    def __post_init__(self):
        for name in _BYTE_FIELDS + ("psi", "world_size", "rank"):
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise ValueError(f"MemoryReport.{name}={value!r} must be an integer; "
                                 f"pass int(...)") from None
            if value < 0:
                raise ValueError(f"MemoryReport.{name}={value!r} must be >= 0")
            object.__setattr__(self, name, value)
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ValueError(f"MemoryReport rank={self.rank} world_size={self.world_size}: "
                             f"need world_size >= 1 and 0 <= rank < world_size")
        if not isinstance(self.param_dtype, str):
            raise ValueError(f"MemoryReport.param_dtype={self.param_dtype!r} must be a dtype "
                             f"name such as 'float16'; pass numpy.dtype(d).name")

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in _BYTE_FIELDS)

    @property
    def optimizer_state(self) -> int:
        return self.master_weights + self.exp_avg + self.exp_avg_sq

    @property
    def formula_bytes(self) -> float:
        """The stage-1 formula for this dtype: 2Ψ+2Ψ+12Ψ/N (16-bit) or 4Ψ+4Ψ+8Ψ/N (fp32)."""
        try:
            formula = _FORMULAS[self.param_dtype]
        except KeyError:
            raise ValueError(f"no stage-1 formula for param_dtype={self.param_dtype!r}; "
                             f"known: {', '.join(_FORMULAS)}") from None
        return formula(self.psi, self.world_size)

    @property
    def seed_formula_bytes(self) -> float:
        """The seed's 2Ψ + 2Ψ + 12Ψ/N, whatever the dtype."""
        return stage1_bytes(self.psi, self.world_size)

    def as_dict(self) -> dict:
        """The fields only (JSON-ready); ``MemoryReport(**d)`` rebuilds the report."""
        return asdict(self)

    def __str__(self) -> str:
        mib = 2.0**20
        lines = [f"rank {self.rank}/{self.world_size}: {self.psi} {self.param_dtype} parameters",
                 f"  {'category':<16}{'bytes':>14}{'MiB':>11}"]
        for name in _BYTE_FIELDS + ("total",):
            value = getattr(self, name)
            lines.append(f"  {name:<16}{value:>14}{value / mib:>11.2f}")
        if self.param_dtype in _FORMULAS:
            formula = self.formula_bytes
            label = "4Ψ+4Ψ+8Ψ/N" if self.param_dtype == "float32" else "2Ψ+2Ψ+12Ψ/N"
            lines.append(f"  {'formula':<16}{formula:>14.0f}{formula / mib:>11.2f}  ({label})")
            diff = self.total - formula
            lines.append(f"  {'difference':<16}{diff:>14.0f}{diff / mib:>11.2f}"
                         f"  (total - formula: padding + scratch)")
        return "\n".join(lines)
