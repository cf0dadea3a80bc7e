"""mpiexec -n 4 python -m mpi4py examples/jax_mlp.py

A JAX model trained by zero1_mpi: the loss and its gradients come from a jit-compiled
``jax.value_and_grad``, the optimizer is ZeRO stage 1 AdamW over MPI (clipping at global norm
1), and the parameters are bfloat16 by default. The task, the initial values and the batches
are those of ``examples/train_mlp.py`` (a 64 -> 256 -> 256 -> 10 tanh MLP learning the labels
of a fixed random teacher; every rank takes its own slice of each step's global batch), so the
two print the same losses (in float32 to the digits printed; in bfloat16 a gradient sometimes
rounds the other way): the loss falls from ln(10) = 2.30 to about 0.6 in 200 steps.

    mpiexec -n 4 python -m mpi4py examples/jax_mlp.py --dtype float32
    mpiexec -n 4 python -m mpi4py examples/jax_mlp.py --plot loss.png   # needs matplotlib

Needs ``pip install ".[jax]"`` (the CPU ``jax`` wheel). JAX runs on the CPU
(``JAX_PLATFORMS=cpu`` unless set), one thread per rank (``XLA_FLAGS`` unless set).

``zero1_mpi.jax.ZeroOptimizer`` binds the two: ``opt.params()`` gives the parameters as a
pytree of JAX arrays on the optimizer's flat buffer (no copy where 64-byte aligned, which here
all six are), ``opt.step(grads)`` takes the gradient pytree (one copy, into the flat buffer).
Its docstring holds the measured facts and the three aliasing rules this loop follows: the
parameters go to the jit-compiled function as an argument, fresh after every step.

Rank 0 prints the loss every ``--log-every`` steps, the zero-copy record of every rank
(``zero-copy: {json}``), all the losses (``losses: [...]``, JSON) and last
``final: first_loss=... last_loss=...`` (mean of the last 10 steps), for scripts.
"""

import argparse
import itertools
import json
import os

# One thread per rank unless the user chose otherwise (N ranks each with an all-core pool
# oversubscribe the CPU); JAX on the CPU, where zero1_mpi's NumPy buffers are.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # (after the thread settings)
from mpi4py import MPI

from zero1_mpi.progress import Progress

try:
    import jax
    import jax.numpy as jnp

    from zero1_mpi.jax import ZeroOptimizer
except ImportError as exc:  # every rank fails the same way, so the job ends
    raise SystemExit(f"examples/jax_mlp.py needs JAX: pip install '.[jax]' ({exc})") from None

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--batch", type=int, default=256,
                    help="examples per step, over all ranks (each takes batch/N of them)")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--log-every", type=int, default=20)
parser.add_argument("--plot", metavar="FILE.png",
                    help="write the loss curve to this PNG at the end (needs matplotlib)")
args = parser.parse_args()
if args.steps < 1 or args.log_every < 1 or args.batch < 1:
    parser.error("--steps, --log-every and --batch must be >= 1")

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if args.batch % size:
    parser.error(f"--batch {args.batch} is not divisible by the {size} ranks: pass a multiple")
per_rank = args.batch // size


def print0(*a, **k):
    if rank == 0:
        print(*a, **k, flush=True)


# -- the task of examples/train_mlp.py: the same numbers from the same seeds --------------------
D_IN, D_OUT = 64, 10
sizes = [D_IN, args.hidden, args.hidden, D_OUT]


def init_mlp(rng, sizes):
    """{"w1", "b1", ...} with N(0, 1/fan_in) weights and zero biases, float32 on the host."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), start=1):
        params[f"w{i}"] = rng.standard_normal((fan_in, fan_out), np.float32) / np.sqrt(fan_in)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


teacher = init_mlp(np.random.default_rng([args.seed, 999]), [D_IN, 64, D_OUT])


def get_batch(step):
    """This rank's slice of the global batch of ``step``: the same examples at any world size."""
    rng = np.random.default_rng([args.seed, step])
    x = rng.standard_normal((args.batch, D_IN), np.float32)[rank * per_rank:(rank + 1) * per_rank]
    y = (np.tanh(x @ teacher["w1"]) @ teacher["w2"]).argmax(axis=1)
    return x, y


