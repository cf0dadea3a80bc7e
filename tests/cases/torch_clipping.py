"""Clipping a ZeroOptimizer's parameters gives the global norm whichever way torch code reaches
torch's clipping, and however early it bound the name: this script binds torch's names BEFORE
importing zero1_mpi.torch, as scripts that import everything first do.

Each way (an early-bound ``clip_grad_norm_``, ``torch.nn.utils.clip_grad.clip_grad_norm_``,
the deprecated ``clip_grad_norm``, early-bound ``get_total_norm`` + ``clip_grads_with_norm_``,
torch.nn.utils's names looked up late, accelerate's ``Accelerator.clip_grad_norm_``) in stage 1
and stage 2: the norm it returns and the parameters after ``step()`` (SGD, lr 1) against an
oracle computed here in float64 from every rank's own gradients (an independent copy of the
model, its gradients all-gathered with mpi4py), where clipping each rank by its own norm would
differ by far more than the bound. Then ``opt.reduced_grads()`` against the same oracle, and
what ``.grad`` holds before and after the reduction.
"""

import importlib.util
import os
import warnings

from torch.nn.utils import clip_grad_norm as early_deprecated  # noqa: I001 - before zero1_mpi
from torch.nn.utils import clip_grad_norm_ as early_clip
from torch.nn.utils import clip_grads_with_norm_ as early_with_norm
from torch.nn.utils import get_total_norm as early_total
import torch.nn.utils.clip_grad as clip_grad_module

import numpy as np
import torch
from mpi4py import MPI

from zero1_mpi.torch import ZeroOptimizer

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)  # clip_grad_norm is deprecated
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
for launcher_size in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
    os.environ.pop(launcher_size, None)  # accelerate would start torch.distributed over them


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))


def backward(model, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(5 + 3 * rank, 6, generator=g) * (1 + 2 * rank)  # ranks' norms differ
    torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :2])).backward()


def oracle(step, max_norm):
    """float64: every rank's gradients averaged, the global norm, the clipped mean."""
    model = make_model()
    backward(model, step)
    local = {n: p.grad.double().numpy() for n, p in model.named_parameters()}
    mean = {n: sum(g[n] for g in comm.allgather(local)) / size for n in local}
    norm = np.sqrt(sum(float((g * g).sum()) for g in mean.values()))
    local_norm = np.sqrt(sum(float((g * g).sum()) for g in local.values()))
    clip = min(1.0, max_norm / (norm + 1e-6))
    return norm, local_norm, {n: clip * g for n, g in mean.items()}


def accelerate_clip(params, max_norm):
    from accelerate import Accelerator

    return Accelerator(cpu=True).clip_grad_norm_(params, max_norm)


WAYS = {
    "early-bound clip_grad_norm_": lambda m, c: early_clip(m.parameters(), c),
    "torch.nn.utils.clip_grad.clip_grad_norm_":
        lambda m, c: clip_grad_module.clip_grad_norm_(m.parameters(), c),
    "early-bound clip_grad_norm (deprecated)": lambda m, c: early_deprecated(m.parameters(), c),
    "early-bound get_total_norm + clip_grads_with_norm_": lambda m, c: (
        lambda total: (early_with_norm(m.parameters(), c, total), total)[1])(
            early_total([p.grad for p in m.parameters() if p.grad is not None])),
    "torch.nn.utils.clip_grad_norm_ (late)":
        lambda m, c: torch.nn.utils.clip_grad_norm_(m.parameters(), c),
}
if importlib.util.find_spec("accelerate"):  # (the test says whether it must be there)
    WAYS["accelerate's Accelerator.clip_grad_norm_"] = \
        lambda m, c: accelerate_clip(m.parameters(), c)


def check(cond, message):
    if not cond:
        raise AssertionError(f"rank {rank}: {message}")


