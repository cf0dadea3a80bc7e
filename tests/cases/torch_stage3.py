"""Stage 3 through the PyTorch binding (``ZeroOptimizer(model, shard_params=True)``) on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/torch_stage3.py DIR

A small language model with an embedding tied to its output layer (the root unit), two blocks
of Linear + LayerNorm, weight decay for matrices only (units across the param groups), trained
by an unchanged loop (forward, ``loss.backward()``, ``step()``) on each rank's own batches:
- fp32 and bf16: the losses, and ``model.state_dict()`` after every step, equal stage 2's bit
  for bit (no clipping: stage 2 lays the tensors out without units); fp32 with clipping is
  within 1e-5 of ``torch.optim.AdamW`` in one process on the gradients averaged over the ranks
  (each rank's batch run there), the tied weight's gradient counted once;
- between steps, and outside its module's forward, every parameter holds no memory
  (``untyped_storage().nbytes() == 0``); from the second step on, a unit's gather is in flight
  when the module before it runs (prefetch); a forward under ``no_grad`` frees all;
- ``reshard_after_forward=False`` keeps each unit from its forward to its backward: the same
  bits;
- the default units (each module owning parameters; the tied weight in ``(root)``) and
  ``units=[blocks]``; a stage-3 checkpoint loads into stage 2 (fresh model) and the next step
  matches; ``unbind()`` gives full parameters back.
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

import casekit as kit
from casekit import check
from zero1_mpi import decay_groups
from zero1_mpi.torch import ZeroOptimizer

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
VOCAB, WIDTH, STEPS = 13, 12, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, h):  # (a tuple with what a backward cannot reach, as attention's)
        return h + torch.tanh(self.lin(self.norm(h))), None, 0


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)[0]
        return self.head(h)


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return Tiny().to(dtype)


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randint(0, VOCAB, (3, 7), generator=g)


def loss_of(m, x):
    logits = m(x).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))


def build(m, stage, **options):
    groups = decay_groups(dict(m.named_parameters()), weight_decay=0.1)
    kind = {"shard_params": True} if stage == 3 else {"shard_gradients": True}
    return ZeroOptimizer(groups, "adamw", comm, module=m, lr=1e-2, **kind, **options)


def same(a, b) -> bool:
    """Bit for bit (any dtype, bf16 too)."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def freed(m, where):
    for name, p in m.named_parameters():
        check(p.numel() == 0 and p.untyped_storage().nbytes() == 0,
              f"{where}: {name} holds {p.untyped_storage().nbytes()} bytes")


