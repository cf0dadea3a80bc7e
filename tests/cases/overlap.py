"""Overlapped communication gives the same bits as the plain step.

``grads_ready`` during a (simulated) backward pass, in a different order on every rank, and
``step(wait=False)`` with the parameters read later, against an optimizer that only calls
``step()``: parameters must be bitwise equal after every step. Run on any number of ranks.
"""

import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroAdamW
import casekit as kit
from casekit import check

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {f"layer{i}": (37 * (i + 1),) for i in range(8)} | {"scalar": (), "empty": (0,)}


def make(dtype):
    init = {k: np.random.default_rng(len(k)).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}
    return ZeroAdamW(init, comm, lr=1e-2, param_dtype=dtype, bucket_elements=200,
                     max_grad_norm=5.0)


def main():
    for dtype in ("float32", "bfloat16", "float16"):
        plain, overlapped = make(dtype), make(dtype)
        check(len(plain.layout.buckets) > 3)
        for step in range(6):
            rng = np.random.default_rng([step, rank])
            grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
            for k, g in grads.items():
                plain.grads[k][...] = g
            plain.step()
            # "Backward": gradients arrive last layer first, in a rank-dependent order.
            order = list(reversed(SHAPES))
            head = order[:3]
            np.random.default_rng([step, rank, 1]).shuffle(head)
            order[:3] = head
            for k in order:
                overlapped.grads[k][...] = grads[k]
                overlapped.grads_ready([k])
            started = len(kit.pipeline_state(overlapped)[0])
            check(started == len(overlapped.layout.buckets), "not all started in backward")
            overlapped.step(wait=step % 2 == 0)  # odd steps: parameters gathered lazily
            for k in SHAPES:  # reading through opt.params completes the gathers
                a, b = plain.params[k], overlapped.params[k]
                check(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)),
                      (dtype, step, k))
        overlapped.step(wait=False)
        overlapped.wait()
        check(not kit.pipeline_state(overlapped)[1], "gathers left in flight after wait()")
        # zero_grad() in the middle of a round completes and forgets what had started.
        for k in reversed(SHAPES):
            overlapped.grads[k][...] = 1.0
            overlapped.grads_ready([k])
        overlapped.zero_grad()
        check(not kit.pipeline_state(overlapped)[0], "zero_grad() left started buckets")
        check(all(not np.any(g) for g in overlapped.grads.values()))
        for bad, error in (("nope", KeyError), ("layer7", ValueError)):
            try:
                overlapped.grads_ready(["layer7"] if bad == "layer7" else [bad])
                overlapped.grads_ready([bad])
            except error:
                pass
            else:
                raise AssertionError(f"grads_ready({bad!r}) did not raise {error.__name__}")
        overlapped.zero_grad()
    shared_communicator()
    if rank == 0:
        print(f"OK overlap on {size} ranks")


def shared_communicator():
    """Two optimizers on one Communicator: dropping one frees only its persistent requests
    (where this MPI gets persistent collectives), and the other steps on."""
    import gc

    from zero1_mpi import Communicator
    shared = Communicator(comm)
    first, second = (ZeroAdamW({"w": np.ones(1000, np.float32)}, shared, lr=0.1)
                     for _ in range(2))
    for opt in (first, second):
        opt.grads["w"][...] = 1.0
        opt.step()
    held = kit.persistent_requests(shared)
    del first, opt
    gc.collect()
    if shared.persistent:
        left = kit.persistent_requests(shared)
        check(0 < left < held or size == 1, (held, left))
    else:
        check(held == 0, held)
    second.grads["w"][...] = 1.0
    second.step()
    check(np.allclose(second.params["w"], 1 - 0.1 * 0.01 * 2 - 0.1 * 2, atol=1e-3))


if __name__ == "__main__":
    main()
