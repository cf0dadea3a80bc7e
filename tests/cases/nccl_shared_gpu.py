"""NcclCommunicator with every rank on GPU 0: each rank raises the same clear error, naming
the ranks and the GPU, before NCCL starts (NCCL itself would log "Duplicate GPU detected" and
fail on some ranks, or hang). A GPU machine's case: tests/test_gpu.py runs it.

    mpiexec -n 2 python -m mpi4py tests/cases/nccl_shared_gpu.py
"""

from mpi4py import MPI

from casekit import check
from zero1_mpi.kernels.backend import use_device
from zero1_mpi.comm.nccl import NcclCommunicator

comm = MPI.COMM_WORLD
use_device(0)
try:
    NcclCommunicator(comm)
except RuntimeError as exc:
    for words in ("ranks 0 and 1 both use the GPU", "Duplicate GPU detected",
                  "zero1_mpi.Communicator"):
        check(words in str(exc), f"rank {comm.rank}: {exc}")
else:
    raise AssertionError(f"rank {comm.rank}: NcclCommunicator accepted two ranks on one GPU")
print(f"rank {comm.rank}: refused: ranks share a GPU", flush=True)
comm.Barrier()
if comm.rank == 0:
    print(f"OK nccl shared gpu: {comm.size} ranks refused", flush=True)
