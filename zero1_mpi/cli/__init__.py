"""The command-line tools, as console scripts and ``python -m``.

- ``memory.py``: ``zero1-memory`` (``python -m zero1_mpi.memory``), each rank's memory per
  stage from ``zero1_mpi.memory``'s formulas.
- ``plan.py``: ``zero1-plan`` (``python -m zero1_mpi.plan``), the communication model: the
  bytes and link time of one step's collectives per sharding and wire format.
"""

__all__: list[str] = []
