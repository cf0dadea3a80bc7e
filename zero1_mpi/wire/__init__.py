"""What travels between ranks in a step, and in which format.

- ``sizes.py``: the 8-bit format's bytes per row (stdlib only: the planner counts with it).
- ``codec.py``: the 8-bit wire format (blocks of int8 codes with an fp32 scale) and its
  error-feedback residuals, in NumPy, Numba and CuPy twins.
- ``gradient_exchange.py``: how a bucket's gradients are reduced within a shard group
  (reduce-scatter, or an ``Alltoall`` of 16-bit or 8-bit rows summed in fp32) and how a reduced
  shard is summed across the groups.
- ``param_gathers.py``: the parameters' all-gathers after the update (16-bit, or the 8-bit
  change).
- ``unit_gathers.py``: stage 3's: each rank keeps its shard of the parameters, and a unit is
  all-gathered into a working buffer while it is used (prefetched along the last step's order).

A new wire format is a codec here, used by the exchange and the gathers.
"""

from ..moved import old_names

__all__: list[str] = []

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
