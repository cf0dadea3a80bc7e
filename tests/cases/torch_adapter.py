"""zero1_mpi.torch.ZeroOptimizer on N ranks == torch.optim.AdamW in one process.

- parity: a small torch MLP in float32, bfloat16 and float16 (dynamic loss scaling), param
  groups, clipping, and two LR schedulers (CosineAnnealingLR; OneCycleLR, which also cycles
  the betas) driving both optimizers: each step, the gradients every rank's autograd wrote into
  the flat buffer are averaged in float64 and given to torch.optim.AdamW (fp32 weights); the
  model's parameters must stay within the project's bound of its. In float32 an independent
  model trained on all ranks' batches at once must agree too.
- overlap (hooks) and gradient accumulation under no_sync() are bitwise the plain loop;
  model.zero_grad() (set_to_none) is repaired; save/load restore the model's tensors.
- misuse raises on every rank with nothing updated: a model moved or a parameter replaced
  after binding, a second backward under overlap, state_dict(), add_param_group, rebinding.
"""

import warnings

import numpy as np
import torch
from mpi4py import MPI
from casekit import raises
from reference import close_to_reference

from zero1_mpi import decay_groups
from zero1_mpi.kernels.backend import resolve_dtype
from zero1_mpi.torch import ZeroOptimizer