# -- the model, in JAX -----------------------------------------------------------------------
def loss_fn(params, x, y):
    """Mean softmax cross-entropy of the 3-layer tanh MLP; the math runs in float32."""
    p = {k: v.astype(jnp.float32) for k, v in params.items()}
    h1 = jnp.tanh(x @ p["w1"] + p["b1"])
    h2 = jnp.tanh(h1 @ p["w2"] + p["b2"])
    logprob = jax.nn.log_softmax(h2 @ p["w3"] + p["b3"])
    return -jnp.take_along_axis(logprob, y[:, None], axis=1).mean()


loss_and_grads = jax.jit(jax.value_and_grad(loss_fn))  # gradients in the parameter dtype


# -- training ----------------------------------------------------------------------------------
init = init_mlp(np.random.default_rng(args.seed), sizes)
init["w3"][...] = 0                      # zero output layer: the first loss is exactly ln(10)
opt = ZeroOptimizer(init, "adamw", comm, lr=args.lr, weight_decay=1e-2, param_dtype=args.dtype,
                    max_grad_norm=1.0)
print0(f"jax_mlp: world_size={size} psi={opt.sharded.layout.numel} "
       f"dtype={opt.sharded.param_dtype.name} jax={jax.__version__} "
       f"device={jax.devices()[0].platform} "
       f"mlp={'-'.join(map(str, sizes))} batch={args.batch} ({per_rank} per rank) "
       f"steps={args.steps} lr={args.lr}")

losses = []
# Rank 0: step, loss, ms/step, examples/s and ETA every --log-every steps (a tqdm bar where
# tqdm is installed and stdout is a terminal).
progress = Progress(args.steps, rank, tokens_per_step=args.batch, unit="examples",
                    every=args.log_every)
for step in range(args.steps):
    x, y = get_batch(step)
    loss, grads = loss_and_grads(opt.params(), x, y)   # fresh views of the parameters
    opt.step(grads)                                    # average over ranks, AdamW, all-gather
    losses.append(comm.allreduce(float(loss)) / size)  # mean over ranks, for the log
    progress.update(step, losses[-1])
progress.close()

# What the transfers did, by tensor, over all steps (``ZeroOptimizer.zero_copy``).
done = opt.zero_copy()
record = {"aligned": sorted(done["aligned"]), "params_zero_copy": sorted(done["params"]),
          "grads_zero_copy": sorted(done["grads"]),
          "flat_buffer_address_mod_64": min(v.ctypes.data for v in opt.sharded.params.values())
          % 64}
records = comm.gather(record)
if rank == 0:
    for r, rec in enumerate(records):
        print(f"rank {r}: parameters to JAX without a copy: {len(rec['params_zero_copy'])}/"
              f"{len(opt.names)} tensors ({len(rec['aligned'])} 64-byte aligned); gradients "
              f"viewed from JAX without a copy: {len(rec['grads_zero_copy'])}/{len(opt.names)}; "
              f"one copy each into opt.grads", flush=True)
    print(f"zero-copy: {json.dumps(records)}", flush=True)
tail = losses[-min(10, len(losses)):]
print0(f"loss {losses[0]:.2f} -> {sum(tail) / len(tail):.2f} (mean of the last {len(tail)} steps)")
if args.plot and rank == 0:
    from plotting import save_plot  # examples/plotting.py
    save_plot(args.plot, f"jax_mlp: {size} ranks, {args.dtype}", [("loss", losses)])
print0(f"losses: {json.dumps(losses)}")
print0(f"final: first_loss={losses[0]:.6f} last_loss={sum(tail) / len(tail):.6f}")
