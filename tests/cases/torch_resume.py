"""A torch training loop with an LR scheduler resumed in each order users write it equals the
uninterrupted loop bit for bit (zero1_mpi.torch.ZeroOptimizer, AdamW, two param groups,
clipped with torch.nn.utils.clip_grad_norm_):

- ``orders DIR``: for LambdaLR and (where installed) transformers'
  get_cosine_schedule_with_warmup, stopped after STOP steps and resumed in a new optimizer:
  ``trainer`` (saved after scheduler.step(); optimizer load, then scheduler load: Trainer's
  order), ``consolidated`` (the same through one safetensors file), ``built_after`` (the
  scheduler built after the load with ``last_epoch=opt.step_count - 1``, from the restored
  ``initial_lr``), ``signal`` (checkpoint_on_signal(path): the checkpoint step() saves, the
  scheduler rebuilt as in built_after), ``signal_none`` (checkpoint_on_signal(None): saved by
  the loop after scheduler.step(), Trainer's order). Every step's lr and parameters compared.
- ``save DIR`` (1 rank) then ``load DIR`` (2 ranks): a checkpoint and scheduler state saved on
  one rank resume on two: the parameters load bit for bit, the learning rates continue exactly,
  the losses within fp32 rounding of the one-rank run's.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from casekit import check, rank, size, world

from zero1_mpi import decay_groups
from zero1_mpi.torch import ZeroOptimizer

torch.set_num_threads(1)
STEPS, STOP, BATCH, MAX_NORM = 10, 4, 8, 0.05


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_opt(model):
    groups = decay_groups(dict(model.named_parameters()), 0.1)
    return ZeroOptimizer(groups, "adamw", module=model, lr=3e-2)


def schedule(opt, kind, last_epoch=-1):
    if kind == "lambda":
        factor = lambda k: min(1.0, (k + 1) / 3) * 0.9 ** k  # noqa: E731 - warm-up, decay
        return torch.optim.lr_scheduler.LambdaLR(opt, factor, last_epoch=last_epoch)
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, 3, STEPS, last_epoch=last_epoch)


def batch(step):
    """This rank's share of the step's global batch of BATCH rows."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 6, generator=g)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    return x[mine], y[mine]


def one_step(model, opt, sched, step, record):
    x, y = batch(step)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the optimizer's global norm
    record.append(([g["lr"] for g in opt.param_groups], world.allreduce(loss.item()) / size))
    info = opt.step()
    sched.step()
    return info


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def train(kind, steps, start=0, model=None, opt=None, sched=None):
    """(per-step lr and loss, parameters after each step) of ``steps`` steps from ``start``."""
    if model is None:
        model = make_model()
        opt = make_opt(model)
        sched = schedule(opt, kind)
    record, params = [], []
    for step in range(start, steps):
        one_step(model, opt, sched, step, record)
        params.append(params_of(model))
    return record, params, (model, opt, sched)


def resume(kind, order, root: Path):
    """Train to STOP, save in ``order``'s way, resume in a new optimizer; the record of the
    resumed steps and their parameters."""
    model = make_model()
    opt = make_opt(model)
    sched = schedule(opt, kind)
    ckpt, sched_state = root / f"{kind}-{order}", None
    if order.startswith("signal"):
        handle = opt.checkpoint_on_signal(None if order == "signal_none" else ckpt, "SIGUSR1")
    for step in range(STOP):
        if order.startswith("signal") and step == STOP - 1 and rank == size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's warning, to one rank
            while not handle.received:
                pass
        info = one_step(model, opt, sched, step, [])
        check(info.stop == (order.startswith("signal") and step == STOP - 1), f"{info}")
    if order == "signal_none":  # the loop saves, after scheduler.step(): one consistent point
        check(info.checkpoint is None, f"{info}")
        opt.save(ckpt)
    elif order == "signal":
        check(info.checkpoint is not None and info.checkpoint.parent == ckpt, f"{info}")
    elif order == "consolidated":
        opt.save_consolidated(ckpt.with_suffix(".safetensors"))
    else:
        opt.save(ckpt)
    sched_state = sched.state_dict()
    if order.startswith("signal"):
        handle.close()
    opt.close()

    model = make_model()  # a new job: the model, the optimizer, then the scheduler or not
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other values: the load must replace them
    opt = make_opt(model)
    if order in ("trainer", "signal_none"):
        sched = schedule(opt, kind)
        opt.load(ckpt)
        sched.load_state_dict(sched_state)
    elif order == "consolidated":
        sched = schedule(opt, kind)
        opt.load_consolidated(ckpt.with_suffix(".safetensors"))
        sched.load_state_dict(sched_state)
    else:  # built_after, signal: from the step count and the restored initial_lr
        opt.load(ckpt)
        sched = schedule(opt, kind, last_epoch=opt.step_count - 1)
    check(opt.step_count == STOP, f"{order}: resumed at step {opt.step_count}")
    return train(kind, STEPS, STOP, model, opt, sched)[:2]


def orders(root: Path):
    kinds = ["lambda"]
    try:
        import transformers  # noqa: F401
        kinds.append("transformers")
    except ImportError:
        if os.environ.get("ZERO1_REQUIRE_TRANSFORMERS") == "1":
            raise
    ways = ("trainer", "consolidated", "built_after", "signal", "signal_none")
    for kind in kinds:
        record, params, _ = train(kind, STEPS)
        lrs = [r[0] for r in record]
        check(len({tuple(lr) for lr in lrs}) > 3, f"{kind}: the schedule is flat: {lrs}")
        for order in ways:
            got, got_params = resume(kind, order, root)
            check(got == record[STOP:], f"{kind}/{order}: lr and loss per step {got} != "
                  f"{record[STOP:]}")
            for step, (a, b) in enumerate(zip(got_params, params[STOP:]), STOP):
                check(same(a, b), f"{kind}/{order}: the parameters differ after step {step}")
    if rank == 0:
        print(f"OK torch resume: {len(kinds)} schedules x {len(ways)} orders bit for bit on "
              f"{size} ranks", flush=True)


def save(root: Path):
    """One rank: STEPS uninterrupted (the reference) and a save after STOP."""
    record, params, (model, opt, sched) = train("lambda", STOP)
    opt.save(root / "ckpt")
    torch.save({"sched": sched.state_dict(), "params": params_of(model)}, root / "state.pt")
    rest, _, _ = train("lambda", STEPS, STOP, model, opt, sched)
    (root / "record.json").write_text(json.dumps(rest))


def load(root: Path):
    """Two ranks: resume the one-rank checkpoint in Trainer's order and go on."""
    saved = torch.load(root / "state.pt")
    model = make_model()
    opt = make_opt(model)
    sched = schedule(opt, "lambda")
    opt.load(root / "ckpt")
    sched.load_state_dict(saved["sched"])
    check(same(params_of(model), saved["params"]), "the parameters did not load bit for bit")
    record, _, _ = train("lambda", STEPS, STOP, model, opt, sched)
    expected = json.loads((root / "record.json").read_text())
    check([r[0] for r in record] == [r[0] for r in expected], f"lrs {record} != {expected}")
    worst = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(record, expected))
    check(worst < 1e-5, f"losses {record} differ from the one-rank run's {expected}: {worst}")
    if rank == 0:
        print(f"OK torch resume 1 -> {size} ranks: lr exact, loss within {worst:.1e}",
              flush=True)


if __name__ == "__main__":
    {"orders": orders, "save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
