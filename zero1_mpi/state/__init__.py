"""The sharded state: this rank's parameters, and for its shard the masters and the rule's state.

- ``sharded.py``: ``ShardedState``: the parameter buffer and its views, what checkpoints read
  and write, the update over the shard's parts, the gathers it starts.
- ``placement.py``: where the shard lives: ``WithParams`` (beside the parameters) or
  ``OffloadedShare`` (a share on the host): its parts, rows and kernels.
- ``host.py``: the host side of offload: host arrays, the copies in flight, threaded kernels.
- ``masters.py``: how the fp32 master weights are kept (fp32, or bf16 parameters' 16-bit
  remainders).
- ``encodings.py``: how the rule's state arrays are kept: fp32, bf16 with stochastic rounding;
  ``state_for`` picks the encoding, ``check_state_dtype`` the option's check.
- ``int8_blocks.py``: the 8-bit state: dynamic-map codes, an fp32 scale per block.

A new state encoding goes in a module of its own beside ``int8_blocks.py`` (``encodings.py``'s
``STATE_DTYPES`` and ``state_for`` name it); a new place to keep the shard (a stage-3
parameter shard, NVMe), beside ``placement.py``'s placements.
"""

from ..moved import old_names

__all__: list[str] = []

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
