"""The stage 2 benchmark's measurement (``stage2.py``), on every rank of a job: torch models
trained through zero1_mpi's stage 1 and 2 and through FSDP2. Imported only by the worker."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

from zero1_mpi.torch import ZeroOptimizer, as_array

from . import common
from .stage2 import SEED, WEIGHT_DECAY, first_line, mlp_dims, param_count


def measure(args) -> dict:
    """The result of one job: its cells, each measured on every rank in turn."""
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    dims = mlp_dims(args.model)
    result = {"world_size": comm.Get_size(), "model": args.model, "dims": list(dims),
              "psi": param_count(dims), "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "lr": args.lr, "fsdp_bf16": args.fsdp_bf16,
              "bucket_elements": args.bucket_elements, "grad_staging": args.grad_staging,
              "torch": torch.__version__, "cells": []}
    group = {"error": None, "ready": False}
    for dtype in args.dtypes:
        for accumulate in args.accumulate:
            batches = make_batches(comm.Get_rank(), dims, args, accumulate)
            cell = {"dtype": dtype, "accumulate": accumulate}
            for stage in (1, 2):
                cell[f"stage{stage}"] = run_zero(comm, dims, batches, dtype, accumulate,
                                                 stage, args)
                gc.collect()  # its buffers go before the next run allocates
            cell["fsdp2"] = run_fsdp_cell(comm, dims, batches, dtype, accumulate,
                                          args, group)
            result["cells"].append(cell)
    if group["ready"]:
        dist.destroy_process_group()
    return result


def make_batches(rank: int, dims, args, accumulate: int) -> list:
    """This rank's micro-batches ``[iteration][micro-batch] = (x, y)`` in fp32, the same for
    every implementation: warmup + steps iterations and one more for the byte count."""
    gen = torch.Generator().manual_seed(SEED * 7919 + rank)
    return [[(torch.randn(args.batch, dims[0], generator=gen),
              torch.randn(args.batch, dims[-1], generator=gen))
             for _ in range(accumulate)] for _ in range(args.warmup + args.steps + 1)]


def build_model(dims):
    torch.manual_seed(SEED)  # the same initial values on every rank and for every run
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def train(comm, model, batches, args, *, input_dtype, micro_context, step, probe=None) -> dict:
    """``warmup + steps`` timed iterations, then one untimed one that calls ``probe(point,
    micro_batch)`` at "forward" (after each forward), "backward" (after each backward) and
    "step" (before the step). Returns the median step time of the slowest rank and the loss
    (mean over ranks and micro-batches) at the last timed step."""
    accumulate = len(batches[0])
    timed = args.warmup + args.steps
    seconds, last_loss = [], 0.0
    end = time.perf_counter()
    for i, micro in enumerate(batches):
        measuring = i == timed
        loss_sum = 0.0
        for m, (x, y) in enumerate(micro):
            with micro_context(m):
                out = model(x.to(input_dtype))
                if measuring and probe:
                    probe("forward", m)
                loss = F.mse_loss(out.float(), y) / accumulate
                loss.backward()
            if measuring and probe:
                probe("backward", m)
            loss_sum += loss.item()
        if measuring and probe:
            probe("step", accumulate - 1)
        step()
        now = time.perf_counter()
        if not measuring:
            seconds.append(now - end)
            last_loss = loss_sum
        end = now
    slowest = np.array(seconds[args.warmup:], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)  # after the run: no barrier inside it
    return {"step_s": statistics.median(slowest.tolist()), "steps_s": slowest.tolist(),
            "loss": comm.allreduce(last_loss, op=MPI.SUM) / comm.Get_size()}


def run_zero(comm, dims, batches, dtype: str, accumulate: int, stage: int, args) -> dict:
    """(a) stage 1 or (b) stage 2 of zero1_mpi's torch binding."""
    model = build_model(dims)
    options = {} if args.bucket_elements is None else {"bucket_elements": args.bucket_elements}
    if stage == 2:
        options["shard_gradients"] = True
        if args.grad_staging is not None:
            options["grad_staging"] = args.grad_staging
    opt = ZeroOptimizer(model, "adamw", comm, overlap=True, max_grad_norm=None,
                        param_dtype=dtype, lr=args.lr, weight_decay=WEIGHT_DECAY, **options)
    extra = {"bytes": 0}

    def micro_context(m):
        if stage == 1 and m < accumulate - 1:
            return opt.no_sync()
        return contextlib.nullcontext()

    def probe(point, m):
        if point != "step":
            return
        # torch gradient tensors alive at the step beside the optimizer's buffers
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if not opt.sharded_gradients and np.shares_memory(as_array(p.grad),
                                                              opt.sharded.grads[name]):
                continue
            extra["bytes"] += p.grad.nbytes

    out = train(comm, model, batches, args,
                input_dtype=next(model.parameters()).dtype, micro_context=micro_context,
                step=opt.step, probe=probe)
    opt.wait()  # the last all-gather, before the buffers go
    report = opt.memory_report()
    mine = report.total + extra["bytes"]
    out.update(bytes=comm.allreduce(mine, op=MPI.MAX),
               breakdown={"optimizer_total": report.total, "parameters": report.parameters,
                          "gradients": report.gradients,
                          "master_weights": report.master_weights,
                          "state": sum(report.state.values()), "padding": report.padding,
                          "comm_scratch": report.comm_scratch,
                          "torch_grads_outside": extra["bytes"]})
    return out


