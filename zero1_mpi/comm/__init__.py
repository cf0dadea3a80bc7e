"""Talking to the other ranks: the only package that imports mpi4py.

- ``communicator.py``: ``Communicator``, every collective the package uses, blocking and
  started, on NumPy or CuPy buffers; the face of the modules below. Only it, ``agreement.py``
  and ``started.py`` call an mpi4py object.
- ``agreement.py``: errors agreed across ranks (``agree``, ``check_same``,
  ``collective_call``, ``abort_on_error``), so that no rank waits forever for a failed one.
- ``started.py``: started collectives (MPI-4 persistent where proven, else nonblocking) and
  the ``Request`` a caller completes.
- ``staging.py``: how a buffer reaches MPI: as it is, or staged through pinned host memory;
  out-of-place reduce-scatter blocks.
- ``capabilities.py``: what the MPI library at hand is and can do (CUDA-aware, persistent and
  device-started collectives), from arguments, environment variables and proven versions;
  ``mpi4py.MPI``, loaded at its first use.
- ``nccl.py``: ``NcclCommunicator``, NCCL behind the same interface for CuPy buffers.
- ``topology.py``: the shard groups (hierarchical sharding) and their communicators.
- ``watchdog.py``: a step that waits too long on a collective ends the job with a message
  naming where each rank was.

A new collective goes in ``communicator.py`` (started: ``started.py``); a new transport, beside
``nccl.py``. ``Communicator`` and ``CollectiveError`` are re-exported here
(``zero1_mpi.comm.Communicator``).
"""

from ..moved import old_names
from .communicator import CollectiveError, Communicator

__all__ = ["Communicator", "CollectiveError"]

__getattr__ = old_names(__name__)  # 0.1.0 names of the module this package replaced
