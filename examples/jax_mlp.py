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

Moving arrays between zero1_mpi and JAX, each step (measured with JAX 0.10 on the CPU by
comparing ``unsafe_buffer_pointer()`` with ``.ctypes.data``; the ``rank r:`` lines at the end
report what happened on every rank):

- Parameters, NumPy -> JAX: ``jnp.from_dlpack(opt.params[name])`` is a zero-copy view of the
  optimizer's flat buffer when the tensor starts at a multiple of 64 bytes, the alignment of
  XLA:CPU's buffers. Otherwise JAX copies it (``copy=False`` raises "not aligned to 64 bytes";
  JAX 0.5 also warns on every call, JAX 0.4.30 aliased any address), so ``to_jax`` below makes
  that copy itself. ``jax.device_put`` follows the same rule; ``jnp.asarray`` always copies.
  NumPy's DLPack export has no bfloat16 ("DLPack only supports signed/unsigned integers,
  float and complex dtypes"), so bfloat16 tensors travel as their uint16 bits and become
  bfloat16 again inside the jit-compiled function (``lax.bitcast_convert_type``: free there,
  a copy outside jit).
- Which tensors are 64-byte aligned depends on where they start: zero1_mpi allocates its flat
  host buffers on a 64-byte boundary and packs the tensors back to back, so a tensor is
  aligned when the elements before it fill whole 64 bytes. Every tensor of this MLP starts at
  a multiple of 32 elements (with ``--hidden`` a multiple of 32), so all six are views; in
  another model a tensor after, say, a bias of 10 elements would be copied.
- Gradients, JAX -> NumPy: ``np.asarray(grad)`` is a zero-copy, read-only view of the JAX
  buffer (``np.from_dlpack`` too, but not for bfloat16: "Unsupported dtype in DLTensor").
  Writing it into ``opt.grads[name]`` is the one copy that every step makes: XLA writes its
  outputs to buffers it allocates, and donating an input to receive them (``donate_argnums``)
  reuses only buffers JAX owns, never one that aliases NumPy memory (the output lands
  elsewhere).

Aliasing is safe only with care, because JAX assumes arrays never change and ``opt.step()``
rewrites the flat parameter buffer in place: (1) JAX dispatches asynchronously, so a
computation that reads the views may still be running when Python goes on; wait for its
results (``jax.block_until_ready``) before ``opt.step()`` (measured: mutating the NumPy buffer
right after dispatch changes the result); (2) take fresh views after every step and drop the
old ones (an old view shows the new values, unlike any other JAX array); (3) pass the views as
arguments of the jit-compiled function, never close over them (a captured array is a
compile-time constant: it would keep its first values).

Rank 0 prints the loss every ``--log-every`` steps, the zero-copy record of every rank
(``zero-copy: {json}``), all the losses (``losses: [...]``, JSON) and last
``final: first_loss=... last_loss=...`` (mean of the last 10 steps), for scripts.
"""

import argparse
import json
import os
import time

# One thread per rank unless the user chose otherwise (N ranks each with an all-core pool
# oversubscribe the CPU); JAX on the CPU, where zero1_mpi's NumPy buffers are.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ml_dtypes  # noqa: E402 (after the thread settings)
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # every rank fails the same way, so the job ends
    raise SystemExit(f"examples/jax_mlp.py needs JAX: pip install '.[jax]' ({exc})") from None

from zero1_mpi import ZeroAdamW  # noqa: E402

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
BF16 = np.dtype(ml_dtypes.bfloat16)
ALIGN = 64  # bytes: XLA:CPU aliases host memory only at this alignment


def print0(*a, **k):
    if rank == 0:
        print(*a, **k, flush=True)


# -- the task of examples/train_mlp.py: the same numbers from the same seeds --------------------
D_IN, D_OUT = 64, 10
sizes = [D_IN, args.hidden, args.hidden, D_OUT]


def init_mlp(rng, sizes):
    """{"w1", "b1", ...} with N(0, 1/fan_in) weights and zero biases, float32 on the host."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
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


@jax.jit
def loss_and_grads(views, x, y):
    """The loss and its gradients (in the parameter dtype: float32 sums rounded once)."""
    params = {k: jax.lax.bitcast_convert_type(v, jnp.bfloat16) if v.dtype == jnp.uint16 else v
              for k, v in views.items()}
    return jax.value_and_grad(loss_fn)(params, x, y)


