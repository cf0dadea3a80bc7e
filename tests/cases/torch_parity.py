"""ZeroAdam/ZeroAdamW on N ranks == torch.optim.Adam/AdamW + clip_grad_norm_ in one process.

Param groups (decay for matrices only, a second lr), weight decay, clipping and a learning rate
changed before every step, in float32 and bfloat16 (fp32 master weights), compared step by step
with PyTorch run on the gradients averaged over ranks. Needs torch; run on any number of ranks.
"""

import numpy as np
import torch
from mpi4py import MPI

from reference import close_to_reference
from zero1_mpi import ZeroAdam, ZeroAdamW, decay_groups
from zero1_mpi.kernels.backend import resolve_dtype

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w1": (6, 5), "b1": (5,), "w2": (5, 3), "b2": (3,), "gain": ()}
BASE_LR = (1e-2, 2e-2)
STEPS = 25
MAX_NORM = 0.5


def init_values():
    rng = np.random.default_rng(42)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grads_of(r, step, dtype):
    rng = np.random.default_rng([step, r])
    return {k: (rng.standard_normal(s) * (1 + r)).astype(np.float32).astype(dtype)
            for k, s in SHAPES.items()}


def schedule(step):
    """Linear warm-up over 5 steps, then cosine decay: any schedule works between steps."""
    return min(step / 5, 1.0) * 0.5 * (1 + np.cos(np.pi * step / STEPS))


def run(dtype_name, ours_cls, torch_cls):
    dtype = resolve_dtype(dtype_name)
    groups = decay_groups(init_values(), weight_decay=0.1)
    groups[1]["lr"] = BASE_LR[1]
    opt = ours_cls(groups, comm, lr=BASE_LR[0], param_dtype=dtype_name, max_grad_norm=MAX_NORM)

    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init_values().items()}
    topt = torch_cls([{"params": [tparams[k] for k in g["params"]],
                       "weight_decay": g["weight_decay"], "lr": g.get("lr", BASE_LR[0])}
                      for g in groups], lr=BASE_LR[0])

    for step in range(1, STEPS + 1):
        for ours, theirs, base in zip(opt.param_groups, topt.param_groups, BASE_LR):
            ours["lr"] = theirs["lr"] = base * schedule(step)
        for k, g in grads_of(rank, step, dtype).items():
            opt.grads[k][...] = g
        info = opt.step()

        every = [grads_of(r, step, dtype) for r in range(size)]
        for k, p in tparams.items():
            mean = np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
            p.grad = torch.tensor(mean.astype(np.float32))
        norm = float(torch.nn.utils.clip_grad_norm_(list(tparams.values()), MAX_NORM))
        topt.step()

        where = f"{dtype_name}/{ours_cls.__name__} step {step}, rank {rank} of {size}"
        if abs(info.grad_norm - norm) > 1e-5 * norm:
            raise AssertionError(f"{where}: grad_norm {info.grad_norm} vs torch {norm}")
        for k, p in tparams.items():
            ok, err = close_to_reference(opt.params[k], p.detach().double().numpy(), dtype)
            if not ok:
                raise AssertionError(f"{where}: {k!r} off by {err}")


def main():
    cases = 0
    for dtype_name in ("float32", "bfloat16"):
        for ours_cls, torch_cls in ((ZeroAdam, torch.optim.Adam), (ZeroAdamW, torch.optim.AdamW)):
            run(dtype_name, ours_cls, torch_cls)
            cases += 1
    if rank == 0:
        print(f"OK torch parity: {cases} cases x {STEPS} steps on {size} ranks "
              f"(torch {torch.__version__})")


if __name__ == "__main__":
    main()
