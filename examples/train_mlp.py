"""mpiexec -n 4 python -m mpi4py examples/train_mlp.py

Data-parallel training of a small MLP (64 -> 256 -> 256 -> 10, tanh) with ZeRO stage 1: every
rank holds the parameters and gradients, but the fp32 master weights and Adam moments of only
1/N of them. Forward and backward are written out by hand, so the only library in the loop is
the optimizer. Each step draws a global batch of ``--batch`` examples and every rank takes its
own slice of it, so any number of ranks that divides the batch trains the same model (up to
the order of the sums over ranks); labels come from a fixed random "teacher" network, so the
loss falls from ln(10) = 2.30 (the output layer starts at zero) to about 0.6 in 200 steps.

    mpiexec -n 4 python -m mpi4py examples/train_mlp.py --dtype bfloat16  # or float16
    mpiexec -n 4 python -m mpi4py examples/train_mlp.py --stage 3         # parameters sharded
    mpiexec -n 4 python -m mpi4py examples/train_mlp.py --backend cupy    # one GPU per rank
    sbatch examples/slurm.sbatch                                          # Slurm + srun
    mpiexec -n 4 python -m mpi4py examples/train_mlp.py --plot loss.png   # needs matplotlib

With ``--checkpoint DIR`` it saves a sharded checkpoint every ``--save-every`` steps and at the
end, and starts from the newest checkpoint in ``DIR`` when there is one, on any number of ranks:
kill a run (``--crash-at-step K`` makes the last rank SIGKILL itself at step K, to try it) and
launch it again, with the same or another ``-n``, and it goes on where the checkpoint was.
With ``--checkpoint``, SIGTERM or SIGUSR1 on any rank (Slurm's warning before it kills a job)
saves a checkpoint after the current step and ends the run cleanly (``checkpoint_on_signal``).

``python -m mpi4py`` aborts the whole job when one rank raises (otherwise MPICH hangs). With
``--dtype float16/bfloat16`` the parameters and gradients are 16-bit: the math below runs in
float32 on an fp32 copy of the params and the grads are rounded into ``opt.grads``.
``--stage 2`` shards the gradients too, ``--stage 3`` the parameters as well (docs/stage3.md):
each layer is a unit, read inside ``with opt.gathered("layer2") as p:`` and its gradients handed
over with ``add_grad`` in its backward block; all three stages give the same losses.
The last line, ``final: first_loss=... last_loss=...``, is meant to be checked by a script.
Progress (``zero1_mpi.progress``): a tqdm bar when tqdm is installed and stdout is a terminal,
else a line every ``--log-every`` steps (always under mpiexec; ``ZERO1_PROGRESS=plain`` forces it).
"""

import argparse
import os
import signal
from pathlib import Path

# One BLAS thread per rank unless the user chose otherwise: N ranks each starting a pool of
# all-core BLAS threads oversubscribe the CPU (100x slower steps on a 2-core machine).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402 (after the thread settings)
from mpi4py import MPI  # noqa: E402

from zero1_mpi import ZeroAdamW  # noqa: E402
from zero1_mpi.progress import Progress  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--batch", type=int, default=256,
                    help="examples per step, over all ranks (each takes batch/N of them)")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3],
                    help="ZeRO stage: 1 (state sharded), 2 (gradients too), 3 (parameters too)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--log-every", type=int, default=20)
parser.add_argument("--checkpoint", help="directory to save checkpoints in and resume from")
parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
parser.add_argument("--plot", metavar="FILE.png",
                    help="write the loss curve to this PNG at the end (needs matplotlib)")
parser.add_argument("--crash-at-step", type=int,
                    help="the last rank kills itself (SIGKILL) at this step: try resuming")
args = parser.parse_args()
if args.steps < 1 or args.log_every < 1 or args.batch < 1 or args.save_every < 1:
    parser.error("--steps, --log-every, --batch and --save-every must be >= 1")

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if args.batch % size:
    parser.error(f"--batch {args.batch} is not divisible by the {size} ranks: pass a multiple")
per_rank = args.batch // size


def print0(*a, **k):
    if rank == 0:
        print(*a, **k, flush=True)


