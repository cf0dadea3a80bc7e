"""What is generated from the engine options' one declaration (``options.OPTIONS``): every
optimizer's keyword-only parameters (``signature_parameters``), the "Engine options" section of
their docstrings (``docstring_section``: ``help()``), the list of docs/api.md between its
``MARKERS`` (``markdown``) and ``repr(opt)`` (``describe``). Pure: it reads, never checks."""

from __future__ import annotations

import inspect
import textwrap

from .options import OPTIONS

__all__ = ["signature_parameters", "docstring_section", "MARKERS", "markdown", "describe"]


def signature_parameters() -> list[inspect.Parameter]:
    """The options as keyword-only parameters, with their defaults and types."""
    return [
        inspect.Parameter(
            o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type
        )
        for o in OPTIONS
    ]


def docstring_section(indent: int = 4) -> str:
    """The "Engine options (keyword-only):" section of the optimizers' docstrings."""
    pad = " " * indent
    lines = [f"{pad}Engine options (keyword-only):"]
    for o in OPTIONS:
        lines += textwrap.wrap(
            f"{o.name}: {o.doc}",
            96 - indent,
            initial_indent=pad * 2,
            subsequent_indent=pad * 3,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


#: The lines of docs/api.md between which ``markdown()`` stands (tools/docs_options.py).
MARKERS = (
    "<!-- engine options: generated from zero1_mpi.config.options.OPTIONS -->",
    "<!-- end of engine options -->",
)


def markdown() -> str:
    """The options as the Markdown list of docs/api.md (between its ``MARKERS``)."""
    return "\n".join(
        textwrap.fill(
            f"- `{o.name}` (`{o.type}`, default `{o.default!r}`): {o.doc.replace('``', '`')} "
            f"Takes {o.values.describe()}{'; may differ between ranks' if o.local else ''}.",
            96,
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
        for o in OPTIONS
    )


def describe(opt) -> str:
    """``repr`` of an optimizer ``opt``: its rule and the rule's settings, N, the shard groups,
    the stage, the dtypes and offload, then each param group's options (as torch's optimizers
    print them), and whether it was closed."""
    o, settings = opt.options, {k: v for k, v in opt.rule.settings().items() if k != "rule"}
    extra = "".join(f", {k}={v!r}" for k, v in settings.items())
    n, k = opt.world_size, o.shard_group_size
    stage = (
        "stage 2, grad_shard_dtype=" + o.grad_shard_dtype.name if o.shard_gradients else "stage 1"
    )
    wire = "".join(
        f", {name}={getattr(o, name)!r}"
        for name, plain in (
            ("compress_hops", "all"),
            ("error_feedback", False),
            ("gather_dtype", None),
        )
        if getattr(o, name) != plain
    )
    fraction = f", offload_fraction={o.offload_fraction:g}" if o.offload_fraction != 1 else ""
    lines = [
        f"{type(opt).__name__} (rule {opt.rule.name!r}{extra}; N={n}, shard_group_size="
        f"{k} ({n // k} replicas), {stage}, param_dtype={o.param_dtype.name}, "
        f"reduce_dtype={o.reduce_dtype}{wire}, offload={o.offload!r}{fraction})"
    ]
    for index, group in enumerate(opt.param_groups):
        lines.append(f"Parameter Group {index} ({len(group['names'])} tensors)")
        lines += [f"    {key}: {group[key]!r}" for key in opt.rule.options]
    return "\n".join(lines + (["(closed)"] if opt.closed else []))
