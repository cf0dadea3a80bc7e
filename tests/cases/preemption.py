"""checkpoint_on_signal: a signal on one rank becomes a checkpoint on all and a clean exit.

    mpiexec -n N python -m mpi4py tests/cases/preemption.py train DIR STEPS [--signal-at K]
    mpiexec -n N python -m mpi4py tests/cases/preemption.py train DIR STEPS --resume
    mpiexec -n N python -m mpi4py tests/cases/preemption.py overflow[,errors] DIR
    mpiexec -n N python -m mpi4py tests/cases/preemption.py launcher DIR SIGNAL

``train`` runs STEPS steps of a small model with deterministic gradients (a function of the
parameters, the step and the rank), printing ``LOSS <step> <hex>`` (rank 0) and at the end
``PARAMS <sha256>``; with ``--signal-at K`` the last rank sends itself SIGTERM before step K,
and every rank must stop after that step with a checkpoint of step K + 1 (``STOP`` lines);
``--resume`` goes on from DIR's checkpoint. ``overflow``: the signalled step overflows, is
skipped, and still checkpoints and stops. ``errors``: bad arguments raise on every rank, the
handlers are restored, and an armed step makes no more communicator calls than a plain one.
``launcher``: trains slowly (DIR/ready once it has begun) until a SIGNAL sent to the launcher
stops it (``STOPPED`` lines, and DIR/stopped-<rank>).
"""

import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from casekit import check, raises
from zero1_mpi import CollectiveError, Communicator, LossScaler, ZeroAdamW
from zero1_mpi.persistence.manifest import read_manifest, resolve

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (37, 5), "b": (11,), "v": (300,)}