def train(m, opt, steps, watch=None):
    losses = []
    for step in range(1, steps + 1):
        loss = loss_of(m, batch(rank, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if watch is not None:
            watch(m, step)
    return losses


def against_stage2(dtype):
    ours_model, theirs_model = model(dtype), model(dtype)
    ours, theirs = build(ours_model, 3), build(theirs_model, 2)
    for step in range(1, STEPS + 1):
        a, b = (train(m, o, 1) for m, o in ((ours_model, ours), (theirs_model, theirs)))
        check(a == b, f"{dtype} step {step}: loss {a} vs stage 2's {b}")
        freed(ours_model, f"{dtype} after step {step}")
        mine, want = ours_model.state_dict(), theirs_model.state_dict()
        check(list(mine) == list(want), f"state_dict keys {list(mine)} vs {list(want)}")
        for k in want:
            check(same(mine[k], want[k]), f"{dtype} step {step}: {k} differs")
        freed(ours_model, f"{dtype} after state_dict()")
    units = ours.sharded.options.units
    check(units[0] == ("(root)", ("emb.weight",)) and len(units) == 5,
          f"the default units: {units}")
    ours.close()
    theirs.close()


def against_torch():
    """fp32, clipping at 1.0: torch.optim.AdamW in one process on the mean gradient."""
    m = model()
    opt = build(m, 3, max_grad_norm=1.0)
    ref = model()
    groups = decay_groups(dict(ref.named_parameters()), weight_decay=0.1)
    topt = torch.optim.AdamW([{"params": list(g["params"].values()),
                               "weight_decay": g["weight_decay"]} for g in groups], lr=1e-2)
    for step in range(1, STEPS + 1):
        train_step = loss_of(m, batch(rank, step))
        train_step.backward()
        opt.step()
        grads = {}
        for r in range(size):
            ref.zero_grad()
            loss_of(ref, batch(r, step)).backward()
            for name, p in ref.named_parameters():
                grads[name] = grads.get(name, 0) + p.grad.double() / size
        for name, p in ref.named_parameters():
            p.grad = grads[name].float()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        topt.step()
        mine = m.state_dict()
        for name, p in ref.named_parameters():
            err = (mine[name] - p.detach()).abs().max().item()
            check(err <= 1e-5, f"step {step}: {name} off torch.optim.AdamW by {err}")
    opt.close()


def prefetch_and_eval():
    m = model()
    opt = build(m, 3)
    seen = {}

    def hook(module, args, output):  # the first block has run: the second's gather travels
        seen[step] = kit.param_gathers(opt.sharded).in_flight

    handle = m.blocks[0].lin.register_forward_hook(hook)
    for step in (1, 2, 3):
        train(m, opt, 1)
    check(seen[1] == 0 and seen[2] == 1 and seen[3] == 1, f"prefetches in flight: {seen}")
    handle.remove()
    with torch.no_grad():
        m(batch(rank, 9))
    freed(m, "after a forward under no_grad")
    opt.close()


def kept_for_backward():
    """``reshard_after_forward=False``: the units stay gathered from their forward to their
    backward (nothing gathered twice), the same bits as freeing them between."""
    freeing, keeping = model(), model()
    ours, theirs = build(freeing, 3), build(keeping, 3, reshard_after_forward=False)
    for step in range(1, STEPS + 1):
        a = loss_of(freeing, batch(rank, step))
        b = loss_of(keeping, batch(rank, step))
        check(keeping.blocks[1].lin.weight.numel() == WIDTH * WIDTH
              and freeing.blocks[1].lin.weight.numel() == 0,
              f"step {step}: after the forward, the kept unit is not gathered or the freed is")
        a.backward()
        b.backward()
        ours.step()
        theirs.step()
        check(a.item() == b.item(), f"step {step}: {a.item()} vs {b.item()}")
        freed(keeping, f"kept units, after step {step}")
    mine, want = keeping.state_dict(), freeing.state_dict()
    for k in want:
        check(same(mine[k], want[k]), f"reshard_after_forward=False: {k} differs")
    ours.close()
    theirs.close()


def blocks_and_checkpoints(directory: Path):
    m = model()
    opt = build(m, 3, units=list(m.blocks))
    units = dict(opt.sharded.options.units)
    check(units["blocks.0"] == ("blocks.0.lin.weight", "blocks.0.lin.bias",
                                "blocks.0.norm.weight", "blocks.0.norm.bias")
          and units["(root)"] == ("emb.weight",) and len(units) == 3, f"units=[blocks]: {units}")
    train(m, opt, 2)
    opt.save(directory / "stage3")
    other = model()
    theirs = build(other, 2)
    theirs.load(directory / "stage3")
    want = m.state_dict()
    for k, v in other.state_dict().items():
        check(same(v, want[k]), f"loaded into stage 2: {k} differs")
    a, b = train(m, opt, 1), train(other, theirs, 1)
    check(a == b, f"the step after the load: {a} vs {b}")
    want = {k: v.clone() for k, v in m.state_dict().items()}
    opt.unbind()
    for name, p in m.named_parameters():
        check(same(p.detach(), want[name]), f"unbind(): {name} differs")
    opt.close()
    theirs.close()


if __name__ == "__main__":
    against_stage2(torch.float32)
    against_stage2(torch.bfloat16)
    against_torch()
    prefetch_and_eval()
    kept_for_backward()
    blocks_and_checkpoints(Path(sys.argv[1]))
    if rank == 0:
        print(f"OK torch stage 3 on {size} ranks")
