"""What an optimizer keeps on disk.

- ``on_disk.py``: ``Persistence``, the engine's part that saves, loads, exports and takes part
  in each step (a pending signal, a save still being written).
- ``checkpoint.py``: sharded checkpoints saved and loaded, at any world size, blocking or in
  the background (``PendingSave``).
- ``manifest.py``: what a checkpoint is on disk (names, manifest keys per version) and every
  check a load runs before it reads (digests, keys, files, compatibility).
- ``publish.py``: a written checkpoint published by synced atomic renames; clean-up that
  removes only saves' own files.
- ``consolidated.py``: one safetensors file of the full fp32 state by parameter name.
- ``preemption.py``: a checkpoint when the scheduler sends a signal.
"""

from ..moved import old_names

__all__: list[str] = []

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
