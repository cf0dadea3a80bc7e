"""mpiexec -n 4 python -m mpi4py examples/gpt_torch.py

A small character-level GPT (token and position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, an output head tied to the token embedding) trained with PyTorch
autograd and ``zero1_mpi.torch.ZeroOptimizer`` (a ``torch.optim.Optimizer``; a torch LR
scheduler drives it). Every ``nn.Parameter``'s data and ``.grad`` are views of the optimizer's
flat buffers (no copies): autograd accumulates the gradients straight into them, the
reductions start during backward (``overlap=True``: a hook per parameter), and the all-gather
of the updated parameters completes when the next forward needs them. The parameters are
bfloat16 with fp32 master weights and AdamW state sharded over the ranks (ZeRO stage 1),
clipped to a global norm of 1; ``--schedule cosine`` warms the learning rate up over
``--warmup`` steps and decays it to 10% (constant by default).

The text is Python's own documentation, ``pydoc_data.topics`` (about 465K characters, shipped
with CPython: no download); the vocabulary is its characters. Each rank draws its own batches
of ``--context`` characters, seeded by (seed, step, rank), so a resumed run and the reference
see the same data. The default model has about 460K parameters; 200 steps on 2 CPU ranks take
about a minute.

    mpiexec -n 2 python -m mpi4py examples/gpt_torch.py --steps 400 --plot gpt_loss.png
    mpiexec -n 4 python -m mpi4py examples/gpt_torch.py --layers 6 --dim 192 --heads 6
    mpiexec -n 4 python -m mpi4py examples/gpt_torch.py --checkpoint ckpt --save-every 50
    mpiexec -n 4 python -m mpi4py examples/gpt_torch.py --checkpoint ckpt --resume
    mpiexec -n 2 python -m mpi4py examples/gpt_torch.py --dtype float32 --reference ddp

``--checkpoint DIR`` saves a sharded checkpoint every ``--save-every`` steps and at the end;
``--resume`` starts from the newest one in ``DIR`` (saved at any number of ranks); on as many
ranks as before, it goes on with the batches the interrupted run would have drawn, and the same
losses (``--crash-at-step K`` makes the last rank SIGKILL itself at step K, to try it).
``--reference ddp`` trains the same model on the same batches and schedule with
``torch.nn.parallel.DistributedDataParallel`` (gloo) and ``torch.optim.AdamW`` instead; with
``--dtype float32`` its loss curve matches this one (in bfloat16 torch's AdamW updates the bf16
weights themselves: there is no fp32 master to compare with). ``--plot FILE`` draws the loss
and tokens/s per step (needs matplotlib); ``--reference fused`` (one rank) trains it with
``torch.optim.AdamW(fused=True)`` in one process, the tokens/s to compare with.
``--stage 2`` shards the gradients too, ``--stage 3`` the parameters as well (each module's
gathered while it runs, freed after; docs/stage3.md). ``--device cuda`` trains on the GPUs (a rank per GPU by node-local rank, round-robin; the
parameters and gradients are DLPack views of CuPy buffers). ``--sample N`` prints N generated
characters at the end. Rank 0 prints the loss every ``--log-every`` steps and, last, all the
losses as ``losses: [...]`` (JSON) for scripts.
"""

import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from zero1_mpi import decay_groups
from zero1_mpi.progress import Progress
from zero1_mpi.torch import ZeroOptimizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=96, help="embedding width (a multiple of --heads)")
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--context", type=int, default=64, help="characters per sequence")
parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                    help="the learning rate (a torch LR scheduler drives it either way)")
parser.add_argument("--warmup", type=int, default=20, help="warm-up steps of --schedule cosine")
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="parameters and gradients (the master weights: see --masters)")
parser.add_argument("--reduce-dtype", default="float32", choices=["float32", "int8"],
                    help="the gradients on the wire: 16-bit summed in fp32, or 8-bit blocks")
parser.add_argument("--gather-dtype", default=None, choices=["int8"],
                    help="the parameters' all-gather in 8-bit blocks (default: their dtype)")
parser.add_argument("--error-feedback", action="store_true",
                    help="with --reduce-dtype int8: carry what quantizing drops to the next step")