torch.set_num_threads(1)
# float16's skipped steps call the reference's scheduler without its optimizer.step()
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS, LR, MAX_NORM, D_IN = 12, 2e-2, 0.5, 5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_model(dtype=torch.float32):
    torch.manual_seed(0)  # the same initial values on every rank
    return torch.nn.Sequential(torch.nn.Linear(D_IN, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
                               torch.nn.Tanh(), torch.nn.Linear(3, 1)).to(dtype)


def batch(step, r=rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randn(4 + r, D_IN, generator=g)  # a different batch size on every rank
    return x.to(dtype), torch.sin(x.sum(1, keepdim=True)).to(dtype)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def no_decay(name, array):
    return array.ndim < 2


def schedulers(opt, kind):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS,
                                               pct_start=0.3)


def check(cond, message):
    if not cond:
        raise AssertionError(f"rank {rank} of {size}: {message}")


def parity(dtype_name, kind, overlap):
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    groups = decay_groups(dict(model.named_parameters()), 0.1, no_decay)
    scale = {"loss_scale": "dynamic"} if dtype_name == "float16" else {}
    opt = ZeroOptimizer(groups, "adamw", comm, module=model, lr=LR, max_grad_norm=MAX_NORM,
                        overlap=overlap, **scale)
    check(isinstance(opt, torch.optim.Optimizer), "not a torch.optim.Optimizer")
    master = {n: torch.nn.Parameter(p.detach().float().clone())
              for n, p in make_model(dtype).named_parameters()}  # the rounded start
    topt = torch.optim.AdamW(
        [{"params": [master[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
         for g in groups], lr=LR)
    ours_sched, their_sched = schedulers(opt, kind), schedulers(topt, kind)
    whole = make_model() if dtype_name == "float32" else None  # all ranks' batches at once
    whole_opt = whole_sched = None
    if whole is not None:
        named = dict(whole.named_parameters())
        whole_opt = torch.optim.AdamW(
            [{"params": [named[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
             for g in groups], lr=LR)
        whole_sched = schedulers(whole_opt, kind)
    shadow = make_model(dtype)  # the same values, its own gradients (see below)
    for step in range(STEPS):
        x, y = batch(step, dtype=dtype)
        opt.wait()
        with torch.no_grad():
            for q, p in zip(shadow.parameters(), model.parameters()):
                q.copy_(p)
                q.grad = None
        (loss_of(model, x, y) * opt.loss_scale).backward()
        # The gradients autograd wrote into the buffer, from the shadow's identical backward:
        # with overlap the buffer is being reduced in place by now (no longer this rank's).
        (loss_of(shadow, x, y) * opt.loss_scale).backward()
        every = comm.allgather({n: q.grad.double().numpy() / opt.loss_scale
                                for n, q in shadow.named_parameters()})
        info = opt.step()
        ours_sched.step()
        if info.skipped:  # float16's first steps find the loss scale; torch skips them too
            their_sched.step()
            continue
        for n, p in master.items():
            p.grad = torch.tensor(np.mean([e[n] for e in every], axis=0), dtype=torch.float32)
        torch.nn.utils.clip_grad_norm_(list(master.values()), MAX_NORM)
        topt.step()
        their_sched.step()
        check(opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"],
              f"lr {opt.param_groups[0]['lr']} vs {topt.param_groups[0]['lr']}")
        opt.wait()
        where = f"{dtype_name}/{kind}/overlap={overlap} step {step}"
        for n, p in model.named_parameters():
            check(p.grad is not None and not p.grad.any(), f"{where}: {n}.grad not zeroed")
            ok, err = close_to_reference(p.detach().float().numpy().astype(
                resolve_dtype(dtype_name)), master[n].detach().double().numpy(), dtype_name)
            check(ok, f"{where}: {n} off by {err} from torch.optim.AdamW")
        if whole is not None:
            xs, ys = zip(*(batch(step, r) for r in range(size)))
            whole_opt.zero_grad()
            # the mean of the ranks' mean losses: what averaging their gradients computes
            sum(loss_of(whole, a, b) for a, b in zip(xs, ys)).div(size).backward()
            torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM)
            whole_opt.step()
            whole_sched.step()
            for (n, p), q in zip(model.named_parameters(), whole.parameters()):
                err = float((p - q).detach().abs().max() / q.detach().abs().max())
                check(err < 1e-5, f"{where}: {n} differs from the one-process model by {err}")
    return [p.detach().clone() for p in model.parameters()]


def train(overlap=False, accumulate=1, zero_grad_none=False, offset=0, model=None,
          **options):
    model = model or make_model()
    opt = ZeroOptimizer(model, "adamw", comm, lr=LR, max_grad_norm=MAX_NORM, overlap=overlap,
                        **options)
    for step in range(4):
        for micro in range(accumulate):
            x, y = batch(10 * step + micro + offset)
            if zero_grad_none:
                model.zero_grad(set_to_none=True)  # torch's habit: .grad becomes None
                x, y = batch(10 * step + accumulate - 1)  # so only the last one counts
            sync = micro == accumulate - 1 or not overlap
            with (opt.no_sync() if not sync else _nothing()):
                (loss_of(model, x, y) / (1 if zero_grad_none else accumulate)).backward()
            if opt.sharded_gradients:  # handed over and dropped: no gradient piles up
                check(all(p.grad is None for p in model.parameters()), "a .grad was kept")
        opt.step()
    opt.wait()
    return [p.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def raises_everywhere(kind, text, fn):  # every rank runs it: each must raise
    raises(kind, text, fn)


def misuse(tmp):
    model = make_model()
    opt = ZeroOptimizer(model, "adamw", comm, lr=LR)
    x, y = batch(0)
    loss_of(model, x, y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    raises_everywhere(RuntimeError, "opt.save(directory)", opt.state_dict)
    raises_everywhere(RuntimeError, "save_consolidated", lambda: opt.load_state_dict({}))
    raises_everywhere(NotImplementedError, "pass every param group",
                      lambda: opt.add_param_group({"params": [torch.nn.Parameter(
                          torch.zeros(2))]}))
    raises_everywhere(ValueError, "already bound to another ZeroOptimizer",
                      lambda: ZeroOptimizer(model, "adamw", comm))
    # a parameter replaced on the last rank only: the error is raised on every rank
    if rank == size - 1:
        model[0].bias = torch.nn.Parameter(model[0].bias.detach().clone())
    raises_everywhere(ValueError, "parameter '0.bias' of the module was replaced", opt.step)
    check(same([model[0].weight], [before[0]]), "a failed step updated the parameters")
    # the model moved to another dtype after binding
    model = make_model()
    opt = ZeroOptimizer(model, "sgd", comm, lr=LR)
    model.double()
    raises_everywhere(ValueError, "no longer lives in the optimizer's buffers", opt.step)
    check(opt.step_count == 0, "a failed step counted")
    # a second backward under overlap without no_sync()
    model = make_model()
    opt = ZeroOptimizer(model, "adamw", comm, lr=LR, overlap=True)
    loss_of(model, x, y).backward()
    raises_everywhere(ValueError, "inside `with opt.no_sync():`",
                      lambda: loss_of(model, x, y).backward())
    opt.zero_grad()
    # unbind(): the parameters become independent tensors; another optimizer may bind them
    values = [p.detach().clone() for p in model.parameters()]
    opt.unbind()
    check(same(values, [p.detach() for p in model.parameters()]), "unbind changed values")
    check(all(p.grad is None for p in model.parameters()), "unbind left .grad")
    opt = ZeroOptimizer(model, "lion", comm, lr=1e-3)
    loss_of(model, x, y).backward()
    opt.step()
    check(not same(values, [p.detach() for p in model.parameters()]), "rebound: no update")
    # save/load through the adapter: the model's tensors get the saved values back
    saved = [p.detach().clone() for p in model.parameters()]
    opt.save(tmp)
    loss_of(model, x, y).backward()
    opt.step()
    opt.load(tmp)
    check(same(saved, [p.detach() for p in model.parameters()]), "load did not restore")
    check(opt.step_count == 1, f"step_count {opt.step_count} after load")


class WithUnused(torch.nn.Module):
    """The MLP, and a layer whose parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.mlp, self.unused = make_model(), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.mlp(x)


def stage2():
    """shard_gradients=True: each .grad handed over by its hook and dropped; an fp32 model's
    single micro-batch equals stage 1 bit for bit, overlapped or not, also with a parameter
    that gets no gradient (handed over as zeros at the end of backward); accumulation is
    stage 1's within fp32 rounding (the sums over ranks come per micro-batch)."""
    plain = train()
    check(same(plain, train(shard_gradients=True)), "stage 2 differs from stage 1")
    check(same(plain, train(overlap=True, shard_gradients=True)), "overlapped stage 2 differs")
    unused = train(model=WithUnused())
    check(same(unused, train(model=WithUnused(), shard_gradients=True)),
          "stage 2 with an unused parameter differs from stage 1")
    accumulated = train(accumulate=2)
    for p, q in zip(accumulated, train(accumulate=2, shard_gradients=True)):
        check(torch.allclose(p, q, rtol=1e-5, atol=1e-7), "stage 2 accumulation differs")
    model = make_model()
    opt = ZeroOptimizer(model, "adamw", comm, shard_gradients=True)
    raises_everywhere(KeyError, "opt.add_grad(name, grad)", lambda: opt.sharded.grads["0.bias"])


def main():
    import sys
    tmp = comm.bcast(sys.argv[1] if len(sys.argv) > 1 else None)
    runs = 0
    for dtype_name, kind, overlap in (("float32", "cosine", False), ("float32", "onecycle", True),
                                      ("bfloat16", "onecycle", False),
                                      ("float16", "cosine", True)):
        parity(dtype_name, kind, overlap)
        runs += 1
    plain = train()
    check(same(plain, train(overlap=True)), "overlap changed the result")
    accumulated = train(accumulate=2)
    check(same(accumulated, train(overlap=True, accumulate=2)), "no_sync() changed the result")
    check(not same(plain, accumulated), "accumulation changed nothing")
    check(same(train(accumulate=2, zero_grad_none=True),
               train(overlap=True, accumulate=2, zero_grad_none=True)),
          "model.zero_grad() broke overlap")
    check(same(train(accumulate=2, zero_grad_none=True), train(offset=1)),
          "model.zero_grad() did not discard the first micro-batch's gradients")
    misuse(tmp)
    stage2()
    if rank == 0:
        print(f"OK torch adapter: {runs} parity runs x {STEPS} steps on {size} ranks")


if __name__ == "__main__":
    main()
