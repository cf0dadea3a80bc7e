"""What one optimizer rank really holds: ``MemoryReport``, in bytes, split so that every byte is
counted once, with the formula it should match (``memory.formulas``) and its table.

Built by ``memory.ledger`` from the arrays an optimizer's parts allocated; ``formula_bytes``
and ``formula_label`` give what ``formulas`` predicts for the same options, which the tests
compare to the byte. Stdlib only: no numpy, no MPI, no rules.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from .formulas import (
    FP32_DTYPES,
    MASTER_BYTES,
    MIXED_DTYPES,
    STATE_BYTES,
    bytes_per_param,
    per_rank_bytes,
    replicated_terms,
    stage1_bytes,
    stage1_fp32_bytes,
    stage_bytes,
)

__all__ = ["MemoryReport"]


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
    tie, ``zero1_mpi.state.masters``; ``state_dtype``: how each state array is kept, 4 bytes an
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
    params_sharded: bool = False

    def __post_init__(self):
        _check_fields(self)

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
                self.params_sharded,
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
        params, grads = replicated_terms(self.param_dtype)
        sharded = self.bytes_per_param - self.offload_fraction * self.host_bytes_per_param
        if self.grad_shard_dtype is not None:  # stage 2: the gradient shard is sharded too
            sharded, grads = sharded + replicated_terms(self.grad_shard_dtype)[1], 0
        return per_rank_bytes(((params, grads), (sharded,)), self.psi, self.group_size)

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
        if self.params_sharded:  # the table's Stage 3 column, this rule's K
            return stage_bytes(
                self.psi, self.group_size, 3, k, self.param_dtype, self.grad_shard_dtype
            )
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
        if self.params_sharded:
            param = replicated_terms(self.param_dtype)[0]
            grad = replicated_terms(self.grad_shard_dtype or self.param_dtype)[1]
            return f"{param + grad + self.bytes_per_param:g}Ψ/N"
        if self.grad_shard_dtype is not None:
            sharded = replicated_terms(self.grad_shard_dtype)[1] + self.bytes_per_param
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


def _check_fields(self: MemoryReport) -> None:
    """Each field of a ``MemoryReport`` checked, counts normalized; a ValueError naming the
    field and what it must be."""
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
    if not isinstance(self.params_sharded, bool):
        raise ValueError(
            f"MemoryReport.params_sharded={self.params_sharded!r} must be True (stage 3) or False"
        )
    fraction = self.offload_fraction
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, numbers.Real)
        or not 0 <= fraction <= 1
    ):
        raise ValueError(f"MemoryReport.offload_fraction={fraction!r} must be a number from 0 to 1")
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
            f"MemoryReport.state_dtype={self.state_dtype!r} must be one of {', '.join(STATE_BYTES)}"
        )
    if self.masters not in MASTER_BYTES:
        raise ValueError(
            f"MemoryReport.masters={self.masters!r} must be one of {', '.join(MASTER_BYTES)}"
        )
    if self.rule is not None and not isinstance(self.rule, str):
        raise ValueError(
            f"MemoryReport.rule={self.rule!r} must be a rule name such as 'adam', or None"
        )


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
