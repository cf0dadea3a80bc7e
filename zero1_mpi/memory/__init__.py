"""Per-rank memory of ZeRO data parallelism: the ZeRO formulas and what one rank measures.

Formulas give bytes per rank (floats: the reference chapter divides) for Ψ parameters and N
ranks, Adam with 16-bit params/grads and fp32 master, m, v by default; ``k`` is the bytes per
parameter of the sharded part for other update rules (``rules.registry.rule_bytes_per_param``
gives each built-in rule's). ``MemoryReport`` is what one optimizer rank really holds, in
bytes, split so that every byte is counted once. Stdlib only: no numpy, no MPI, no rules.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation

__all__ = [
    "MemoryReport",
    "STAGES",
    "STAGE1_FP32",
    "MIXED_DTYPES",
    "FP32_DTYPES",
    "MASTER_BYTES",
    "STATE_BYTES",
    "bytes_per_param",
    "stage_terms",
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
#: fp32, or (bf16 params) the 16 bits the parameter lacks (ties apart: ``zero1_mpi.masters``).
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


def _replicated(param_dtype: str) -> tuple[int, int]:
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
    param, grad = _replicated(param_dtype)
    if grad_dtype is not None:
        grad = _replicated(grad_dtype)[1]
    if k == 12 and param == 2 and grad == 2:
        return STAGES
    sharded = (4,) * int(k // 4) if k % 4 == 0 else (k,)
    return {
        "Baseline": ((param, grad) + sharded, ()),
        "Stage 1": ((param, grad), sharded),
        "Stage 2": ((param,), (grad,) + sharded),
        "Stage 3": ((), (param, grad) + sharded),
    }


def _per_rank(terms, psi, n, unit=1):
    """The seed's arithmetic: replicated/unit + partitioned/n/unit, summed term by term."""
    psi, n = _check(psi, n)
    replicated, partitioned = terms
    rep = sum(psi * k for k in replicated)
    part = sum(psi * k for k in partitioned)
    return rep / unit + part / n / unit


def baseline_bytes(psi, k=12) -> float:
    """Plain data parallelism: (4 + k)Ψ on every rank (16Ψ for Adam)."""
    return _per_rank(stage_terms(k)["Baseline"], psi, 1)


def stage1_bytes(psi, n, k=12) -> float:
    """ZeRO stage 1, 16-bit params: 2Ψ + 2Ψ + kΨ/N (Adam: k = 12)."""
    return _per_rank(stage_terms(k)["Stage 1"], psi, n)


def stage_bytes(
    psi, n, stage: int, k=12, param_dtype: str = "float16", grad_dtype: str | None = None
) -> float:
    """Per-rank bytes of ZeRO ``stage`` (0: the baseline, 1, 2 or 3), as ``stage_terms`` gives
    them: what ``MemoryReport.formula_bytes`` holds stage 2 to, and the table's columns."""
    names = ("Baseline", "Stage 1", "Stage 2", "Stage 3")
    if stage not in range(4):
        raise ValueError(f"stage={stage!r} must be 0 (the baseline), 1, 2 or 3")
    terms = stage_terms(k, param_dtype, grad_dtype)[names[stage]]
    return _per_rank(terms, psi, 1 if stage == 0 else n)


def stage2_bytes(psi, n, k=12) -> float:
    """ZeRO stage 2: 2Ψ + (2 + k)Ψ/N (Adam: 14Ψ/N)."""
    return _per_rank(stage_terms(k)["Stage 2"], psi, n)


def stage3_bytes(psi, n, k=12) -> float:
    """ZeRO stage 3: (4 + k)Ψ/N (Adam: 16Ψ/N)."""
    return _per_rank(stage_terms(k)["Stage 3"], psi, n)