parser.add_argument("--masters", default="auto", choices=["auto", "fp32", "remainder"],
                    help="how bf16 parameters' fp32 masters are kept (auto: 16-bit remainders)")
parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3],
                    help="ZeRO stage: 1 (overlap=True), 2 (gradients sharded too), 3 "
                    "(parameters too: each module's gathered while it runs, docs/stage3.md)")
parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "int8"],
                    help="how Adam's moments are kept (bfloat16: rounded stochastically; "
                    "int8: blockwise 8-bit)")
parser.add_argument("--losses", metavar="FILE", help="write every step's loss (JSON), rank 0")
parser.add_argument("--reference", default="none", choices=["none", "ddp", "fused"])
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--checkpoint", help="directory to save sharded checkpoints in")
parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
parser.add_argument("--resume", action="store_true",
                    help="start from the newest checkpoint in --checkpoint DIR, if there is one")
parser.add_argument("--crash-at-step", type=int,
                    help="the last rank kills itself (SIGKILL) at this step: try --resume")
parser.add_argument("--plot", metavar="FILE", help="save the loss and tokens/s curves (a PNG)")
parser.add_argument("--sample", type=int, default=300, metavar="N",
                    help="characters to generate at the end (rank 0; 0: none)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--log-every", type=int, default=20)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # one core per rank
MAX_NORM = 1.0


def print0(*a):
    if rank == 0:
        print(*a, flush=True)


def exit_all(message):
    """A usage error, found on every rank: rank 0 says it, then every rank exits."""
    print0(f"gpt_torch.py: error: {message}")
    comm.Barrier()  # (a rank that exits first makes mpi4py abort the job: print before that)
    sys.exit(2)


if min(args.layers, args.dim, args.heads, args.context, args.batch, args.steps,
       args.save_every, args.log_every) < 1 or args.sample < 0:
    exit_all("sizes, --steps, --save-every and --log-every must be >= 1, --sample >= 0")
if args.dim % args.heads:
    exit_all(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
if args.resume and not args.checkpoint:
    exit_all("--resume needs --checkpoint DIR")
if args.checkpoint and args.reference != "none":
    exit_all(f"--checkpoint is for the zero1_mpi run, not the {args.reference} reference")
if args.reference == "fused" and size != 1:
    exit_all(f"--reference fused trains in one process: run it on 1 rank, not {size}")
if args.device == "cuda" and args.reference == "ddp":
    exit_all("--reference ddp runs on the CPU (gloo): use --reference fused on cuda")

if args.device == "cuda":  # a GPU per rank, by node-local rank (round-robin)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    torch.cuda.set_device(node.Get_rank() % torch.cuda.device_count())
    node.Free()
device = torch.device(args.device)
if args.plot:  # find out now, not after training, whether the plot can be drawn
    problem = None
    if rank == 0:
        try:
            import matplotlib
            matplotlib.use("Agg")  # files only, no display
            import matplotlib.pyplot as plt
        except ImportError as exc:
            problem = (f"--plot needs matplotlib, which is not installed here ({exc}): "
                       "`pip install matplotlib`, or run without --plot")
    problem = comm.bcast(problem)
    if problem:
        exit_all(problem)

# ---- data -----------------------------------------------------------------------------------

from pydoc_data.topics import topics  # noqa: E402 (Python's documentation, as one dict)

TEXT = "\n\n".join(topics[key] for key in sorted(topics))  # sorted: the same on every rank
CHARS = sorted(set(TEXT))
VOCAB = len(CHARS)
STOI = {c: i for i, c in enumerate(CHARS)}
DATA = torch.tensor([STOI[c] for c in TEXT], dtype=torch.long)


def get_batch(step):
    """This rank's ``--batch`` random windows for ``step``: inputs and next-character targets.
    Drawn from (seed, step, rank) alone, so any run at this world size draws the same ones."""
    rng = np.random.default_rng([args.seed, step, rank])
    starts = torch.from_numpy(rng.integers(0, len(DATA) - args.context - 1, args.batch))
    index = starts[:, None] + torch.arange(args.context + 1)
    chunk = DATA[index].to(device)
    return chunk[:, :-1], chunk[:, 1:]


# ---- model ----------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc, self.out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, context, dim, heads, layers):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)    # token embedding, also the output head
        self.wpe = torch.nn.Embedding(context, dim)  # learned position embedding
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        for name, p in self.named_parameters():      # GPT-2's initialization
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() == 2:  # residual projections scaled down by the depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                      "out.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head: logits over the vocabulary


def make_model():
    torch.manual_seed(args.seed)  # the same initial values on every rank (and in both modes)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return GPT(VOCAB, args.context, args.dim, args.heads, args.layers).to(device, dtype)


def no_decay(name, array):
    """AdamW as usual for transformers: no weight decay on biases, LayerNorm and embeddings."""
    return array.ndim < 2 or name.startswith(("wte.", "wpe."))


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))


