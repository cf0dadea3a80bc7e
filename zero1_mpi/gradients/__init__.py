"""Where a step's gradients come from, stage by stage.

- ``source.py``: ``GradientSource``, the one interface the engine sees, and
  ``gradient_source`` that builds the one the options ask for.
- ``stage1.py``: ZeRO stage 1, the full gradient buffer reduced bucket by bucket as backward
  runs (``BucketPipeline``).
- ``stage2.py``: ZeRO stage 2, gradients handed over tensor by tensor into this rank's
  gradient shard (``GradientShards``).
"""

from ..moved import old_names

__all__: list[str] = []

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
