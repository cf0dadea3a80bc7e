"""Every rank waits forever (for tests of the runner's timeout): prints its pid first."""

import os
import time

from mpi4py import MPI

print(f"hanging rank {MPI.COMM_WORLD.Get_rank()} pid {os.getpid()}", flush=True)
time.sleep(3600)
