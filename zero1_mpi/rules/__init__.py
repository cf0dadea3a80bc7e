"""The update rules, one file each, and what the engine needs of a rule.

- ``protocol.py``: the ``Rule``, ``Kernel`` and ``TwoPhaseKernel`` protocols a rule implements,
  and ``missing_members`` to check one (re-exported here).
- ``adam.py``, ``lamb.py``, ``lion.py``, ``sgd.py``: the built-in rules. Each holds a ``Rule``
  (its state arrays, options and host scalars), its fused update in three twins (NumPy, Numba
  with the NumPy twin's bits, CuPy) and the optimizer that binds it to the engine.
- ``options.py``: checks of the rules' options (betas, eps, weight decay, ...).
- ``registry.py``: the built-in rules by name, their state arrays and bytes per parameter.

A new rule is a file here, listed in ``registry.py`` (docs/update-rules.md).
"""

from .protocol import Kernel, Rule, TwoPhaseKernel, missing_members

__all__ = ["Rule", "Kernel", "TwoPhaseKernel", "missing_members"]
