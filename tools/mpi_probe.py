"""mpiexec -n 4 python -m mpi4py tools/mpi_probe.py [--mode all|default|persistent|nonblocking]
                                                   [--device]

Checks the collectives that zero1_mpi starts during a step (``Communicator.start_reduce_scatter``,
``start_alltoall``, ``start_allgather``) against what they must compute, on an MPI library you
name by running this under its ``mpiexec``: random data that changes every iteration, two
requests in flight at once (as two buckets are), message sizes from 1 to 1M elements per rank,
each as MPI-4 persistent collectives and as nonblocking ones. A reduce-scatter may add the ranks
in any order: its result must be within that rounding of the float64 sum. Run it before
setting ``ZERO1_MPI_PERSISTENT=1`` on a library zero1_mpi has not proven (``--mode default``
checks what zero1_mpi would use there). One line per mode, collective and size; exits 1 if any
result was wrong. A library that crashes here crashes the job (that is an answer too).

``--device`` runs the same checks on CuPy buffers handed to MPI as device pointers (ranks share
the GPUs round-robin), where zero1_mpi decides MPI is CUDA-aware (e.g. Intel MPI with
``I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda``); a library that passes may be added to
``zero1_mpi.comm.capabilities.DEVICE_STARTED_PROVEN`` (or ``ZERO1_MPI_DEVICE_STARTED=1`` set for it).
"""

import argparse
import sys
from pathlib import Path

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from mpi4py import MPI

from zero1_mpi import Communicator
from zero1_mpi.kernels.backend import to_numpy, xp_for
from zero1_mpi.comm.capabilities import mpi_library, resolve_cuda_aware

SIZES = (1, 7, 64, 1000, 65536 + 3, 1 << 20)  # elements per rank
COLLECTIVES = ("reduce_scatter float32", "reduce_scatter float16", "alltoall", "allgather")


def block(seed, rank, index, per_rank, dtype):
    """Block ``index`` of rank ``rank``'s buffer: any rank can draw any rank's blocks."""
    rng = np.random.default_rng(seed + [rank, index])
    return rng.standard_normal(per_rank).astype(dtype)


def check(comm: Communicator, collective: str, per_rank: int, iterations: int,
          xp=np) -> list[int]:
    """Iterations (of ``iterations``) in which this rank saw a wrong result; ``xp``: where the
    buffers live (NumPy, or CuPy for device buffers)."""
    rank, size, n = comm.rank, comm.size, per_rank * comm.size
    dtype = np.float16 if collective.endswith("float16") else np.float32
    buffers = [xp.empty(n, dtype) for _ in range(2)]
    received = [xp.empty(n, dtype) for _ in range(2)]
    wrong = []
    for it in range(iterations):
        seeds = [[it, b, per_rank, COLLECTIVES.index(collective)] for b in range(2)]
        for buf, seed in zip(buffers, seeds):
            buf[...] = np.nan  # allgather: only my block is mine to send
            for j in range(size) if collective != "allgather" else [rank]:
                buf[j * per_rank:(j + 1) * per_rank] = xp.asarray(
                    block(seed, rank, j, per_rank, dtype))
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        if collective.startswith("reduce_scatter"):
            requests = [comm.start_reduce_scatter(buf) for buf in buffers]
        elif collective == "alltoall":
            requests = [comm.start_alltoall(buf, out) for buf, out in zip(buffers, received)]
        else:
            requests = [comm.start_allgather(buf) for buf in buffers]
        for request in requests:
            request.wait()
        ok = True
        for b, seed in enumerate(seeds):
            if collective == "allgather":
                want = np.concatenate([block(seed, r, r, per_rank, dtype) for r in range(size)])
                ok &= np.array_equal(to_numpy(buffers[b]), want)
                continue
            sent_to_me = [block(seed, r, rank, per_rank, dtype) for r in range(size)]
            if collective == "alltoall":
                ok &= np.array_equal(to_numpy(received[b]), np.concatenate(sent_to_me))
                continue
            parts = np.array(sent_to_me, np.float64)
            got = to_numpy(comm.reduced_block(buffers[b])).astype(np.float64)
            unit = np.finfo(dtype).eps / 2  # any order of size - 1 additions, each rounded
            bound = (size - 1) * unit * 1.01 * np.abs(parts).sum(axis=0)
            ok &= bool(np.all(np.abs(got - parts.sum(axis=0)) <= bound))
        if not ok:
            wrong.append(it)
    return wrong


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="all",
                        choices=["all", "default", "persistent", "nonblocking"])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--device", action="store_true",
                        help="device buffers (CuPy), passed to a CUDA-aware MPI")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    xp, where = np, "host buffers"
    if args.device:
        aware, why = resolve_cuda_aware()
        if not aware:
            if world.rank == 0:
                print(f"mpi_probe --device: MPI is not CUDA-aware here ({why}): nothing to "
                      "probe on device buffers", flush=True)
            world.Barrier()  # rank 0 has said it before any rank's exit aborts the job
            return 2
        xp, where = xp_for("cupy"), f"device buffers ({why})"
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        xp.cuda.Device(local.Get_rank() % xp.cuda.runtime.getDeviceCount()).use()
        local.Free()
    modes = {"all": [False, True], "default": [None], "persistent": [True],
             "nonblocking": [False]}[args.mode]
    name, version = mpi_library()
    failures = 0
    for persistent in modes:
        comm = Communicator(world, persistent=persistent,
                            **({"cuda_aware": True, "device_started": True}
                               if args.device else {}))
        label = "persistent" if comm.persistent else "nonblocking"
        if world.rank == 0:
            print(f"{name} {'.'.join(map(str, version))} on {world.size} ranks, {label} "
                  f"collectives ({comm.persistent_source}), {where}", flush=True)
        for collective in COLLECTIVES:
            for per_rank in SIZES:
                iterations = args.iterations if per_rank < 65536 else max(2, args.iterations // 5)
                wrong = world.gather(check(comm, collective, per_rank, iterations, xp))
                if world.rank != 0:
                    continue
                bad = {r: w for r, w in enumerate(wrong) if w}
                verdict = "ok"
                if bad:
                    failures += 1
                    verdict = "WRONG on rank(s) " + ", ".join(
                        f"{r} ({len(w)}/{iterations})" for r, w in bad.items())
                print(f"  {label:11s} {collective:22s} {per_rank:>8d} el/rank x {iterations:2d}: "
                      f"{verdict}", flush=True)
        comm.close()
    failures = world.bcast(failures)
    if world.rank == 0:
        print(f"mpi_probe: {'all right' if not failures else f'{failures} WRONG'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
