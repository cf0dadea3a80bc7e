"""The built-in update rules, by name: the one list that the memory figures per rule, the tools
(``bench.py``, ``memory_table.py``, ``gpu_compile_check.py``) and the tests iterate.

Each entry names a module ``zero1_mpi/rules/<name>.py`` that defines ``RULE`` (its ``Rule``
class) and ``OPTIMIZER`` (the optimizer class that runs it, whose signature gives the rule's
default options). Adding a rule: that file, and its name in ``NAMES``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

from ..memory import bytes_per_param
from .protocol import Rule

__all__ = ["NAMES", "BuiltinRule", "builtin_rules", "get", "rule_states", "rule_bytes_per_param"]

NAMES = ("adam", "sgd", "lion", "lamb")


@dataclass(frozen=True)
class BuiltinRule:
    """One built-in rule: its ``Rule`` class and the optimizer class that runs it."""

    name: str
    rule: type[Rule]
    optimizer: type

    @property
    def variants(self) -> tuple[Rule, ...]:
        """One rule instance per configuration whose kernels or state arrays differ."""
        return self.rule.variants()

    @property
    def defaults(self) -> dict:
        """The rule's group options as the optimizer's signature defaults them."""
        parameters = inspect.signature(self.optimizer).parameters
        return {name: parameters[name].default for name in self.rule.options}


@functools.cache
def builtin_rules() -> dict[str, BuiltinRule]:
    """Every built-in rule by name, in the order of ``NAMES``."""
    found = {}
    for name in NAMES:
        module = importlib.import_module(f"{__package__}.{name}")
        found[name] = BuiltinRule(name, module.RULE, module.OPTIMIZER)
    return found


def get(name: str) -> BuiltinRule:
    """The built-in rule ``name``, or a ValueError listing the known ones."""
    rules = builtin_rules()
    if name not in rules:
        raise ValueError(f"unknown update rule {name!r}; known: {', '.join(sorted(rules))}")
    return rules[name]


def rule_states(name: str, momentum: bool = True) -> tuple[str, ...]:
    """The fp32 state arrays of the rule ``name``; ``momentum=False`` takes its variant with
    the fewest (plain SGD has none; the other rules have one variant's)."""
    variants = get(name).variants
    chosen = variants[0] if momentum else min(variants, key=lambda r: len(r.state_names))
    return tuple(chosen.state_names)


def rule_bytes_per_param(
    name: str = "adam",
    param_dtype: str = "float16",
    momentum: bool = True,
    masters: str = "fp32",
    state_dtype: str = "float32",
) -> int | float:
    """K of a rule by name, the bytes per parameter of the sharded part: 16-bit params: adam
    12, lamb 12, sgd 8 (4 without momentum), lion 8; fp32 params: 8, 8, 4 (0), 4; less with
    remainder ``masters`` or a narrower ``state_dtype`` (``memory.bytes_per_param``)."""
    return bytes_per_param(rule_states(name, momentum), param_dtype, masters, state_dtype)
