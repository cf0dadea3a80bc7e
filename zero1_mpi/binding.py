"""What the framework bindings (``zero1_mpi.torch``, ``zero1_mpi.jax``) share.

``optimizer_class(rule)`` turns the ``rule`` argument of their ``ZeroOptimizer`` (an optimizer
class, or a rule's name) into the ``ShardedOptimizer`` subclass to build, or raises TypeError /
ValueError naming the accepted values. ``PassThrough`` gives a binding whose core optimizer is
``self.sharded`` the core's checkpoints, memory report, counters and ``close()``. No
framework imported.
"""

from __future__ import annotations

import inspect
import signal

from .engine import ShardedOptimizer
from .rules import registry

__all__ = ["RULE_NAMES", "PassThrough", "optimizer_class"]

#: The names a binding accepts: the registry's, and "adamw" (Adam with decoupled decay).
RULE_NAMES = ("adamw", *registry.NAMES)


def optimizer_class(rule) -> type:
    """The optimizer class ``rule`` names: a ``ShardedOptimizer`` subclass (``ZeroAdamW``, a
    user's own) as it is, or one of ``RULE_NAMES``."""
    if isinstance(rule, str):
        if rule.lower() == "adamw":
            from .rules.adam import ZeroAdamW
            return ZeroAdamW
        return registry.get(rule.lower()).optimizer
    if inspect.isclass(rule) and issubclass(rule, ShardedOptimizer) \
            and rule is not ShardedOptimizer:
        return rule
    raise TypeError(f"rule must be an optimizer class such as zero1_mpi.ZeroAdamW or a name "
                    f"({', '.join(map(repr, RULE_NAMES))}), got {rule!r}")


class PassThrough:
    """The core optimizer's interface that a binding keeps as it is (``self.sharded``). After
    ``load`` or ``load_consolidated``, views a framework made of the parameters show the loaded
    values; arrays it copied do not."""

    def wait(self) -> None:
        """Complete the all-gathers that an overlapped step left in flight (reading the
        parameters through the binding does it): before reading them any other way."""
        self.sharded.wait()

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before taking gradients (1.0 without loss scaling)."""
        return self.sharded.loss_scale

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (skipped ones not counted)."""
        return self.sharded.step_count

    def save(self, path, keep: int | None = None):
        """``ShardedOptimizer.save``: a sharded checkpoint under ``path``; all ranks."""
        return self.sharded.save(path, keep)

    def load(self, path):
        """``ShardedOptimizer.load``, in place (at any world size); all ranks."""
        return self.sharded.load(path)

    def save_consolidated(self, path):
        """``ShardedOptimizer.save_consolidated``: one file of the full fp32 state by name."""
        return self.sharded.save_consolidated(path)

    def load_consolidated(self, path):
        """``ShardedOptimizer.load_consolidated``, in place; all ranks."""
        return self.sharded.load_consolidated(path)

    def checkpoint_on_signal(self, path, signals=(signal.SIGTERM,), keep: int | None = None):
        """``ShardedOptimizer.checkpoint_on_signal``: a signal on any rank becomes a checkpoint
        and ``stop=True`` at the next step (``last_step.stop``); all ranks, main thread."""
        return self.sharded.checkpoint_on_signal(path, signals, keep)

    def close(self) -> None:
        """``ShardedOptimizer.close``: complete what is in flight and free the communicators,
        requests, threads and buffers; later use raises naming close(). Idempotent; all
        ranks. ``with ZeroOptimizer(...) as opt:`` calls it when the block ends."""
        self.sharded.close()

    def __enter__(self):
        self.sharded.__enter__()
        return self

    def __exit__(self, *exc_info) -> bool:
        self.close()
        return False

    def memory_report(self):
        """``ShardedOptimizer.memory_report``: the bytes this rank holds, by category."""
        return self.sharded.memory_report()
