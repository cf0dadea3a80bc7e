"""One optimizer step, and the records it shares with persistence.

- ``pipeline.py``: ``StepPipeline``, reduce, agree (one ``Allreduce``), update, gather.
- ``records.py``: ``StepInfo`` (what a step did), ``Counters`` (what a step advances and a
  checkpoint saves) and ``Agreement`` (what the ranks sum in the step's ``Allreduce``).

A new phase of the step (stage 3's gathers of a unit before its forward) goes in the pipeline.
"""

from ..moved import old_names

__all__: list[str] = []

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