# Under srun, an MPI built for another PMI starts N singletons that each believe they are rank 0
# of 1 and train alone; catch that before any work (every rank raises, so the job ends).
ntasks = os.environ.get("SLURM_NTASKS")
if ntasks and ntasks.isdigit() and int(ntasks) != size:
    raise RuntimeError(f"SLURM_NTASKS={ntasks} but MPI.COMM_WORLD.size={size}: srun and the MPI "
                       "library's PMI do not match; launch with `srun --mpi=pmix` (or "
                       "`--mpi=pmi2`), or with the MPI's own mpiexec (unset SLURM_NTASKS when "
                       "running mpiexec with a different count inside an allocation)")

if args.backend == "cupy":
    import cupy as xp

    from zero1_mpi.kernels.backend import use_device
    # A GPU per rank by node-local rank (round-robin where ranks outnumber GPUs), before
    # anything touches a device.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    use_device(node.Get_rank())
    node.Free()
else:
    xp = np

D_IN, D_OUT = 64, 10
sizes = [D_IN, args.hidden, args.hidden, D_OUT]


def init_mlp(rng, sizes):
    """{"w1", "b1", ...} with N(0, 1/fan_in) weights and zero biases, float32 on the host."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        params[f"w{i}"] = rng.standard_normal((fan_in, fan_out), np.float32) / np.sqrt(fan_in)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def f32(array):
    return array.astype(xp.float32, copy=False)


def forward_backward(x, y, hand):
    """Mean softmax cross-entropy of the 3-layer tanh MLP on (x, y); each layer's parameters
    read inside its unit's block (``opt.gathered``), its gradients handed to ``hand(name, g)``
    in the backward's block of the layer."""
    acts = [x]
    for i in (1, 2, 3):
        with opt.gathered(f"layer{i}") as p:
            z = acts[-1] @ f32(p[f"w{i}"]) + f32(p[f"b{i}"])
        acts.append(xp.tanh(z) if i < 3 else z)
    logits = acts[-1]
    logits -= logits.max(axis=1, keepdims=True)                        # stable softmax
    logprob = logits - xp.log(xp.exp(logits).sum(axis=1, keepdims=True))
    rows = xp.arange(len(y))
    loss = -logprob[rows, y].mean()
    dz = xp.exp(logprob)                                               # softmax - onehot, / B
    dz[rows, y] -= 1
    dz /= len(y)
    for i in (3, 2, 1):
        with opt.gathered(f"layer{i}") as p:
            hand(f"w{i}", acts[i - 1].T @ dz)
            hand(f"b{i}", dz.sum(axis=0))
            if i > 1:                                                  # tanh' = 1 - tanh^2
                dz = (dz @ f32(p[f"w{i}"]).T) * (1 - acts[i - 1] * acts[i - 1])
    return loss


# The teacher: a fixed random 64 -> 64 -> 10 tanh net, the same on every rank; labels = argmax.
teacher = {k: xp.asarray(v) for k, v in init_mlp(np.random.default_rng([args.seed, 999]),
                                                 [D_IN, 64, D_OUT]).items()}


def get_batch(step):
    """This rank's slice of the global batch of ``step``: the same examples at any world size."""
    rng = np.random.default_rng([args.seed, step])
    x = rng.standard_normal((args.batch, D_IN), np.float32)[rank * per_rank:(rank + 1) * per_rank]
    x = xp.asarray(x)
    y = (xp.tanh(x @ teacher["w1"]) @ teacher["w2"]).argmax(axis=1)
    return x, y


# Every rank may pass its own init: rank 0's values are broadcast to all.
init = init_mlp(np.random.default_rng(args.seed), sizes)
init["w3"][...] = 0                      # zero output layer: the first loss is exactly ln(10)
init = {k: xp.asarray(v) for k, v in init.items()}
# fp16 needs loss scaling (small gradients underflow in 16 bits); clip the global norm at 1.
# Each layer a unit (gathered together in stage 3); stage 2 hands the gradients over instead
# of writing opt.grads, stage 3 too.
units = {f"layer{i}": [f"w{i}", f"b{i}"] for i in range(1, len(sizes))}
stages = {1: {}, 2: {"shard_gradients": True}, 3: {"shard_params": True}}
opt = ZeroAdamW(init, comm, lr=args.lr, weight_decay=1e-2, param_dtype=args.dtype,
                loss_scale="dynamic" if args.dtype == "float16" else None, max_grad_norm=1.0,
                units=units, **stages[args.stage])
