"""``zero1-plan``'s collectives against the ones a step hands to MPI, for every combination the
plan models that N ranks can run: stage 1 and 2, fp32, fp16 and bf16 parameters, fp32, fp16
and int8 sums (``compress_hops`` all and across), 16-bit and int8 gathers, one shard group of
all ranks and groups of 2, 1 and 2 micro-batches.

    mpiexec -n 4 python -m mpi4py tests/cases/plan_bytes.py     (and -n 6: 3 replicas)

A ``Spy`` communicator passes every array collective to MPI and notes its name, the ranks it
spans and the bytes of its buffer as the plan counts them (an all-to-all's or reduce-scatter's
input, an all-gather's result, an all-reduce's buffer). One step of one tensor of Ψ elements
(a multiple of the buckets, so that no padding is sent): for each collective of the plan, the
bytes noted over the step's calls on this rank equal ``buffer_bytes x times_per_step``, and no
collective runs that the plan lacks (the agreement: one ``Allreduce`` over all N of at most
64 bytes).
"""

import itertools
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from casekit import check, rank, size, world
from zero1_mpi import Communicator, ZeroAdamW
from zero1_mpi.cli.plan import plan

#: Where each counted collective's buffer is among its arguments (an in-place reduce-scatter:
#: the receive buffer, which is its input).
COUNTED = {"Reduce_scatter_block": 0, "Alltoall": 0, "Allgather": 1, "Allreduce": 1}
BUCKET = 256 * 12 * 32  # shards of whole 8-bit blocks (256) in groups of 1, 2, 3, 4 and 6
PSI = 4 * BUCKET


def nbytes(spec) -> int:
    buf = spec[0] if isinstance(spec, (list, tuple)) else spec
    return int(np.asarray(buf).nbytes) if not hasattr(buf, "nbytes") else int(buf.nbytes)


class Counting:
    """An mpi4py communicator whose array collectives (blocking or started) are noted in
    ``log`` as ``(name, ranks, bytes)`` before MPI runs them."""

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        plain = name[1:].capitalize() if name.startswith("I") else name
        if plain not in COUNTED:
            return attr

        def counted(*args, **kwargs):
            at = COUNTED[plain]
            if plain == "Reduce_scatter_block" and args[0] is MPI.IN_PLACE:
                at = 1
            self._log.append((plain, self._comm.Get_size(), nbytes(args[at])))
            return attr(*args, **kwargs)
        return counted


class Spy(Communicator):
    """A ``Communicator`` (nonblocking collectives: each start is one call) whose MPI calls,
    and those of the sub-communicators it splits, are noted in ``log``."""

    def __init__(self, comm, log):
        super().__init__(comm, persistent=False)
        self.log = log
        self._comm = Counting(self._comm, log)
        self.started.use(self._comm)  # the started collectives too

    def split(self, color):
        sub = super().split(color)
        sub._comm = Counting(sub._comm, self.log)
        sub.started.use(sub._comm)
        return sub


def combinations():
    """The engine options of every combination the plan models, with the plan's arguments."""
    groups = [None, 2] if size >= 4 else [None]
    for stage, dtype, reduce, hops, gather, group, micro in itertools.product(
            (1, 2), ("float32", "float16", "bfloat16"), ("float32", "float16", "int8"),
            ("all", "across"), (None, "int8"), groups, (1, 2)):
        if reduce == "float16" and dtype != "float16" or hops == "across" and (
                reduce != "int8" or group is None) or gather and dtype == "float32" or (
                micro == 2 and stage == 1):
            continue
        options = {"param_dtype": dtype, "reduce_dtype": reduce, "compress_hops": hops,
                   "gather_dtype": gather, "shard_group_size": group,
                   "shard_gradients": stage == 2, "bucket_elements": BUCKET}
        planned = plan(PSI, size, 2, group, dtype, stage, reduce, hops, gather,
                       bandwidth="1gbit", micro_batches=micro, bucket_elements=BUCKET)
        yield options, micro, planned


def one_step(options, micro) -> list:
    log = []
    opt = ZeroAdamW({"w": np.linspace(-1, 1, PSI, dtype=np.float32)}, Spy(world, log),
                    lr=1e-3, **options)
    log.clear()  # the construction's broadcast and agreement are not the step's
    grad = np.cos(np.arange(PSI, dtype=np.float32) + rank).astype(opt.param_dtype)
    for _ in range(micro):
        if options["shard_gradients"]:
            opt.add_grad("w", grad)
        else:
            opt.grads["w"][...] += grad
    opt.step()
    opt.wait()
    noted = list(log)
    opt.close()
    return noted


def main():
    cases = 0
    for options, micro, planned in combinations():
        noted = one_step(options, micro)
        got = defaultdict(int)
        for name, ranks, count in noted:
            got[name, ranks] += count
        want = defaultdict(float)
        for row in planned["collectives"]:
            if row["what"].startswith("agreement"):
                continue
            want[row["collective"], row["n"]] += row["buffer_bytes"] * row["times_per_step"]
        agreement = [count for name, ranks, count in noted if (name, ranks) == ("Allreduce", size)
                     and count <= 64]
        what = f"{options}, {micro} micro-batch(es)"
        check(len(agreement) == 1, f"{what}: {len(agreement)} agreements")
        got["Allreduce", size] -= agreement[0]
        got = {k: v for k, v in got.items() if v}
        check(got == dict(want), f"{what}: MPI was handed {dict(got)}, the plan says {dict(want)}")
        cases += 1
    if rank == 0:
        print(f"OK plan bytes on {size} ranks: {cases} combinations, each collective's bytes "
              "as the plan's", flush=True)


if __name__ == "__main__":
    main()