def to_jax(array):
    """A JAX array on the memory of the NumPy ``array`` if it is 64-byte aligned, else a copy.
    bfloat16 goes as its uint16 bits (NumPy's DLPack has no bfloat16): ``loss_and_grads``
    casts them back."""
    bits = array.view(np.uint16) if array.dtype == BF16 else array
    if bits.ctypes.data % ALIGN:
        return jnp.array(bits)           # XLA:CPU would copy it anyway
    return jnp.from_dlpack(bits)


# -- training ----------------------------------------------------------------------------------
init = init_mlp(np.random.default_rng(args.seed), sizes)
init["w3"][...] = 0                      # zero output layer: the first loss is exactly ln(10)
opt = ZeroAdamW(init, comm, lr=args.lr, weight_decay=1e-2, param_dtype=args.dtype,
                max_grad_norm=1.0)
names = list(opt.params)
print0(f"jax_mlp: world_size={size} psi={opt.layout.numel} dtype={opt.param_dtype.name} "
       f"jax={jax.__version__} device={jax.devices()[0].platform} "
       f"mlp={'-'.join(map(str, sizes))} batch={args.batch} ({per_rank} per rank) "
       f"steps={args.steps} lr={args.lr}")

# What each step's transfers did, by tensor: checked every step, reported at the end.
aligned = {k: opt.params[k].ctypes.data % ALIGN == 0 for k in names}
params_zero_copy = dict.fromkeys(names, True)    # numpy -> jax views on every step
grads_zero_copy = dict.fromkeys(names, True)     # jax -> numpy views on every step

losses, last_logged, t0 = [], -1, time.perf_counter()
for step in range(args.steps):
    x, y = get_batch(step)
    # Fresh views of the parameters step() has just written (and no older ones kept).
    views = {k: to_jax(opt.params[k]) for k in names}
    for k in names:
        params_zero_copy[k] &= views[k].unsafe_buffer_pointer() == opt.params[k].ctypes.data
    loss, grads = loss_and_grads(views, x, y)
    # Dispatch is asynchronous: the computation reads the parameter buffer until it is done,
    # and step() is about to rewrite that buffer.
    jax.block_until_ready((loss, grads))
    del views
    for k, g in grads.items():
        host = np.asarray(g)                           # a read-only view of JAX's buffer
        grads_zero_copy[k] &= host.ctypes.data == g.unsafe_buffer_pointer()
        opt.grads[k][...] = host                       # the one copy: into the flat buffer
    opt.step()                                         # average over ranks, AdamW, all-gather
    losses.append(comm.allreduce(float(loss)) / size)  # mean over ranks, for the log
    if (step + 1) % args.log_every == 0 or step == 0 or step == args.steps - 1:
        t1 = time.perf_counter()
        ms = (t1 - t0) * 1e3 / (step - last_logged)
        print0(f"step {step:5d} | loss {losses[-1]:.4f} | {ms:7.2f} ms/step")
        last_logged, t0 = step, t1

record = {"aligned": sorted(k for k in names if aligned[k]),
          "params_zero_copy": sorted(k for k in names if params_zero_copy[k]),
          "grads_zero_copy": sorted(k for k in names if grads_zero_copy[k]),
          "flat_buffer_address_mod_64": opt.params[names[0]].ctypes.data % ALIGN}
records = comm.gather(record)
if rank == 0:
    for r, rec in enumerate(records):
        print(f"rank {r}: parameters to JAX without a copy: {len(rec['params_zero_copy'])}/"
              f"{len(names)} tensors ({len(rec['aligned'])} 64-byte aligned); gradients "
              f"viewed from JAX without a copy: {len(rec['grads_zero_copy'])}/{len(names)}; "
              f"one copy each into opt.grads", flush=True)
    print(f"zero-copy: {json.dumps(records)}", flush=True)
tail = losses[-min(10, len(losses)):]
print0(f"loss {losses[0]:.2f} -> {sum(tail) / len(tail):.2f} (mean of the last {len(tail)} steps)")
if args.plot and rank == 0:
    from plotting import save_plot  # examples/plotting.py
    save_plot(args.plot, f"jax_mlp: {size} ranks, {args.dtype}", [("loss", losses)])
print0(f"losses: {json.dumps(losses)}")
print0(f"final: first_loss={losses[0]:.6f} last_loss={sum(tail) / len(tail):.6f}")