psi = opt.layout.numel
collectives = "persistent" if opt.comm.persistent else "nonblocking"
print0(f"train_mlp: world_size={size} stage={args.stage} psi={psi} dtype={opt.param_dtype.name} "
       f"backend={opt.backend} kernels={opt.kernel} mlp={'-'.join(map(str, sizes))} batch={args.batch} "
       f"({per_rank} per rank) steps={args.steps} lr={args.lr} "
       f"collectives={collectives} ({opt.comm.persistent_source})")
start = 0
if args.checkpoint and (Path(args.checkpoint) / "LATEST").exists():
    loaded = opt.load(args.checkpoint)  # saved at any world size
    # The data of step k is drawn from k, so the run goes on with the batches it would have had.
    # (step_count does not count steps that fp16 loss scaling skipped: those batches repeat.)
    start = opt.step_count
    print0(f"resumed from {loaded} at step {start}")
    if start >= args.steps:
        parser.error(f"the checkpoint in {args.checkpoint} is at step {start}: nothing is left "
                     f"to train with --steps {args.steps} (raise it)")


def sync():
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


losses, skipped = [], 0
# On rank 0: step, loss, ms/step, examples/s and the ETA, at the first step, every --log-every
# steps and the last (a tqdm bar instead in a terminal).
progress = Progress(args.steps, rank, start=start, tokens_per_step=args.batch, unit="examples",
                    every=args.log_every)
if args.checkpoint:  # the scheduler's warning: a checkpoint at the next step, then stop
    on_signal = opt.checkpoint_on_signal(args.checkpoint, (signal.SIGTERM, signal.SIGUSR1), 2)
for step in range(start, args.steps):
    if step == args.crash_at_step and rank == size - 1:
        print(f"crash: rank {rank} kills itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = get_batch(step)
    opt.zero_grad()
    # d(loss * scale) = scale * d(loss): scaling here is scaling the loss before backward
    if args.stage == 1:
        def hand(name, g):
            opt.grads[name][...] = g * opt.loss_scale  # rounds to the 16-bit grad dtype
    else:
        def hand(name, g):
            opt.add_grad(name, g * opt.loss_scale)     # reduced as its layer's bucket fills
    loss = forward_backward(x, y, hand)
    info = opt.step()                            # average grads, sharded AdamW, all-gather
    skipped += info.skipped                      # overflowed fp16 steps (the scale backs off)
    losses.append(comm.allreduce(float(loss)) / size)   # mean over ranks, for the log
    if info.stop:                                # a signal reached a rank: checkpoint saved
        print0(f"stopped by a signal after step {step + 1}: saved {info.checkpoint}")
        break
    if args.checkpoint and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
        opt.save(args.checkpoint, keep=2)
    sync()                                       # the step's time is the device's too
    progress.update(step, losses[-1])
progress.close()

report = opt.memory_report()
most = comm.reduce(report.total, op=MPI.MAX)     # on rank 0; None elsewhere
print0(f"memory: {most} bytes/rank held (max over ranks); formula "
       f"{report.formula_label} = {report.formula_bytes:.0f}; the difference is padding + comm "
       "scratch")
tail = losses[-min(10, len(losses)):]
print0(f"loss {losses[0]:.2f} -> {sum(tail) / len(tail):.2f} (mean of the last {len(tail)} steps)")
print0(f"loss scale {opt.loss_scale:g}, {skipped} overflowed step(s) skipped")
if args.plot and rank == 0:
    from plotting import save_plot  # examples/plotting.py
    save_plot(args.plot, f"train_mlp: {size} ranks, {args.dtype}", [("loss", losses)], start)
print0(f"final: first_loss={losses[0]:.6f} last_loss={sum(tail) / len(tail):.6f}")
