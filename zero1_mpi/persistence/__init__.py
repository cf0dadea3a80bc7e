"""What an optimizer keeps on disk.

- ``on_disk.py``: ``Persistence``, the engine's part that saves, loads, exports and takes part
  in each step (a pending signal, a save still being written).
- ``checkpoint.py``: sharded checkpoints (manifest, shard files, byte checks, atomic publish
  and clean-up), loadable at any world size, blocking or in the background.
- ``consolidated.py``: one safetensors file of the full fp32 state by parameter name.
- ``preemption.py``: a checkpoint when the scheduler sends a signal.
"""

__all__: list[str] = []
