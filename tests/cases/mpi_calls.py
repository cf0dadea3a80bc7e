"""Only ``zero1_mpi.comm``'s communicator, agreement and started collectives call mpi4py objects.

The optimizer gets a spy: an ``MPI.Intracomm`` over COMM_WORLD whose methods, and those of every
communicator split or duplicated from it, record the module that looked them up. A planted call
from a module of the package must be caught; then construction, overlapped and lazy steps,
hierarchical groups (on an even number of ranks), a layout mismatch raised on every rank,
checkpoints and consolidated exports must record no other caller.

    mpiexec -n N python -m mpi4py tests/cases/mpi_calls.py DIR
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from casekit import check
from zero1_mpi import CollectiveError, ZeroAdamW, ZeroLAMB

callers = set()
MAKERS = ("Split", "Split_type", "Dup", "Create", "Create_group")


class Spy(MPI.Intracomm):
    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if name.startswith("__") or not callable(value):
            return value
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        if caller.startswith("zero1_mpi"):
            callers.add((caller, name))
        if name in MAKERS:
            return lambda *args, **kwargs: Spy(value(*args, **kwargs))
        return value


comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
directory = Path(sys.argv[1])
spy = Spy(comm)

# The spy sees a call made from a package module.
exec(compile("comm.Barrier()", "planted", "exec"), {"__name__": "zero1_mpi.planted", "comm": spy})
check(callers == {("zero1_mpi.planted", "Barrier")}, callers)
callers.clear()

shapes = {"w": (33, 7), "b": (7,), "s": ()}
init = {k: np.random.default_rng(len(k)).standard_normal(s).astype(np.float32)
        for k, s in shapes.items()}
for make, extra in ((ZeroAdamW, {}), (ZeroLAMB, {}),
                    (ZeroAdamW, {"shard_group_size": 2} if size % 2 == 0 and size > 2 else {})):
    opt = make(init, spy, lr=1e-2, param_dtype="bfloat16", bucket_elements=64, **extra)
    for step in range(3):
        for k in reversed(list(shapes)):
            opt.grads[k][...] = np.random.default_rng([step, rank]).standard_normal(shapes[k])
            opt.grads_ready(k)
        opt.step(wait=step % 2 == 0)
    saved = opt.save(directory / f"{make.__name__}-{len(extra)}")
    opt.load(saved)
    opt.save_consolidated(directory / f"{make.__name__}-{len(extra)}.safetensors")
    opt.load_consolidated(directory / f"{make.__name__}-{len(extra)}.safetensors")
    opt.memory_report()
try:  # different shapes on the last rank: the layouts are compared and described
    ZeroAdamW({"w": np.ones(5 if rank == size - 1 else 4, np.float32)}, spy)
except CollectiveError:
    pass
else:
    check(size == 1, "no CollectiveError for different shapes")

MPI_CALLERS = {f"zero1_mpi.comm.{m}" for m in ("communicator", "agreement", "started")}
outside = sorted(c for c in callers if c[0] not in MPI_CALLERS)
check(not outside, f"mpi4py methods called outside zero1_mpi.comm: {outside}")
check(("zero1_mpi.comm.agreement", "allgather") in callers, callers)  # the spy saw comm's calls
if rank == 0:
    print(f"OK no mpi4py calls outside zero1_mpi.comm on {size} ranks")
