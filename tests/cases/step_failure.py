"""One rank raises inside ``step()`` while the others wait in a collective.

Launched as ``python -m mpi4py``, the uncaught exception aborts the whole job: the test checks
that it ends quickly, non-zero, with the error in its output, instead of hanging.
"""

import numpy as np
from mpi4py import MPI

from casekit import fail_in
from zero1_mpi import ZeroAdam

comm = MPI.COMM_WORLD
opt = ZeroAdam({"w": np.ones(1000, np.float32)})
opt.step()
if comm.Get_rank() == comm.Get_size() - 1:
    def broken_update(*args):
        raise MemoryError("injected failure in the Adam kernel")
    fail_in(opt, "update", broken_update)  # the others go on into the all-gather and wait
opt.step()
print("UNREACHABLE: step returned on rank", comm.Get_rank(), flush=True)
