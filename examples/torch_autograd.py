"""mpiexec -n 4 python -m mpi4py examples/torch_autograd.py

A PyTorch model trained by zero1_mpi through ``zero1_mpi.torch.ZeroOptimizer`` (a
``torch.optim.Optimizer``): every ``nn.Parameter``'s data and ``.grad`` are views of the
optimizer's flat buffers (no copies), so autograd writes gradients straight into them and
``opt.step()`` updates the tensors the model reads. Each rank draws its own
batches; the optimizer averages the gradients over ranks (ZeRO stage 1 AdamW with clipping).

    mpiexec -n 4 python -m mpi4py examples/torch_autograd.py --dtype bfloat16
    mpiexec -n 4 python -m mpi4py examples/torch_autograd.py --overlap  # comm during backward
    mpiexec -n 4 python -m mpi4py examples/torch_autograd.py --reference ddp
    mpiexec -n 2 python -m mpi4py examples/torch_autograd.py --device cuda   # DLPack + CuPy
    mpiexec -n 4 python -m mpi4py examples/torch_autograd.py --plot loss.png  # matplotlib

``--reference ddp`` trains the same model on the same data with
``torch.nn.parallel.DistributedDataParallel`` (gloo) and ``torch.optim.AdamW``: the loss curve it
prints matches this one. Rank 0 prints the loss every ``--log-every`` steps and, last, all
losses as ``losses: [...]`` (JSON) for scripts.
"""

import argparse
import json
import os
from datetime import timedelta

import torch
from mpi4py import MPI

from zero1_mpi.progress import Progress
from zero1_mpi.torch import ZeroOptimizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--reference", default="none", choices=["none", "ddp"])
parser.add_argument("--overlap", action="store_true",
                    help="start reductions from autograd hooks; gather lazily before forward")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--plot", metavar="FILE.png",
                    help="write the loss curve to this PNG at the end (needs matplotlib)")
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
WEIGHT_DECAY, MAX_NORM, D_IN = 1e-2, 1.0, 32


def print0(*a):
    if rank == 0:
        print(*a, flush=True)


if args.device == "cuda":  # a GPU per rank, by node-local rank (round-robin)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    torch.cuda.set_device(local % torch.cuda.device_count())
device = torch.device(args.device)
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


def make_model():
    torch.manual_seed(args.seed)  # the same initial values on every rank (and in both modes)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 1)).to(device=device, dtype=dtype)


TEACHER = torch.randn(D_IN, generator=torch.Generator().manual_seed(1234))


def batch(step):
    """This rank's batch for ``step``: different on every rank, the same in both modes."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step * 1009 + rank)
    x = torch.randn(args.batch, D_IN, generator=g)
    y = torch.sin(x @ TEACHER / D_IN ** 0.5).unsqueeze(1)
    return x.to(device, dtype), y.to(device, dtype)


def train_zero1():
    model = make_model()
    # From here on every parameter and its .grad are views of the optimizer's flat buffers;
    # overlap: reductions start from autograd hooks, the all-gather completes before forward.
    opt = ZeroOptimizer(model, "adamw", comm, lr=args.lr, weight_decay=WEIGHT_DECAY,
                        max_grad_norm=MAX_NORM, param_dtype=args.dtype, overlap=args.overlap)
    losses = []
    for step in range(args.steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()                      # accumulates into the flat gradient buffer
        opt.step()                           # averages over ranks; leaves the grads zeroed
        losses.append(comm.allreduce(loss.item()) / size)
        log(step, losses[-1])
    return losses


def train_ddp():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=rendezvous_store(dist), rank=rank, world_size=size)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(args.steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()                      # DDP averages the gradients over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(comm.allreduce(loss.item()) / size)
        log(step, losses[-1])
    dist.destroy_process_group()
    return losses


def rendezvous_store(dist):
    """gloo's rendezvous: rank 0 serves a TCPStore on a port the OS picks and keeps it open
    (no window in which another process can take it); MPI tells the others the port."""
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                          wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None)
    return store or dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)


def log(step, loss):
    progress.update(step, loss)


print0(f"torch_autograd: world_size={size} dtype={args.dtype} device={args.device} "
       f"optimizer={'DDP + torch.optim.AdamW' if args.reference == 'ddp' else 'zero1_mpi'}")
# Rank 0: step, loss, ms/step, examples/s and ETA every --log-every steps (a tqdm bar where
# tqdm is installed and stdout is a terminal).
progress = Progress(args.steps, rank, tokens_per_step=args.batch * size, unit="examples",
                    every=args.log_every)
losses = train_ddp() if args.reference == "ddp" else train_zero1()
progress.close()
if args.plot and rank == 0:
    from plotting import save_plot  # examples/plotting.py
    how = "DDP + AdamW" if args.reference == "ddp" else "zero1_mpi ZeroAdamW"
    save_plot(args.plot, f"torch_autograd: {how}, {size} ranks, {args.dtype}",
              [("loss", losses)])
print0(f"losses: {json.dumps(losses)}")