def stage1_fp32_bytes(psi, n, k=8) -> float:
    """ZeRO stage 1, fp32 params (the param shard is its own master): 4Ψ + 4Ψ + kΨ/N
    (Adam: k = 8, its m and v)."""
    k = _check_k(k)
    return _per_rank(STAGE1_FP32 if k == 8 else ((4, 4), (k,)), psi, n)


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
            _per_rank(terms[name], params, 1 if name == "Baseline" else ways, unit=1e9)
            for name in terms
        ]
        if offload:
            gb += [
                _per_rank((replicated, ((1 - share) * sum(sharded),)), params, ways, unit=1e9),
                _per_rank(((), (share * k_host,)), params, ways, unit=1e9),
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


_BYTE_FIELDS = (
    "parameters",
    "gradients",
    "master_weights",
    "padding",
    "comm_scratch",
    "host_padding",
    "host_scratch",
    "checkpoint_buffer",
    "error_feedback",
)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one optimizer rank holds; each byte in exactly one category.

    ``parameters``/``gradients``: the Ψ real elements of the replicated flat buffers.
    ``master_weights`` and ``state`` (by state array name, in the rule's order: Adam's
    ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer`` or nothing; Lion's ``exp_avg``): the
    real elements of this rank's shard (``master_weights`` is 0 for float32 params;
    ``masters``: how they are kept, ``"fp32"`` or ``"remainder"``: 2 bytes each, plus 8 per
    tie, ``zero1_mpi.masters``; ``state_dtype``: how each state array is kept, 4 bytes an
    element for ``"float32"``, 2 for ``"bfloat16"``, 1 + 4/256 for ``"int8"``: K may be
    fractional).
    ``padding``: every padding element of all those buffers. ``comm_scratch``: everything else
    held for a step (staging, reduce buffers). So ``total`` is the nbytes of everything held,
    and summed over ranks ``total - formula_bytes`` equals ``padding + comm_scratch`` exactly.
    ``group_size``: the ranks the state is sharded over (K; all N ranks without hierarchical
    sharding), and ``rank`` this rank's place among them. ``rule``: the update rule's name,
    for display. ``offloaded``: the master weights and state are on the host (``offload``;
    then fp32 params have a master too), with their padding in ``host_padding``;
    ``offload_fraction``: the share of this rank's real elements whose master and state are
    on the host (``offload_fraction``, at a tensor piece's boundary; 1: all), ``host_state``
    their bytes (None: all of ``optimizer_state`` if offloaded, else 0; needed where the share
    is below 1 and there is state);
    ``host_scratch``: host buffers for device parameters (MPI staging, offload's copies);
    ``device_bytes`` and ``host_bytes`` split ``total``. ``grad_shard_dtype``: with gradient
    sharding (stage 2), the dtype of the gradient shard that ``gradients`` then counts (the
    real elements this rank owns); None: the full gradient buffer (stage 1).
    ``checkpoint_buffer``: the host copy of this rank's shard that non-blocking saves
    (``save(..., blocking=False)``) write from, once one has run (0 before).
    ``error_feedback``: the residuals of ``reduce_dtype="int8"`` with ``error_feedback=True``
    (what quantizing dropped, carried to the next step), where the gradients live.
    """

    parameters: int
    gradients: int
    master_weights: int
    state: Mapping
    padding: int
    comm_scratch: int
    psi: int
    group_size: int
    rank: int
    param_dtype: str
    rule: str | None = None
    offloaded: bool = False
    host_padding: int = 0
    host_scratch: int = 0
    grad_shard_dtype: str | None = None
    checkpoint_buffer: int = 0
    error_feedback: int = 0
    masters: str = "fp32"
    state_dtype: str = "float32"
    offload_fraction: float = 1.0
    host_state: int | None = None

    def __post_init__(self):
        for name in _BYTE_FIELDS + ("psi", "group_size", "rank"):
            object.__setattr__(self, name, _count(f"MemoryReport.{name}", getattr(self, name)))
        if not isinstance(self.state, Mapping):
            raise ValueError(
                f"MemoryReport.state={self.state!r} must map each state array's "
                f"name to its bytes, e.g. {{'exp_avg': 4096}}"
            )
        state = {}
        for name, value in self.state.items():
            if not isinstance(name, str) or not name or name in _BYTE_FIELDS:
                raise ValueError(
                    f"MemoryReport.state has a bad name {name!r}: a rule's state "
                    f"array name such as 'exp_avg'"
                )
            state[name] = _count(f"MemoryReport.state[{name!r}]", value)
        object.__setattr__(self, "state", state)
        if self.group_size < 1 or self.rank >= self.group_size:
            raise ValueError(
                f"MemoryReport rank={self.rank} group_size={self.group_size}: "
                f"need group_size >= 1 and 0 <= rank < group_size"
            )
        if not isinstance(self.param_dtype, str):
            raise ValueError(
                f"MemoryReport.param_dtype={self.param_dtype!r} must be a dtype "
                f"name such as 'float16'; pass numpy.dtype(d).name"
            )
        if not isinstance(self.offloaded, bool):
            raise ValueError(f"MemoryReport.offloaded={self.offloaded!r} must be True or False")
        fraction = self.offload_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not 0 <= fraction <= 1
        ):
            raise ValueError(
                f"MemoryReport.offload_fraction={fraction!r} must be a number from 0 to 1"
            )
        if self.host_state is None:
            if self.offloaded and fraction < 1 and self.optimizer_state:
                raise ValueError(
                    f"MemoryReport.offload_fraction={fraction!r} needs host_state: the bytes "
                    "of optimizer_state on the host (the split falls at a tensor piece, so "
                    "the share alone does not give it)"
                )
            object.__setattr__(self, "host_state", self.optimizer_state if self.offloaded else 0)
        host_state = _count("MemoryReport.host_state", self.host_state)
        if host_state > self.optimizer_state or (host_state and not self.offloaded):
            raise ValueError(
                f"MemoryReport.host_state={host_state} must be at most optimizer_state="
                f"{self.optimizer_state}, and 0 unless offloaded"
            )
        object.__setattr__(self, "host_state", host_state)
        if (
            self.grad_shard_dtype is not None
            and self.grad_shard_dtype not in MIXED_DTYPES + FP32_DTYPES
        ):
            raise ValueError(
                f"MemoryReport.grad_shard_dtype={self.grad_shard_dtype!r} must be "
                f"None (stage 1) or one of {', '.join(MIXED_DTYPES + FP32_DTYPES)}"
            )
        if self.state_dtype not in STATE_BYTES:
            raise ValueError(
                f"MemoryReport.state_dtype={self.state_dtype!r} must be one of "
                f"{', '.join(STATE_BYTES)}"
            )
        if self.masters not in MASTER_BYTES:
            raise ValueError(
                f"MemoryReport.masters={self.masters!r} must be one of {', '.join(MASTER_BYTES)}"
            )
        if self.rule is not None and not isinstance(self.rule, str):
            raise ValueError(
                f"MemoryReport.rule={self.rule!r} must be a rule name such as 'adam', or None"
            )

    def __hash__(self):
        return hash(
            (
                *(getattr(self, name) for name in _BYTE_FIELDS),
                frozenset(self.state.items()),
                self.psi,
                self.group_size,
                self.rank,
                self.param_dtype,
                self.rule,
                self.offloaded,
                self.offload_fraction,
                self.host_state,
                self.grad_shard_dtype,
                self.masters,
                self.state_dtype,
            )
        )

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in _BYTE_FIELDS) + sum(self.state.values())

    @property
    def optimizer_state(self) -> int:
        """The sharded bytes: master weights and every state array."""
        return self.master_weights + sum(self.state.values())

    @property
    def exp_avg(self) -> int:
        """``state["exp_avg"]`` (0 for a rule without it)."""
        return self.state.get("exp_avg", 0)

    @property
    def exp_avg_sq(self) -> int:
        """``state["exp_avg_sq"]`` (0 for a rule without it)."""
        return self.state.get("exp_avg_sq", 0)

    @property
    def bytes_per_param(self) -> int | float:
        """K: the sharded part's bytes per parameter, from the state arrays and the dtype;
        offloaded, the device's (``masters``) and the host's (``host_bytes_per_param``) in
        their shares."""
        on_device = bytes_per_param(self.state, self.param_dtype, self.masters, self.state_dtype)
        if not self.offloaded:
            return on_device
        k = on_device + self.offload_fraction * (self.host_bytes_per_param - on_device)
        return int(k) if k == int(k) else k

    @property
    def host_bytes(self) -> int:
        """What the host holds beside the device: ``host_scratch``, ``checkpoint_buffer``,
        and offloaded, the master
        weights, the state and their padding (0 for NumPy parameters not offloaded)."""
        host_state = self.host_state or 0  # (an int once built: None means all or nothing)
        return host_state + self.host_padding + self.host_scratch + self.checkpoint_buffer

    @property
    def device_bytes(self) -> int:
        """What the parameters' device holds (the host for NumPy parameters): the rest."""
        return self.total - self.host_bytes

    @property
    def device_formula_bytes(self) -> float:
        """The formula for ``device_bytes``: all but ``host_formula_bytes`` (offloaded whole,
        2Ψ+2Ψ; 4Ψ+4Ψ for fp32; stage 2: 2Ψ and the gradient shard)."""
        if not self.offloaded:
            return self.formula_bytes
        params, grads = _replicated(self.param_dtype)
        sharded = self.bytes_per_param - self.offload_fraction * self.host_bytes_per_param
        if self.grad_shard_dtype is not None:  # stage 2: the gradient shard is sharded too
            sharded, grads = sharded + _replicated(self.grad_shard_dtype)[1], 0
        return _per_rank(((params, grads), (sharded,)), self.psi, self.group_size)

    @property
    def host_formula_bytes(self) -> float:
        """The formula for ``host_bytes``: offloaded, ``offload_fraction`` of K'Ψ/N, K' the
        host's bytes a parameter (fp32 master and state: Adam 12Ψ/N), else 0."""
        if not self.offloaded:
            return 0.0
        return self.offload_fraction * self.host_bytes_per_param * self.psi / self.group_size

    @property
    def host_bytes_per_param(self) -> int | float:
        """K': what an offloaded element keeps on the host: an fp32 master (fp32 parameters
        too) and its state as ``state_dtype``."""
        return bytes_per_param(self.state, MIXED_DTYPES[0], "fp32", self.state_dtype)

    @property
    def formula_bytes(self) -> float:
        """The stage-1 formula for this rule and dtype: 2Ψ+2Ψ+KΨ/N (16-bit; Adam 12Ψ/N) or
        4Ψ+4Ψ+KΨ/N (fp32; Adam 8Ψ/N); with a gradient shard (stage 2), 2Ψ+(G+K)Ψ/N, G its
        bytes per element (Adam, 16-bit: 2Ψ+14Ψ/N, or 2Ψ+16Ψ/N for an fp32 shard)."""
        k = self.bytes_per_param
        if self.grad_shard_dtype is not None:  # the table's Stage 2 column, this rule's K
            return stage_bytes(
                self.psi, self.group_size, 2, k, self.param_dtype, self.grad_shard_dtype
            )
        if self.param_dtype in FP32_DTYPES:
            return stage1_fp32_bytes(self.psi, self.group_size, k)
        return stage1_bytes(self.psi, self.group_size, k)

    @property
    def formula_label(self) -> str:
        """``2Ψ+2Ψ+12Ψ/N``, ``4Ψ+4Ψ+8Ψ/N``, ...: the formula this report is held to."""
        replicated = "4Ψ+4Ψ" if self.param_dtype in FP32_DTYPES else "2Ψ+2Ψ"
        if self.grad_shard_dtype is not None:
            sharded = _replicated(self.grad_shard_dtype)[1] + self.bytes_per_param
            return f"{replicated.split('+')[0]}+{sharded:g}Ψ/N"
        if self.offloaded:
            host = self.offload_fraction * self.host_bytes_per_param
            device = self.bytes_per_param - host
            on_device = f"+{device:.3g}Ψ/N" if device > 1e-9 else ""
            return f"device {replicated}{on_device}, host {host:.3g}Ψ/N"
        return f"{replicated}+{self.bytes_per_param:g}Ψ/N"

    @property
    def adam16_formula_bytes(self) -> float:
        """2Ψ + 2Ψ + 12Ψ/N: stage 1 for 16-bit parameters and Adam (the reference chapter's
        formula), whatever this report's dtype and rule."""
        return stage1_bytes(self.psi, self.group_size)

    def as_dict(self) -> dict:
        """The fields only (JSON-ready); ``MemoryReport(**d)`` rebuilds the report."""
        return asdict(self)

    def __str__(self) -> str:
        mib = 2.0**20
        rule = f", {self.rule}" if self.rule else ""
        lines = [
            f"rank {self.rank}/{self.group_size}: {self.psi} {self.param_dtype} parameters{rule}",
            f"  {'category':<16}{'bytes':>14}{'MiB':>11}",
        ]
        rows = [(name, getattr(self, name)) for name in _BYTE_FIELDS[:3]]
        rows += list(self.state.items())
        split = self.offloaded or self.host_bytes > 0  # a device and a host side to show
        rows += [
            (name, getattr(self, name))
            for name in _BYTE_FIELDS[3 : 8 if split else 5] + ("total",)
            if name != "checkpoint_buffer" or self.checkpoint_buffer
        ]
        if self.error_feedback:
            rows.insert(-1, ("error_feedback", self.error_feedback))
        if split:
            rows += [("device", self.device_bytes), ("host", self.host_bytes)]
        for name, value in rows:
            lines.append(f"  {name:<16}{value:>14}{value / mib:>11.2f}")
        if self.param_dtype in MIXED_DTYPES + FP32_DTYPES:
            formula = self.formula_bytes
            lines.append(
                f"  {'formula':<16}{formula:>14.0f}{formula / mib:>11.2f}  ({self.formula_label})"
            )
            if self.offloaded:
                for side in ("device", "host"):
                    value = getattr(self, f"{side}_formula_bytes")
                    lines.append(f"  {side + ' formula':<16}{value:>14.0f}{value / mib:>11.2f}")
            diff = self.total - formula
            lines.append(
                f"  {'difference':<16}{diff:>14.0f}{diff / mib:>11.2f}"
                f"  (total - formula: padding + scratch"
                f"{' + checkpoint buffer' if self.checkpoint_buffer else ''}"
                f"{' + error feedback' if self.error_feedback else ''})"
            )
        return "\n".join(lines)


def _count(what: str, value) -> int:
    """``value`` as an int >= 0, or a ValueError naming ``what``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what}={value!r} must be an integer; pass int(...)") from None
    if value < 0:
        raise ValueError(f"{what}={value!r} must be >= 0")
    return value
