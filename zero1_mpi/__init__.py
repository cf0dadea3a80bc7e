"""zero1_mpi: ZeRO Stage 1 (optimizer-state partitioning) for MPI programs.

``ZeroAdam`` / ``ZeroAdamW``, ``ZeroSGD``, ``ZeroLion`` and ``ZeroLAMB`` keep fp32 master
weights and their rule's state for 1/N of the parameters on each of N ranks; the parameters and
gradients stay replicated in flat NumPy or CuPy buffers that the model sees through named views.
``ShardedOptimizer`` runs any ``Rule`` (``zero1_mpi.rules``) the same way.
"""

from .comm.communicator import CollectiveError, Communicator
from .engine import ShardedOptimizer, StepInfo
from .flat.inputs import decay_groups
from .flat.layout import Layout, build_layout
from .memory import MemoryReport
from .moved import install as _keep_old_paths
from .persistence.manifest import CheckpointError
from .rules import Rule
from .rules.adam import ZeroAdam, ZeroAdamW
from .rules.lamb import ZeroLAMB
from .rules.lion import ZeroLion
from .rules.sgd import ZeroSGD
from .scaler import LossScaler

__all__ = [
    "ZeroAdam",
    "ZeroAdamW",
    "ZeroSGD",
    "ZeroLion",
    "ZeroLAMB",
    "ShardedOptimizer",
    "StepInfo",
    "Rule",
    "LossScaler",
    "decay_groups",
    "MemoryReport",
    "Communicator",
    "CollectiveError",
    "CheckpointError",
    "Layout",
    "build_layout",
]
__version__ = "0.1.0"
_keep_old_paths()  # 0.1.0's module paths, with a DeprecationWarning (zero1_mpi.moved)
