"""The sharded state: this rank's parameters, and for its shard the masters and the rule's state.

- ``sharded.py``: ``ShardedState`` (on the parameters' device) and ``HostState`` (offloaded in
  whole or in part): the arrays, the views, the update kernel over the shard, the gathers it
  starts.
- ``host.py``: the host side of offload: host arrays, the copies in flight, threaded kernels.
- ``masters.py``: how the fp32 master weights are kept (fp32, or bf16 parameters' 16-bit
  remainders).
- ``encodings.py``: how the rule's state arrays are kept (fp32, bf16 with stochastic rounding,
  8-bit blocks).

A new state encoding goes in ``encodings.py``; a new place to keep the state, here.
"""

__all__: list[str] = []