# ---- zero1_mpi: the parameters and gradients live in the optimizer's flat buffers -----------


def setup_zero1(model):
    """ZeroAdamW over the model's parameters (a torch.optim.Optimizer); returns it and the
    update step."""
    # The flat buffer holds the groups in order and its buckets are reduced last to first, the
    # order of backward: the no-decay group (with the token embedding, whose gradient is final
    # only at the very end of backward, after the head's and the lookup's are summed) goes first.
    groups = decay_groups(dict(model.named_parameters()), args.weight_decay, no_decay)[::-1]
    # Stage 3: each block a unit; the embeddings and the last LayerNorm in the root unit,
    # gathered for the whole step (the tied head reads wte.weight outside wte's forward).
    stage = {1: {"overlap": True}, 2: {"shard_gradients": True},
             3: {"shard_params": True, "units": list(model.blocks)}}[args.stage]
    opt = ZeroOptimizer(groups, "adamw", comm, module=model, lr=args.lr, betas=(0.9, 0.95),
                        max_grad_norm=MAX_NORM, param_dtype=args.dtype,
                        reduce_dtype=args.reduce_dtype, gather_dtype=args.gather_dtype,
                        error_feedback=args.error_feedback, masters=args.masters,
                        state_dtype=args.state_dtype, **stage)
    # step(): averages over ranks, clips, updates, zeroes the grads. (Looked up at each call:
    # an LR scheduler wraps opt.step.)
    return opt, lambda: opt.step()


# ---- the reference: DistributedDataParallel + torch.optim.AdamW -----------------------------


def setup_ddp(model):
    import torch.distributed as dist
    timeout = timedelta(seconds=120)
    # gloo's rendezvous: rank 0 serves a TCPStore on a port the OS picks; MPI tells the others.
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                          wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None)
    store = store or dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return torch.nn.parallel.DistributedDataParallel(model), *torch_adamw(model)


def torch_adamw(model, **kwargs):
    """torch.optim.AdamW with the same groups, clipping first; returns (optimizer, update)."""
    groups = decay_groups(dict(model.named_parameters()), args.weight_decay, no_decay)
    opt = torch.optim.AdamW([{**g, "params": list(g["params"].values())} for g in groups],
                            lr=args.lr, betas=(0.9, 0.95), **kwargs)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return opt, update


def lr_factor(step):
    """The learning rate at ``step``, as a fraction of --lr: constant, or --warmup steps of
    linear warm-up then a cosine decay to 10% at --steps."""
    if args.schedule == "constant":
        return 1.0
    if step < args.warmup:
        return (step + 1) / args.warmup
    done = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


# ---- training --------------------------------------------------------------------------------

model = make_model()
n_params = sum(p.numel() for p in model.parameters())
tokens_per_step = args.batch * args.context * size
print0(f"gpt_torch: world_size={size} dtype={args.dtype} stage={args.stage} params={n_params} "
       f"layers={args.layers} dim={args.dim} heads={args.heads} context={args.context} "
       f"batch={args.batch}/rank ({tokens_per_step} tokens/step) vocab={VOCAB} "
       f"text=pydoc_data.topics ({len(TEXT)} chars) device={args.device} "
       f"schedule={args.schedule} optimizer=" +
       {"ddp": "DDP + torch.optim.AdamW", "fused": "torch.optim.AdamW(fused=True)",
        "none": "zero1_mpi ZeroAdamW"}[args.reference])

