"""The built-in update rules, one file each: ``rules/<name>.py`` holds a ``Rule`` (its state
arrays, options and host scalars), its fused update in three twins (``Kernel``: NumPy, Numba
with the NumPy twin's bits, CuPy) and the optimizer that binds it to the engine.
``rules.registry`` lists them; ``rules.options`` checks their options. The protocols a rule
implements are ``zero1_mpi.rule``'s, re-exported here.
"""

from ..rule import Kernel, Rule, TwoPhaseKernel, missing_members

__all__ = ["Rule", "Kernel", "TwoPhaseKernel", "missing_members"]