def make(**options):
    init = {k: np.random.default_rng([3, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}
    return ZeroAdamW(init, comm, lr=3e-2, weight_decay=0.01, bucket_elements=128, **options)


def targets(r):
    return {k: np.random.default_rng([7, r, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


TARGETS = targets(rank)


def loss_and_grads(opt, step):
    """0.5 |p - target_rank|^2 plus a step-dependent linear term: gradients that depend on
    the parameters, so a resumed run matches only if it resumed the exact state."""
    rng = np.random.default_rng([11, step, rank])
    loss, grads = 0.0, {}
    for k in SHAPES:
        p = np.asarray(opt.params[k], np.float32)
        diff = p - TARGETS[k]
        noise = rng.standard_normal(p.shape).astype(np.float32)
        loss += 0.5 * float(np.sum(diff.astype(np.float64) ** 2))
        grads[k] = diff + 0.1 * noise
    return comm.allreduce(loss) / size, grads


def wait_for_handler(handle, count):
    """The signal was sent to this process: wait (bounded) until its handler has run."""
    deadline = time.monotonic() + 30
    while len(handle.received) < count:
        check(time.monotonic() < deadline, "the signal handler did not run in 30 s")
        time.sleep(0.001)


def params_digest(opt):
    digest = hashlib.sha256()
    for k in SHAPES:
        digest.update(np.ascontiguousarray(opt.params[k]).tobytes())
    return digest.hexdigest()


def train(root: Path, steps: int, signal_at=None, resume=False):
    opt = make()
    ckpt = root / "ckpt"
    start = 0
    if resume:
        opt.load(ckpt)
        start = opt.step_count
        if rank == 0:
            print(f"RESUMED at {start}", flush=True)
    with opt.checkpoint_on_signal(ckpt, keep=2) as handle:
        check(handle.active and handle.signals == (signal.SIGTERM,), repr(handle))
        for step in range(start, steps):
            if step == signal_at and rank == size - 1:
                os.kill(os.getpid(), signal.SIGTERM)   # the scheduler's warning, to one rank
                wait_for_handler(handle, 1)
            loss, grads = loss_and_grads(opt, step)
            for k, g in grads.items():
                opt.grads[k][...] = g
            info = opt.step()
            if rank == 0:
                print(f"LOSS {step} {loss.hex()}", flush=True)
            stops = comm.allgather(info.stop)
            check(stops == [info.stop] * size, f"step {step}: stop differs: {stops}")
            if info.stop:
                names = comm.allgather(info.checkpoint.name)
                check(names == [names[0]] * size, f"checkpoint names differ: {names}")
                check(info.checkpoint.parent == ckpt and info.step == opt.step_count,
                      f"{info}")
                check(resolve(ckpt)[0] == info.checkpoint, f"LATEST is not {info.checkpoint}")
                stop = (f"STOP rank={rank} after_step={step} step_count={info.step} "
                        f"checkpoint={info.checkpoint.name}")
                if rank == 0:  # one writer: launchers may interleave the ranks' lines
                    print("\n".join(comm.gather(stop)), flush=True)
                else:
                    comm.gather(stop)
                break
    check(not handle.active and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          f"the handler was not restored: {signal.getsignal(signal.SIGTERM)}")
    if rank == 0:
        print(f"PARAMS {opt.step_count} {params_digest(opt)}", flush=True)


def overflow(root: Path):
    opt = make(param_dtype="float16", loss_scale=LossScaler.dynamic_scaler(init_scale=16.0))
    ckpt = root / "ckpt"
    handle = opt.checkpoint_on_signal(ckpt, signals=("USR1",))
    for step in range(4):
        _, grads = loss_and_grads(opt, step)
        if step == 2:
            if rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
                wait_for_handler(handle, 1)
            if rank == size - 1:
                grads["b"][3] = np.inf            # overflow on one rank: skipped everywhere
        for k, g in grads.items():
            opt.grads[k][...] = g * opt.loss_scale
        info = opt.step()
        check(info.skipped == (step == 2) and info.stop == (step == 2), f"step {step}: {info}")
        if info.stop:
            break
    handle.close()
    check(info.step == 2 and opt.step_count == 2, f"{info}")
    manifest = read_manifest(info.checkpoint)
    check(manifest["step"] == 2, f"saved at step {manifest['step']}")
    again = make(param_dtype="float16", loss_scale=LossScaler.dynamic_scaler(init_scale=16.0))
    again.load(ckpt)
    check(again.step_count == 2 and again.loss_scale == opt.loss_scale == 8.0,
          f"step {again.step_count}, scale {again.loss_scale} (saved {opt.loss_scale})")
    for k in SHAPES:
        check(np.array_equal(again.params[k], opt.params[k]), k)
    if rank == 0:
        print(f"OK overflow: skipped, checkpointed and stopped on {size} ranks", flush=True)


def count_calls(opt):
    """Wrap every public method of ``opt.comm`` to count calls: ``(counts, restore)``."""
    counts = {}
    names = [n for n in dir(Communicator) if not n.startswith("_")
             and callable(getattr(Communicator, n))]
    for name in names:
        original = getattr(opt.comm, name)

        def counted(*a, _name=name, _original=original, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*a, **k)
        setattr(opt.comm, name, counted)
    return counts, lambda: [opt.comm.__dict__.pop(n, None) for n in names]


def one_step(opt, step):
    _, grads = loss_and_grads(opt, step)
    for k, g in grads.items():
        opt.grads[k][...] = g
    return opt.step()


def errors(root: Path):
    opt = make()
    ckpt = root / "ckpt"
    bad = [
        ({"signals": 12345}, "12345 is not a signal"),
        ({"signals": ("SIGTERM", "SIGFOO")}, "'SIGFOO' is not a signal"),
        ({"signals": signal.SIGKILL}, "SIGKILL cannot be caught"),
        ({"signals": ()}, "at least one signal"),
        ({"keep": 0}, "keep=0 must be None"),
        ({"keep": True}, "keep=True must be None"),
    ]
    for kwargs, text in bad:
        raises(ValueError, text, lambda: opt.checkpoint_on_signal(ckpt, **kwargs))
        # the same mistake on one rank only: still raised on every rank
        mine = kwargs if rank == size - 1 else {}
        raises(ValueError, text, lambda: opt.checkpoint_on_signal(ckpt, **mine))
        check(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, f"{kwargs}: installed")
    raises(ValueError, "path=12: pass the checkpoint directory",
           lambda: opt.checkpoint_on_signal(12))
    raises(ValueError, "keep=2 with path=None", lambda: opt.checkpoint_on_signal(None, keep=2))
    if size > 1:
        raises(CollectiveError, "path (", lambda: opt.checkpoint_on_signal(root / f"r{rank}"))

    def from_thread(result):
        try:
            opt.checkpoint_on_signal(ckpt)
        except Exception as exc:  # noqa: BLE001 - checked below
            result.append(exc)

    if rank == size - 1:  # only this rank calls from another thread; all must raise
        result = []
        thread = threading.Thread(target=from_thread, args=(result,), name="loader")
        thread.start()
        thread.join()
        check(len(result) == 1, f"no error from a thread: {result}")
        check("from thread 'loader'" in str(result[0]), str(result[0]))
    else:
        raises(ValueError, "from thread 'loader'", lambda: opt.checkpoint_on_signal(ckpt))

    # Handlers: the previous ones come back, also after a second arming.
    def previous(signum, frame):
        raise AssertionError("the previous handler ran")

    signal.signal(signal.SIGUSR2, previous)
    with opt.checkpoint_on_signal(ckpt, signals=(signal.SIGUSR2, "SIGTERM")) as handle:
        check(signal.getsignal(signal.SIGUSR2) == handle._handle, "not installed")
        raises(ValueError, "already active", lambda: opt.checkpoint_on_signal(ckpt))
    check(signal.getsignal(signal.SIGUSR2) is previous, "SIGUSR2's handler was not restored")
    check(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "SIGTERM's was not restored")
    handle.close()  # idempotent
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)

    # No collective added per step: an armed step calls the communicator as a plain one does.
    counts, restore = count_calls(opt)
    one_step(opt, 0)
    plain = dict(counts)
    with opt.checkpoint_on_signal(ckpt):
        counts.clear()
        info = one_step(opt, 1)
        armed = dict(counts)
    restore()
    check(not info.stop and plain == armed and plain.get("allreduce_sum", 0) == (size > 1),
          f"a plain step called {plain}, an armed one {armed}")
    check(not ckpt.exists(), "a checkpoint was written without a signal")

    # path=None: a signal to one rank stops every rank at the same step, which saves nothing.
    with opt.checkpoint_on_signal(None, signals="SIGUSR1") as handle:
        for step in range(2, 5):
            if step == 3 and rank == size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)
                wait_for_handler(handle, 1)
            info = one_step(opt, step)
            check(info.stop == (step == 3) and info.checkpoint is None, f"step {step}: {info}")
            if info.stop:
                break
    check(info.step == opt.step_count == 4 and not ckpt.exists(), f"{info}")
    if rank == 0:
        print(f"OK preemption errors on {size} ranks", flush=True)


def launcher(root: Path, name: str):
    """Train slowly (at most ~10 minutes) until a signal stops the run."""
    opt = make()
    sig = signal.Signals[name]
    handle = opt.checkpoint_on_signal(root / "ckpt", signals=sig)
    for step in range(30000):
        info = one_step(opt, step)
        if step == 2 and rank == 0:
            (root / "ready").write_text(str(os.getpid()))
        if info.stop:
            line = (f"STOPPED rank={rank} step={info.step} received="
                    f"{[s.name for s in handle.received]} checkpoint={info.checkpoint.name}")
            (root / f"stopped-{rank}").write_text(line)
            print(line, flush=True)
            break
        time.sleep(0.02)
    else:
        raise AssertionError("no signal reached any rank")
    handle.close()


mode, root = sys.argv[1], Path(sys.argv[2])
if mode == "train":
    rest = sys.argv[4:]
    at = int(rest[rest.index("--signal-at") + 1]) if "--signal-at" in rest else None
    train(root, int(sys.argv[3]), signal_at=at, resume="--resume" in rest)
elif set(mode.split(",")) <= {"overflow", "errors"}:  # one or both, in one job
    for each in mode.split(","):
        {"overflow": overflow, "errors": errors}[each](root / each)
elif mode == "launcher":
    launcher(root, sys.argv[3])
else:
    raise SystemExit(f"unknown mode {mode!r}")
