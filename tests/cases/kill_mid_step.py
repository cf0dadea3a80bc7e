"""One rank is killed with SIGKILL inside ``step()``, between the reduce-scatter and the
all-gather, while the others go on into the all-gather and wait for it.

No Python code runs on the killed rank, so nothing of zero1_mpi's can end the job: the MPI
launcher must notice the dead process and end the others. The test measures how long that
takes. The killed rank prints ``KILLING`` first, so the test knows the kill happened there.
"""

import os
import signal

import numpy as np
from mpi4py import MPI

from casekit import fail_in
from zero1_mpi import ZeroAdam

comm = MPI.COMM_WORLD
opt = ZeroAdam({"w": np.ones(100_000, np.float32)}, bucket_elements=1 << 14)
opt.step()
if comm.Get_rank() == comm.Get_size() - 1:
    def killed_update(*args):
        print(f"KILLING rank {comm.Get_rank()} after the reduce-scatter", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    fail_in(opt, "update", killed_update)  # after the reductions, before the all-gathers
opt.grads["w"][...] = 1.0
opt.step()
print("UNREACHABLE: step returned on rank", comm.Get_rank(), flush=True)
