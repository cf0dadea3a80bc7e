"""The engine's options, each declared once: name, type, default, check and what it does.

``OPTIONS`` is the one declaration; ``generated.py`` makes the signatures, ``help()``, the list
of docs/api.md and ``repr(opt)`` from it, and ``EngineOptions.agreed`` the record the ranks
compare.
``check_options(given, context)`` runs the checks in declaration order, each the feature's own
(``state.host.check_offload``, ...; it may read the options before it and the context: the
arrays, the communicator, this node's ranks) and returns an ``EngineOptions``; a bad value
raises ValueError (TypeError for an unknown name) naming it and the fix. Local: the caller
agrees on errors and values across ranks.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm.capabilities import check_cuda_aware
from ..comm.topology import check_shard_group_size
from ..comm.watchdog import check_step_timeout
from ..flat.inputs import check_param_dtype
from ..flat.layout import DEFAULT_BUCKET_ELEMENTS, check_bucket_elements, check_units
from ..gradients.stage2 import (
    DEFAULT_STAGING,
    check_grad_shard_dtype,
    check_grad_staging,
    check_shard_gradients,
)
from ..scaler import LossScaler
from ..state.encodings import STATE_DTYPES, check_state_dtype
from ..state.host import (
    check_offload,
    check_offload_fraction,
    check_offload_threads,
)
from ..state.masters import MASTERS, check_masters
from ..step.pipeline import check_max_grad_norm
from ..wire.gradient_exchange import (
    COMPRESS_HOPS,
    REDUCE_DTYPES,
    check_compress_hops,
    check_error_feedback,
    check_reduce_dtype,
)
from ..wire.param_gathers import check_gather_dtype
from ..wire.unit_gathers import check_shard_params, default_units

__all__ = [
    "Option",
    "Values",
    "OPTIONS",
    "EngineOptions",
    "check_options",
    "python_scalar",
    "DEFAULT_STAGING",
    "REDUCE_DTYPES",
]


@dataclass(frozen=True)
class Values:
    """What an option takes, declared beside its check: the docs say it (``describe``) and the
    tests are made from it (tests/cases/declared_options.py): values outside it refused on every
    rank naming the option, those at its edges taken, ``other`` on one rank only refused by
    the agreement (unless the option is ``local``).

    ``kind``: ``"number"`` (a real number, finite), ``"integer"``, ``"choice"`` (one of
    ``choices``), ``"flag"`` (True or False) or ``"units"`` (``flat.layout.check_units``);
    ``low``/``high``: a number's bounds (``low_open``: ``low`` itself refused); ``none``:
    None taken too; ``also``: strings taken beside the kind's values. ``other``: a value the
    check takes that means something else than the default, with the options ``needs`` (on
    every rank); ``alone``: whether ``other`` without ``needs`` is taken (else it must be
    refused: a value that would mean nothing)."""

    kind: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    choices: tuple = ()
    none: bool = False
    also: tuple = ()
    other: Any = None
    needs: tuple = ()  # ((name, value), ...): hashable, as the dataclass is frozen
    alone: bool = False

    def describe(self) -> str:
        """``"a number > 0 or None"``: what the option takes, in words."""
        if self.kind == "flag":
            parts = ["True", "False"]
        elif self.kind == "units":
            parts = ["a mapping of unit name -> tensor names"]
        elif self.kind == "choice":
            parts = [repr(c) for c in self.choices]
        else:
            noun = "a number" if self.kind == "number" else "an integer"
            if self.low is not None and self.high is not None and not self.low_open:
                noun += f" from {self.low:g} to {self.high:g}"
            elif self.low is not None:
                noun += f" {'>' if self.low_open else '>='} {self.low:g}"
            parts = [noun]
        parts += [repr(a) for a in self.also] + (["None"] if self.none else [])
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


@dataclass(frozen=True)
class Option:
    """One engine option: ``check(value, checked)`` returns the value normalized, or raises;
    ``checked`` holds the context (``arrays``, ``comm``, ``comm_given``, ``node``) and the
    options declared before it. ``values``: what it takes (``Values``); ``local``: a rank's own
    choice, which the ranks need not share (the others must agree)."""

    name: str
    type: str
    default: Any
    check: Callable[[Any, dict], Any]
    doc: str
    values: Values
    local: bool = False


def _param_dtype(value, checked):
    return check_param_dtype(checked["arrays"], value)


def _loss_scale(value, checked):
    return LossScaler.from_option(value)


def _bucket_elements(value, checked):
    return check_bucket_elements(value)


def _units(value, checked):
    names = list(checked["arrays"])
    if value is None and checked["shard_params"]:
        value = default_units(names)
    return check_units(value, names)


def _step_timeout(value, checked):
    return check_step_timeout(value)


OPTIONS = (
    Option(
        "param_dtype",
        "str | None",
        None,
        _param_dtype,
        doc="``'float32'``, ``'float16'`` or ``'bfloat16'`` (``ml_dtypes.bfloat16``); "
        "default: the arrays' dtype. For fp32 parameters the owned shard of the "
        "parameter buffer is its own master copy (4Ψ + 4Ψ + 8Ψ/N bytes for Adam).",
        values=Values(
            "choice", choices=("float32", "float16", "bfloat16"), none=True, other="bfloat16"
        ),
    ),
    Option(
        "loss_scale",
        "float | str | LossScaler | None",
        None,
        _loss_scale,
        doc="None (no scaling), a number (fixed), ``'dynamic'`` (start 2^16, x2 after 2000 "
        "good steps, x0.5 on overflow, minimum 1) or "
        "``LossScaler.dynamic_scaler(...)``. Multiply the loss by ``opt.loss_scale`` "
        "before backward.",
        values=Values("number", low=0, low_open=True, none=True, also=("dynamic",), other=8.0),
    ),
    Option(
        "max_grad_norm",
        "float | None",
        None,
        check_max_grad_norm,
        doc="clip the averaged gradient to this global L2 norm (None: no clipping), as "
        "``torch.nn.utils.clip_grad_norm_`` over the full averaged gradient; each rank "
        "sums the squares of its shard, the step's one ``Allreduce`` adds them.",
        values=Values("number", low=0, low_open=True, none=True, other=1.0),
    ),
    Option(
        "reduce_dtype",
        "str",
        "float32",
        check_reduce_dtype,
        doc="precision of the gradient sum over ranks. ``'float32'``: fp32 gradients with "
        "``Reduce_scatter_block``, 16-bit ones exchanged with ``Alltoall`` and summed "
        "locally in fp32 in rank order (deterministic; MPI has no bf16 type). "
        "``'float16'`` (float16 gradients only): MPI's own fp16 sum, slower with MPICH, "
        "rounded at every partial sum and able to overflow before the division by N. "
        "``'int8'``: blockwise symmetric 8-bit values with an fp32 scale per 256 "
        "(``zero1_mpi.wire``), about half of 16-bit's bytes, decoded and summed in fp32 in "
        "rank order (deterministic); see ``compress_hops`` and ``error_feedback``.",
        values=Values("choice", choices=REDUCE_DTYPES, other="int8"),
    ),
    Option(
        "compress_hops",
        "str",
        "all",
        check_compress_hops,
        doc="with ``reduce_dtype='int8'`` and hierarchical sharding: ``'all'`` (every hop of "
        "the reduction in 8 bits) or ``'across'`` (only the sum across shard groups, where "
        "the link between nodes is; within a group as ``'float32'``).",
        values=Values(
            "choice",
            choices=COMPRESS_HOPS,
            other="across",
            needs=(("reduce_dtype", "int8"), ("shard_group_size", 2)),
        ),
    ),
    Option(
        "error_feedback",
        "bool",
        False,
        check_error_feedback,
        doc="with ``reduce_dtype='int8'``: keep what quantizing drops and add it to the next "
        "step's gradients (a residual for each compressed hop: Ψ values of the gradients' "
        "dtype within the group, Ψ/K of the reduced shard's across; "
        "``memory_report().error_feedback``); forgotten when a step is skipped or a "
        "checkpoint loaded (checkpoints do not hold it).",
        values=Values("flag", other=True, needs=(("reduce_dtype", "int8"),)),
    ),
    Option(
        "gather_dtype",
        "str | None",
        None,
        check_gather_dtype,
        doc="how the parameters travel in the all-gather: None (the parameters' dtype) or "
        "``'int8'`` (16-bit parameters: each step's change in 8-bit blocks, added to every "
        "rank's copy alike, so that the copies stay identical and within a bound of the "
        "fp32 masters' rounding that does not grow with the steps; docs/performance.md).",
        values=Values(
            "choice",
            choices=("int8",),
            none=True,
            other="int8",
            needs=(("param_dtype", "bfloat16"),),
        ),
    ),
    Option(
        "bucket_elements",
        "int",
        DEFAULT_BUCKET_ELEMENTS,
        _bucket_elements,
        doc="size of a communication bucket, in elements; it bounds the communication scratch.",
        values=Values("integer", low=1, other=64),
    ),
    Option(
        "cuda_aware",
        "bool | None",
        None,
        check_cuda_aware,
        doc="whether MPI takes GPU buffers; None asks the environment and MPI "
        "(docs/gpus.md). For a communicator this optimizer builds: pass it to a "
        "``Communicator`` you build instead.",
        values=Values("flag", none=True, other=False),
    ),
    Option(
        "shard_group_size",
        "int | str | None",
        None,
        check_shard_group_size,
        doc="hierarchical sharding (docs/clusters.md): None shards the state over all N "
        "ranks; an integer K that divides N over groups of K consecutive ranks, "
        "replicated across the N/K groups; ``'node'``: K = the ranks that share memory "
        "(placed by node). Gradients are reduce-scattered within a group and summed "
        "across the groups, parameters all-gathered within the group. "
        "``opt.shard_group_size`` (K), ``opt.shard_rank`` and ``opt.replicas`` (N/K) "
        "tell what was chosen.",
        values=Values("integer", low=2, none=True, also=("node",), other=2),
    ),
    Option(
        "offload",
        "str | None",
        None,
        check_offload,
        doc="``'cpu'``: keep the fp32 master weights and the rule's state of this rank's "
        "shard on the host and update them there with the CPU kernel (ZeRO-Offload, "
        "docs/memory.md), the device holding the parameters, gradients and "
        "communication scratch; the copies and the host kernel of neighbouring buckets "
        "overlap. None: all with the parameters.",
        values=Values("choice", choices=("cpu",), none=True, other="cpu"),
    ),
    Option(
        "offload_threads",
        "int | None",
        None,
        check_offload_threads,
        doc="the host kernel's threads with ``offload='cpu'`` (None: the cores this rank may use).",
        values=Values("integer", low=1, none=True, other=1, needs=(("offload", "cpu"),)),
        local=True,
    ),
    Option(
        "offload_fraction",
        "float",
        1.0,
        check_offload_fraction,
        doc="with ``offload='cpu'``, the share of this rank's shard (master weights and "
        "state) kept and updated on the host, 0 to 1; the rest stays on the device and "
        "is updated there, first, while the host part's copies and kernel follow. The "
        "split falls at the tensor-piece boundary nearest it (``memory_report()`` tells "
        "the bytes on each side). 0 keeps nothing on the host: the optimizer without "
        "``offload``.",
        values=Values("number", low=0, high=1, other=0.5, needs=(("offload", "cpu"),)),
    ),
    Option(
        "masters",
        "str",
        "auto",
        check_masters,
        doc="how this rank keeps the fp32 master weights of 16-bit parameters: ``'fp32'``, "
        "or ``'remainder'`` (bfloat16: the 16 bits the parameter lacks, 2 bytes a "
        "parameter instead of 4, the same masters bit for bit; ``zero1_mpi.state.masters``). "
        "``'auto'``: remainders for bfloat16 parameters unless ``offload`` or "
        "``gather_dtype`` is set, else fp32. With ``offload``, the host keeps fp32 masters; "
        "``'remainder'`` with ``offload_fraction`` below 1 keeps the device's part so. "
        "``opt.options.masters`` tells which.",
        values=Values(
            "choice",
            choices=MASTERS,
            other="fp32",
            needs=(("param_dtype", "bfloat16"),),
            alone=True,
        ),
    ),
    Option(
        "state_dtype",
        "str",
        "float32",
        check_state_dtype,
        doc="how this rank keeps the rule's state arrays (moments, momentum): ``'float32'``, "
        "or ``'bfloat16'`` (2 bytes each, rounded stochastically with bits drawn from the "
        "parameter's index and the step: the same on every rank count) or ``'int8'`` (8-bit "
        "codes of the dynamic map of 8-bit Adam with an fp32 scale per 256 values, about 1 "
        "byte each; tensors under 4096 elements keep fp32). ``zero1_mpi.state.encodings``, "
        "``zero1_mpi.state.int8_blocks``. "
        "Checkpoints hold fp32 state either way; offloaded, the host keeps its part so too.",
        values=Values("choice", choices=STATE_DTYPES, other="bfloat16"),
    ),
    Option(
        "shard_params",
        "bool",
        False,
        check_shard_params,
        doc="ZeRO stage 3 (docs/stage3.md): each rank keeps only its shard of the "
        "parameters too (and of the gradients: ``shard_gradients`` follows). Read a "
        "unit's tensors inside ``with opt.gathered(unit) as p:`` (a unit is all-gathered "
        "into a working buffer for the block; the next unit of the order the last step "
        "used travels meanwhile) and hand gradients over with ``add_grad``.",
        values=Values("flag", other=True),
    ),
    Option(
        "units",
        "dict | None",
        None,
        _units,
        doc="the units: a mapping unit name -> its tensors' names (each tensor in one unit, "
        "from any param groups); the tensors are laid out unit by unit, each unit "
        "starting a bucket and padded to whole shards, so that it is gathered (stage 3) "
        "in one go. None: with ``shard_params``, the "
        "tensors that share a name up to its last ``.``; else no units. "
        "``opt.options.units`` holds them, as ``(unit, tensors)`` pairs.",
        values=Values("units", none=True, other={"all": ["w", "b"]}),
    ),
    Option(
        "shard_gradients",
        "bool | None",
        None,
        check_shard_gradients,
        doc="ZeRO stage 2: no rank holds the full gradient. Hand each tensor's gradient "
        "over with ``add_grad(name, grad)`` (once per micro-batch, in the same order on "
        "every rank) instead of writing ``grads``; a bucket is reduced into this rank's "
        "gradient shard as soon as its last tensor is in, through a few staging "
        "buckets (``grad_staging``); the shard sums the micro-batches of a step. None: "
        "as ``shard_params``.",
        values=Values("flag", none=True, other=True),
    ),
    Option(
        "grad_shard_dtype",
        "str | None",
        None,
        check_grad_shard_dtype,
        doc="the gradient shard's dtype with ``shard_gradients``: None (the parameters') "
        "or ``'float32'`` (16-bit parameters: the exact fp32 sums, 2 bytes a parameter "
        "more per rank over N).",
        values=Values(
            "choice",
            choices=("float32",),
            none=True,
            other="float32",
            needs=(("shard_gradients", True), ("param_dtype", "bfloat16")),
        ),
    ),
    Option(
        "grad_staging",
        "int",
        DEFAULT_STAGING,
        check_grad_staging,
        doc="staging buckets with ``shard_gradients`` (at least 1).",
        values=Values("integer", low=1, other=3, needs=(("shard_gradients", True),)),
    ),
    Option(
        "step_timeout",
        "float | None",
        None,
        _step_timeout,
        doc="seconds a ``step()`` may wait for its collectives (the reduction and "
        "agreement; then the gathers, and ``wait()``'s; stage 2 reductions in "
        "``add_grad``) before the job is ended with a line naming the rank, step, phase "
        "and bucket, then MPI Abort (docs/clusters.md). None: no watchdog.",
        values=Values("number", low=0, low_open=True, none=True, other=600.0),
    ),
)
_BY_NAME = {option.name: option for option in OPTIONS}


class EngineOptions:
    """The checked engine options, one attribute per name of ``OPTIONS`` (e.g.
    ``param_dtype``: a NumPy dtype; ``shard_group_size``: K, the ranks per shard group;
    ``offload_threads``: the threads resolved; ``loss_scale``: the initial ``LossScaler``)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    if TYPE_CHECKING:  # for type checkers: the attributes are OPTIONS' names, declared there

        def __getattr__(self, name: str) -> Any: ...

    def agreed(self) -> dict:
        """The values every rank must share, as plain values (compared across ranks): all but
        the ``local`` options'."""
        return {
            name: _plain(value) for name, value in vars(self).items() if not _BY_NAME[name].local
        }

    def __repr__(self) -> str:
        return f"EngineOptions({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def check_options(given: dict, context: dict) -> EngineOptions:
    """``given`` (the keywords passed; the rest take their defaults) checked in declaration
    order; ``context``: ``arrays`` (by name), ``comm``, ``comm_given`` (the caller passed a
    ``Communicator``) and ``node`` (this node's ranks)."""
    unknown = [name for name in given if name not in _BY_NAME]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _BY_NAME, n=1)
        hint = f": did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}{hint}")
    checked = dict(context)
    for option in OPTIONS:
        value = python_scalar(given.get(option.name, option.default))
        checked[option.name] = option.check(value, checked)
    return EngineOptions({option.name: checked[option.name] for option in OPTIONS})


def python_scalar(value):
    """A NumPy scalar as the Python value it holds (``np.int64(64)`` is 64, ``np.True_`` is
    True), so that the checks take what NumPy computes as what Python writes."""
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    return value


def _plain(value):
    """``value`` if it pickles the same everywhere (None, str, int, float), else its repr."""
    return value if value is None or isinstance(value, (str, int, float)) else repr(value)
