"""Optimizers built and closed one after another give their memory back, under every MPI.

    mpiexec -n 2 python -m mpi4py tests/cases/rebuild_memory.py

Builds, steps and closes 40 optimizers of a 2 MiB tensor (its bucket's started collectives
made and freed each time), then checks each rank's RSS grew by less than 8 MiB over the last
35. Open MPI 5.0.11's persistent in-place ``Reduce_scatter_block_init`` keeps its 2 MiB of
scratch on rank 0 after ``MPI_Request_free`` (+72 MiB here), which is why Open MPI gets
nonblocking collectives (``comm.PERSISTENT_PROVEN``). Intel MPI 2021.18 keeps a pool of up to
about 37 MiB for large point-to-point messages (the parameters' broadcast), filled by its first
few dozen of them, then reused: the case fills it before counting.
"""

import ctypes

import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroAdamW
from casekit import check

comm = MPI.COMM_WORLD
# glibc maps every buffer of 128 KiB or more on its own and unmaps it when freed (without this,
# it raises the threshold after such a free and keeps freed buffers in the heap)
ctypes.CDLL(None).mallopt(ctypes.c_int(-3), ctypes.c_int(128 << 10))  # M_MMAP_THRESHOLD


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def build_step_close() -> str:
    """Returns how the optimizer's communicator started its collectives, and why."""
    with ZeroAdamW({"w": np.ones(1 << 19, np.float32)}, comm, lr=1e-3) as opt:
        opt.grads["w"][...] = 1e-3
        opt.step()
        return f"{'persistent' if opt.comm.persistent else 'nonblocking'}: " \
               f"{opt.comm.persistent_source}"


warm = np.ones(1 << 19, np.float32)
for _ in range(64):  # Intel MPI's pool for large messages, full before the count starts
    comm.Bcast(warm, root=0)
del warm
for count in range(40):
    started = build_step_close()
    if count == 4:
        start = rss_kib()
grown = comm.allgather(rss_kib() - start)
check(max(grown) < 8 << 10, f"RSS grew {grown} KiB per rank over 35 optimizers built and "
      f"closed (started collectives {started})")
if comm.rank == 0:
    print(f"OK memory given back: RSS grew {grown} KiB per rank over 35 optimizers built and "
          "closed")
