"""The step benchmark's torch references (``step.py``): torch's optimizer as one kernel call,
and ``torch.distributed.optim.ZeroRedundancyOptimizer`` over gloo after a DDP-style all-reduce.
Imported only where torch is installed; one thread per rank."""

from __future__ import annotations

import time

import torch

from . import common


def torch_kernel(n: int, dtype, choice):
    """A call of ``choice``'s torch optimizer over ``n`` elements doing the kernel's job: for
    16-bit ``dtype``, 16-bit grads in, its fp32 update, 16-bit params out."""
    torch.set_num_threads(1)
    torch_class, torch_options, _ = choice["torch"]
    p = torch.nn.Parameter(torch.ones(n))
    opt = getattr(torch.optim, torch_class)([p], **choice["options"], **torch_options)
    if dtype.name == "float32":
        p.grad = torch.full((n,), 1e-3)
        return opt.step
    tdtype = torch.bfloat16 if dtype.name == "bfloat16" else torch.float16
    g16, p16 = torch.full((n,), 1e-3, dtype=tdtype), torch.ones(n, dtype=tdtype)
    p.grad = torch.empty(n)

    def torch_step():
        p.grad.copy_(g16)
        opt.step()
        p16.copy_(p.detach())
    return torch_step


def torch_zero(comm, shapes, grads, init, median_phases, choice) -> dict:
    """(c): the phases of torch's ZeRO-1 step (``median_phases(step)``) and its bytes per rank;
    must be called on all ranks."""
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    if not dist.is_initialized():
        common.init_gloo(comm)
    params = [torch.nn.Parameter(torch.tensor(init[k])) for k in shapes]
    tgrads = [torch.tensor(grads[k]) for k in shapes]
    torch_class, torch_options, _ = choice["torch"]
    zero = ZeroRedundancyOptimizer(params, optimizer_class=getattr(torch.optim, torch_class),
                                   **choice["options"], **torch_options)
    local = {"seconds": 0.0}
    inner_step = zero.optim.step

    def timed_inner_step(*a, **k):
        t = time.perf_counter()
        out = inner_step(*a, **k)
        local["seconds"] = time.perf_counter() - t
        return out
    zero.optim.step = timed_inner_step
    world = comm.Get_size()

    def step():
        for p, g in zip(params, tgrads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        for p in params:  # DDP's gradient averaging
            dist.all_reduce(p.grad)
            p.grad /= world
        t1 = time.perf_counter()
        zero.step()
        total = time.perf_counter() - t1
        return {"reduce": t1 - t0, "optimizer": local["seconds"],
                "gather": total - local["seconds"]}

    phases = median_phases(step)
    zero.step()
    state = sum(t.numel() * t.element_size() for st in zero.optim.state.values()
                for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    psi = sum(p.numel() for p in params)
    return {**phases, "bytes": comm.allreduce(8 * psi + state, op=MPI.MAX),
            "state_bytes": comm.allreduce(state, op=MPI.MAX),
            "state_bytes_min": comm.allreduce(state, op=MPI.MIN)}