def clipped_step(way, stage2):
    model = make_model()
    before = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    opt = ZeroOptimizer(model, "sgd", lr=1.0, shard_gradients=stage2)
    backward(model, 1)
    max_norm = 0.5 * oracle(1, np.inf)[0]  # clipping to half the global norm
    norm_reference, local_norm, expected = oracle(1, max_norm)
    if stage2 and way.startswith(("early-bound get_total_norm", "accelerate")):
        # every .grad is None in stage 2 (handed over): a norm of the .grad that are there is
        # 0 (docs/pytorch.md: call opt.clip_grad_norm_). clip_grads_with_norm_ on all the
        # parameters still clips the step by the global norm; accelerate calls it only for
        # parameters that have a .grad, so nothing is clipped
        norm = float(WAYS[way](model, max_norm))
        check(norm == 0.0, f"{way}, stage 2: norm {norm} of no gradients")
        if way.startswith("accelerate"):
            expected = {n: g / min(1.0, max_norm / (norm_reference + 1e-6))
                        for n, g in expected.items()}
    else:
        norm = float(WAYS[way](model, max_norm))
        norms = comm.allgather(norm)
        check(abs(norm - norm_reference) <= 1e-5 * norm_reference,
              f"{way}: norm {norm} vs the global {norm_reference} (this rank's own: "
              f"{local_norm})")
        check(len(set(norms)) == 1, f"{way}: the norm differs between ranks {norms}")
        check(max(abs(n - norm_reference) for n in comm.allgather(local_norm))
              > 0.05 * norm_reference,
              "the ranks' own norms must differ from the global one, or nothing is tested")
    opt.step()
    worst = max(float(np.abs(p.detach().double().numpy() - (before[n] - expected[n])).max())
                for n, p in model.named_parameters())
    check(worst <= 1e-6, f"{way}, stage {1 + stage2}: parameters {worst} from the oracle's")
    opt.close()
    return norm


def reduced_grads_and_dot_grad():
    """``reduced_grads()`` is the clipped mean on every rank; ``.grad`` is this rank's own
    gradient before the reduction, and the reduction's scratch after it."""
    model = make_model()
    opt = ZeroOptimizer(model, "sgd", lr=1.0)
    backward(model, 2)
    own = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
    norm, _, expected = oracle(2, 1e9)
    check(all(np.array_equal(own[n], p.grad.double().numpy())
              for n, p in model.named_parameters()), ".grad before the reduction")
    got = opt.reduced_grads()
    worst = max(float(np.abs(got[n].double().numpy() - expected[n]).max()) for n in expected)
    check(worst <= 1e-6 * max(1.0, norm), f"reduced_grads() {worst} from the mean")
    check(all(got[n].shape == p.shape and got[n].dtype == torch.float32
              for n, p in model.named_parameters()), "reduced_grads() shapes and dtypes")
    # after the reduction .grad is the reduction's scratch (docs/pytorch.md): neither this
    # rank's own gradient nor the mean, on every rank
    after = {n: p.grad.double().numpy() for n, p in model.named_parameters()}
    for what, values in (("this rank's own gradient", own), ("the mean", expected)):
        check(not all(np.allclose(after[n], values[n], rtol=1e-5) for n in after),
              f".grad after the reduction still holds {what}: update docs/pytorch.md")
    # the clip of the coming step is in reduced_grads(): a max_norm given after it too
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25 * norm)
    clipped = opt.reduced_grads()
    coef = 0.25 * norm / (norm + 1e-6)
    worst = max(float(np.abs(clipped[n].double().numpy() - coef * expected[n]).max())
                for n in expected)
    check(worst <= 1e-6 * max(1.0, norm), f"reduced_grads() after clipping: {worst}")
    opt.step()
    opt.close()


def main():
    for stage2 in (False, True):
        for way in WAYS:
            clipped_step(way, stage2)
    reduced_grads_and_dot_grad()
    if rank == 0:
        print(f"OK torch clipping: {len(WAYS)} ways x 2 stages on {size} ranks give the global "
              "norm; reduced_grads() is the clipped mean")


main()
