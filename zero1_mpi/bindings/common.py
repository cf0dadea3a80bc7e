"""What the framework bindings (``zero1_mpi.torch``, ``zero1_mpi.jax``) share.

``optimizer_class(rule)`` turns the ``rule`` argument of their ``ZeroOptimizer`` (an optimizer
class, or a rule's name) into the ``ShardedOptimizer`` subclass to build, or raises TypeError /
ValueError naming the accepted values. ``PassThrough`` gives a binding whose core optimizer is
``self.sharded`` the core's whole public interface (saves, loads, ``finish_save``, the memory
report, counters, ``close()``, ...), generated from ``ShardedOptimizer`` with its signatures;
a binding defines what it does its own way (``step``). No framework imported.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Literal

from ..engine import ShardedOptimizer
from ..rules import registry

__all__ = ["RULE_NAMES", "PassThrough", "CORE_INTERFACE", "optimizer_class"]

#: The names a binding accepts: the registry's, and "adamw" (Adam with decoupled decay).
RULE_NAMES = ("adamw", *registry.NAMES)


def optimizer_class(rule) -> type:
    """The optimizer class ``rule`` names: a ``ShardedOptimizer`` subclass (``ZeroAdamW``, a
    user's own) as it is, or one of ``RULE_NAMES``."""
    if isinstance(rule, str):
        if rule.lower() == "adamw":
            from ..rules.adam import ZeroAdamW

            return ZeroAdamW
        return registry.get(rule.lower()).optimizer
    if (
        inspect.isclass(rule)
        and issubclass(rule, ShardedOptimizer)
        and rule is not ShardedOptimizer
    ):
        return rule
    raise TypeError(
        f"rule must be an optimizer class such as zero1_mpi.ZeroAdamW or a name "
        f"({', '.join(map(repr, RULE_NAMES))}), got {rule!r}"
    )


class PassThrough:
    """The core optimizer's whole interface for a binding whose core is ``self.sharded``: every
    public method and property of ``ShardedOptimizer`` that the binding does not define itself
    forwards to it, with the core's signature and docstring (``CORE_INTERFACE``; generated
    below, so nothing is kept in step by hand). A ``with`` block gives the binding. After
    ``load`` or ``load_consolidated``, views a framework made of the parameters show the
    loaded values; arrays it copied do not."""

    sharded: ShardedOptimizer

    if TYPE_CHECKING:  # for type checkers: two of the members generated below (CORE_INTERFACE)

        def close(self) -> None: ...

        def wait(self) -> None: ...

    def __enter__(self):
        self.sharded.__enter__()
        return self

    def __exit__(self, *exc_info) -> Literal[False]:
        self.close()
        return False


def _forward(name: str, member):
    """A method or property of ``PassThrough`` that forwards ``name`` to ``self.sharded``."""
    if isinstance(member, property):
        return property(lambda self: getattr(self.sharded, name), doc=member.__doc__)

    @functools.wraps(member)  # the core's name, docstring and (through __wrapped__) signature
    def forward(self, *args, **kwargs):
        return getattr(self.sharded, name)(*args, **kwargs)

    return forward


#: The core's public interface, by name: its methods and properties.
CORE_INTERFACE = {
    name: member
    for name, member in vars(ShardedOptimizer).items()
    if not name.startswith("_") and (callable(member) or isinstance(member, property))
}
for _name, _member in CORE_INTERFACE.items():
    setattr(PassThrough, _name, _forward(_name, _member))
