"""The step watchdog (``step_timeout``): a rank that stops taking part ends the job.

    mpiexec -n N python -m mpi4py tests/cases/watchdog.py MODE [TIMEOUT]

MODE ``reduce``, ``agree``, ``update`` or ``add``: three steps, then on the last rank (only) the
fourth step hangs for ever (in ``time.sleep``): before step() (the others wait in the reduction
of bucket 0), in the sum of squares before the agreement (they wait in the Allreduce), in the
update kernel (they wait in the gather of bucket 0), or, with ``shard_gradients`` and one staging
bucket, before handing any gradient over (they wait in ``add_grad`` for a reduction). Rank 0
prints ``expect bucket B`` and ``hang at T`` (``time.time()``); the watchdog of the waiting
ranks must end the job. ``same``: training with and without a watchdog
gives the same bits (stage 1, stage 2, ``wait=False``) and its thread ends with the optimizer.
``bad``: bad or differing ``step_timeout`` values are raised on every rank. ``slow-save``
(DIR): saves inside a step slower than the timeout (publishing a non-blocking one, a
preemption checkpoint) do not end the job. ``train``: trains
until ended (TIMEOUT ``none``: without a watchdog), each rank printing ``rank R pid P`` first,
rank 0 ``step S at T`` after each step (tests/test_netns.py takes the link down meanwhile).
"""

import gc
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, raises
from zero1_mpi import CollectiveError, ZeroAdamW

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "none" else \
    None if len(sys.argv) > 2 else 4.0
SHAPES = {"a": (40, 50), "b": (3000,), "c": (50, 40), "d": (2500,)}


def params(seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def grads(step):
    rng = np.random.default_rng(1000 * step + rank)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def hang(*_):
    while True:
        time.sleep(3600)


def train(opt, steps, wait=True):
    for step in range(steps):
        given = grads(step)
        if opt.grad_shard_dtype is not None:
            opt.add_grads(dict(reversed(list(given.items()))))
        else:
            for name, g in given.items():
                opt.grads[name][...] = g
        opt.step(wait=wait)
    opt.wait()
    return {name: opt.params[name].copy() for name in SHAPES}


def same():
    for options in ({}, {"shard_gradients": True}, {"shard_gradients": True, "grad_staging": 1}):
        for wait in (True, False):
            plain = ZeroAdamW(params(), lr=1e-2, bucket_elements=2048, **options)
            watched = ZeroAdamW(params(), lr=1e-2, bucket_elements=2048, step_timeout=30,
                                **options)
            check(kit.watchdog_thread(plain) is None and kit.watchdog_thread(watched).is_alive())
            a, b = train(plain, 6, wait), train(watched, 6, wait)
            for name in SHAPES:
                check(a[name].tobytes() == b[name].tobytes(), f"{name} differs with {options}")
            check(not np.array_equal(a["a"], params()["a"]), "training changed nothing")
            thread = kit.watchdog_thread(watched)
            del watched
            gc.collect()
            thread.join(5)
            check(not thread.is_alive(), "the watchdog's thread outlived its optimizer")
    print(f"OK watchdog same bits on {size} ranks", flush=True)


def bad():
    for bad in (0, -1.5, float("nan"), float("inf"), True, "60"):
        mine = bad if rank == size - 1 else 60
        raises(ValueError, f"step_timeout={bad!r} must be a positive, finite number of seconds",
               lambda: ZeroAdamW(params(), step_timeout=mine))
        raises(ValueError, f"[detected on rank {size - 1}",
               lambda: ZeroAdamW(params(), step_timeout=mine))
    raises(CollectiveError, "step_timeout (60.0 on rank 0, 61.0 on rank 1)",
           lambda: ZeroAdamW(params(), step_timeout=60 + min(rank, 1)))
    raises(CollectiveError, "step_timeout (None on rank 0, 60.0 on rank 1)",
           lambda: ZeroAdamW(params(), step_timeout=None if rank == 0 else 60))
    print(f"OK watchdog bad values on {size} ranks", flush=True)


if set(mode.split(",")) <= {"same", "bad"}:  # one or both, in one job
    for each in mode.split(","):
        {"same": same, "bad": bad}[each]()
elif mode == "slow-save":
    # Saves that run inside a step take the file system's time, not a hang: a preemption
    # checkpoint and the publication of a non-blocking save, each slowed past the timeout.
    import signal

    import zero1_mpi.persistence.checkpoint as checkpoint
    opt = ZeroAdamW(params(), lr=1e-2, bucket_elements=2048, step_timeout=timeout)
    publish = checkpoint.publish

    def slow_publish(*args):
        time.sleep(2.5 * timeout)
        return publish(*args)
    checkpoint.publish = slow_publish
    pending = opt.save(sys.argv[3], blocking=False)
    while not comm.allreduce(pending.written, op=MPI.LAND):
        time.sleep(0.01)
    train(opt, 1)  # publishes, slowly
    check(pending.done and pending.error is None, pending.error)
    opt.checkpoint_on_signal(sys.argv[3], signals=("SIGUSR1",))
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    for name, g in grads(1).items():
        opt.grads[name][...] = g
    info = opt.step()  # saves, slowly
    check(info.stop and info.checkpoint is not None, info)
    print(f"OK slow saves inside steps outlived step_timeout={timeout:g} on {size} ranks",
          flush=True)
elif mode == "train":
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    opt = ZeroAdamW({"w": np.ones(2_000_000, np.float32)}, lr=1e-3, bucket_elements=250_000,
                    step_timeout=timeout)
    gradient = np.full(2_000_000, 1e-3, np.float32)
    for step in range(1, 1_000_000):
        opt.grads["w"][...] = gradient
        opt.step()
        if rank == 0:
            print(f"step {step} at {time.time():.3f}", flush=True)
else:
    stage2 = mode == "add"
    opt = ZeroAdamW(params(), lr=1e-2, bucket_elements=2048, step_timeout=timeout,
                    **({"shard_gradients": True, "grad_staging": 1} if stage2 else {}))
    train(opt, 3)
    comm.Barrier()
    if rank == 0:
        # Stage 2 with one staging bucket: "d", handed over first, fills the first bucket it
        # touches (taking the slot) and then needs the slot for the next: the first bucket's
        # reduction starts as it is, and waits.
        start = next(t.offset for t in opt.layout.tensors if t.name == "d")
        first = next(b.index for b in opt.layout.buckets if b.offset <= start < b.offset + b.size)
        expect = {"reduce": 0, "update": 0, "add": first}.get(mode)
        print(f"expect bucket {expect} of {len(opt.layout.buckets)}", flush=True)
        print(f"hang at {time.time():.3f}", flush=True)
    if rank == size - 1:
        if mode in ("reduce", "add"):
            hang()
        elif mode == "agree":
            kit.fail_in(opt, "agree", hang)
        elif mode == "update":
            kit.fail_in(opt, "update", hang)
    train(opt, 1)
    print(f"UNREACHABLE: step 4 returned on rank {rank}", flush=True)
