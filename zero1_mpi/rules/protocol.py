"""What the engine needs of an update rule: the ``Rule``, ``Kernel`` and ``TwoPhaseKernel``
protocols, and ``missing_members`` to check a rule against them.

A rule says what an optimizer does to its shard, apart from all that the engine does: its
state arrays, its options and their checks, its host scalars, and its fused update in three
twins (NumPy, Numba with the NumPy twin's bits, CuPy). The built-in rules live in
``zero1_mpi.rules`` (one file each, listed by ``rules.registry``). A rule whose update needs
norms of whole tensors (LAMB's trust ratio) sets ``tensor_sums = k`` and gives a
``TwoPhaseKernel``. Pure: no arrays, no MPI.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = ["Rule", "Kernel", "TwoPhaseKernel", "missing_members"]


@runtime_checkable
class Kernel(Protocol):
    """A fused update over one owned range, called as ``kernel(grad, master, *states, param,
    scalars)``.

    ``grad`` is this rank's summed gradient in any supported dtype (multiplied by
    ``scalars``' gradient factor first, which turns a sum over ranks into a mean, unscales and
    clips); ``master`` (fp32) and each of the rule's ``states`` (fp32) are updated in place;
    ``param`` receives the new values rounded to 16 bits, or is None for fp32 parameters (then
    ``master`` *is* the parameter range). ``scratch_bytes``: what it allocated, once.
    """

    scratch_bytes: int

    def __call__(self, grad, master, *states_param_scalars) -> None: ...


@runtime_checkable
class TwoPhaseKernel(Protocol):
    """The update of a rule with ``tensor_sums = k``, over one piece of one tensor.

    ``tensor_sums(grad, master, *states, scalars)`` may update the state and returns the
    piece's ``k`` partial sums (host or device float64); the engine adds the pieces per
    tensor and over ranks (one ``Allreduce`` per step), ``rule.tensor_scalars`` turns each
    tensor's totals into its scalars, and ``apply(master, *states, param, tensor_scalars)``
    updates the piece.
    """

    scratch_bytes: int

    def tensor_sums(self, grad, master, *states_scalars) -> Any: ...

    def apply(self, master, *states_param_scalars) -> None: ...


@runtime_checkable
class Rule(Protocol):
    """What the engine needs of an update rule. Subclass it: it gives the defaults below.

    Attributes:
        name: recorded in checkpoints and exports (only the same rule loads them).
        state_names: its fp32 state arrays, one element per owned parameter, in order.
        options: the names of its param-group options.
        tensor_sums: 0 for an elementwise rule (``kernel`` gives a ``Kernel``); ``k`` > 0 for
            one that needs ``k`` sums over each whole tensor (``kernel`` gives a
            ``TwoPhaseKernel``, and ``tensor_scalars`` is used).
    """

    name: ClassVar[str]
    state_names: tuple[str, ...]
    options: tuple[str, ...]
    tensor_sums: int = 0

    # Called with the options as keywords; (*args: Any, **values: Any) lets a rule name them.
    def check_options(self, *args: Any, **values: Any) -> dict:
        """Return the options normalized (floats, tuples), or raise ValueError/TypeError
        naming the bad value and the fix."""
        ...

    def settings(self) -> dict:
        """Return the rule-wide choices every rank must share (checked across ranks)."""
        return {"rule": self.name}

    def scalars(self, step: int, options: dict, grad_scale: float) -> Any:
        """Return the host scalars of ``step`` for one param group (``options`` checked);
        ``grad_scale`` multiplies the incoming summed gradient."""
        ...

    def kernel(self, kind: str, largest: int) -> Kernel | TwoPhaseKernel:
        """Return the fused update for ``kind`` (``"numpy"``, ``"numba"`` or ``"cupy"``);
        ``largest``: the most elements one call sees (it caps CPU scratch)."""
        ...

    def tensor_scalars(self, scalars, totals) -> Any:
        """Return one tensor's scalars from its group's ``scalars`` and its ``tensor_sums``
        totals over ranks (two-phase rules only)."""
        # (two statements: a protocol member whose body only raises is abstract to mypy)
        message = (
            f"the {self.name!r} rule has tensor_sums = {self.tensor_sums} and no tensor_scalars"
        )
        raise NotImplementedError(message)

    @classmethod
    def variants(cls) -> tuple[Rule, ...]:
        """Return one instance of each configuration whose kernels or state arrays differ,
        for the tools and tests that cover every kernel (default: ``cls()``)."""
        return (cls(),)


def missing_members(rule) -> list[str]:
    """The members of ``Rule`` that the engine uses and ``rule`` lacks (empty for a complete
    rule; ``tensor_scalars`` only where ``tensor_sums`` > 0, ``variants`` is the tools')."""
    members = set(Rule.__annotations__) | {
        name for name, value in vars(Rule).items() if not name.startswith("_") and callable(value)
    }
    if not getattr(rule, "tensor_sums", 0):
        members.discard("tensor_scalars")
    return sorted(name for name in members if not hasattr(rule, name))