def run_fsdp_cell(comm, dims, batches, dtype, accumulate, args, group) -> dict:
    """(c), or ``{"skipped": "<exact error>", "errors": [each rank's or None]}`` when FSDP2
    raises on any rank (all ranks agree on it; a rank left waiting by another's failure raises
    gloo's timeout after 120 s)."""
    error = group["error"]
    out = None
    if error is None:
        try:
            if not group["ready"]:
                common.init_gloo(comm)
                group["ready"] = True
            out = run_fsdp(comm, dims, batches, dtype, accumulate, args)
        except Exception as exc:  # noqa: BLE001 (reported, never hidden)
            error = f"{type(exc).__name__}: {exc}".strip()
            if not group["ready"]:
                group["error"] = f"gloo process group: {error}"
    errors = comm.allgather(error)
    gc.collect()
    failed = {rank: e for rank, e in enumerate(errors) if e}
    if not failed:
        return out
    # Ranks that waited on a failed one time out: name each rank's own error.
    reason = next(iter(failed.values())) if len(set(failed.values())) == 1 else \
        "; ".join(f"rank {rank}: {first_line(e)}" for rank, e in failed.items())
    return {"skipped": reason, "errors": errors}


def run_fsdp(comm, dims, batches, dtype, accumulate, args) -> dict:
    # here, not at the top: a torch without FSDP2 makes its cells "skipped", with the error
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model = build_model(dims)
    options, input_dtype = {"reshard_after_forward": False}, torch.float32
    if dtype == "bfloat16" and args.fsdp_bf16 == "mixed":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    elif dtype != "float32":
        model = model.to(getattr(torch, dtype))
        input_dtype = getattr(torch, dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **options)
    fully_shard(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)

    def fsdp_params():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:
                    one = getattr(state, "_fsdp_param_group", None)
                    groups = [] if one is None else [one]
                for param_group in groups:
                    yield from param_group.fsdp_params

    held = {}

    def probe(point, m):
        params = list(model.parameters())
        if point == "forward" and m == accumulate - 1:
            # reshard_after_forward=False: the gathered parameters are the module's now
            held["unsharded_params"] = local_bytes(p for p in params
                                                   if not isinstance(p, DTensor))
        elif point == "backward" and m == accumulate - 2:
            # between micro-batches without sync: the unsharded gradients summed so far
            held["unsharded_grads"] = local_bytes(
                fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None
                else fp._unsharded_param.grad for fp in fsdp_params())
        elif point == "step":
            held["sharded_params"] = local_bytes(params)
            held["sharded_grads"] = local_bytes(p.grad for p in params)
            held["state"] = local_bytes(t for s in opt.state.values() for t in s.values())

    def micro_context(m):
        last = m == accumulate - 1
        if accumulate > 1:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def step():
        opt.step()
        opt.zero_grad()

    out = train(comm, model, batches, args, input_dtype=input_dtype,
                micro_context=micro_context, step=step, probe=probe)
    held.setdefault("unsharded_grads", 0)
    mine = sum(held.values())
    out.update(bytes=comm.allreduce(mine, op=MPI.MAX), breakdown=held,
               config={**{k: str(v) for k, v in options.items()},
                       "module_dtype": str(next(model.parameters()).dtype)})
    return out


def local_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's local shard), each counted once;
    None, non-tensors and 0-d tensors (AdamW's step counters) left out."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if t.dim() > 0 and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