if args.reference == "ddp":
    net, opt, update = setup_ddp(model)
elif args.reference == "fused":
    net, (opt, update) = model, torch_adamw(model, fused=True)
else:
    net, (opt, update) = model, setup_zero1(model)
start = 0
if args.resume:
    if (Path(args.checkpoint) / "LATEST").exists():
        print0(f"resumed from {opt.load(args.checkpoint)}")  # into the model's views, in place
        start = opt.step_count  # the step the next batch is drawn for
        if start >= args.steps:
            exit_all(f"the checkpoint in {args.checkpoint} is at step {start}: nothing is "
                     f"left to train with --steps {args.steps} (raise it)")
    else:
        print0(f"no checkpoint in {args.checkpoint} yet: starting at step 0")
# The same scheduler drives whichever optimizer trains. The schedule is a function of the step:
# a resumed run builds it at the checkpoint's step (last_epoch), from the initial_lr that the
# checkpoint put back into param_groups, as with torch.optim (a scheduler built before
# opt.load and given its saved state_dict resumes exactly too: docs/pytorch.md).
scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor, last_epoch=start - 1)

losses, tokens_per_s = [], []
# Rank 0: step, loss, ms/step, tokens/s and ETA every --log-every steps (a tqdm bar instead
# where tqdm is installed and stdout is a terminal; ZERO1_PROGRESS=plain forces the lines).
progress = Progress(args.steps, rank, start=start, tokens_per_step=tokens_per_step,
                    every=args.log_every)
for step in range(start, args.steps):
    if step == args.crash_at_step and rank == size - 1:
        print(f"crash: rank {rank} kills itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    x, y = get_batch(step)
    loss = loss_of(net, x, y)
    loss.backward()  # zero1_mpi: accumulates into opt.grads; the hooks start the reductions
    update()
    scheduler.step()
    losses.append(comm.allreduce(loss.item()) / size)  # mean over ranks (and a sync, for timing)
    tokens_per_s.append(tokens_per_step / (time.perf_counter() - t0))
    if args.checkpoint and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
        opt.save(args.checkpoint, keep=2)
    progress.update(step, losses[-1], lr=scheduler.get_last_lr()[0])
progress.close()

if args.reference == "ddp":
    torch.distributed.destroy_process_group()
tail = tokens_per_s[len(tokens_per_s) // 10:] or tokens_per_s  # past the warm-up
print0(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {np.median(tail):.0f} tokens/s "
       f"(median over steps {start + len(tokens_per_s) - len(tail)}-{args.steps - 1})")
if rank == 0 and args.losses:
    Path(args.losses).write_text(json.dumps({"args": vars(args), "losses": losses}) + "\n")

if args.sample and args.stage == 3 and args.reference == "none":
    opt.unbind()  # every rank: the full parameters back in the model, for rank 0 to sample
if rank == 0 and args.sample:
    with torch.no_grad():
        generator = torch.Generator().manual_seed(args.seed)
        idx = torch.tensor([[STOI[c] for c in "\n"]])
        for _ in range(args.sample):
            logits = model(idx[:, -args.context:].to(device))[0, -1].float().cpu()
            next_char = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, next_char[None]], dim=1)
    print(f"sample:\n{''.join(CHARS[i] for i in idx[0, 1:].tolist())}\n", flush=True)

if rank == 0 and args.plot:
    steps, window = np.arange(start, args.steps), min(20, len(losses))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")  # running mean
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot(steps, losses, lw=0.6, alpha=0.4, label="per step")
    ax1.plot(steps[window - 1:], smooth, lw=1.5, color="C0", label=f"mean of {window}")
    ax1.set(xlabel="step", ylabel="training loss (nats/char)",
            title=f"char-level GPT, {n_params / 1e3:.0f}K params, {args.dtype}")
    ax1.legend()
    ax2.plot(steps, tokens_per_s, lw=0.8, color="C1")
    ax2.set(xlabel="step", ylabel="tokens/s (all ranks)", ylim=(0, None),
            title=f"{size} ranks, {tokens_per_step} tokens/step")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=80)
    print(f"wrote {args.plot}", flush=True)

print0(f"losses: {json.dumps(losses)}")
