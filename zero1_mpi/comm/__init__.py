"""Talking to the other ranks: the only package that imports mpi4py.

- ``communicator.py``: ``Communicator``, every collective the package uses, blocking and
  started, on NumPy or CuPy buffers; agreement on errors; aborts. The only module that calls
  an mpi4py object.
- ``capabilities.py``: what the MPI library at hand is and can do (CUDA-aware, persistent and
  device-started collectives), from arguments, environment variables and proven versions.
- ``nccl.py``: ``NcclCommunicator``, NCCL behind the same interface for CuPy buffers.
- ``topology.py``: the shard groups (hierarchical sharding) and their communicators.
- ``watchdog.py``: a step that waits too long on a collective ends the job with a message
  naming where each rank was.

``Communicator`` and ``CollectiveError`` are re-exported here (``zero1_mpi.comm.Communicator``).
"""

from .communicator import CollectiveError, Communicator

__all__ = ["Communicator", "CollectiveError"]
