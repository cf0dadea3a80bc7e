"""The stage 3 benchmark's measurement (``stage3.py``), on every rank of a job: a torch MLP
trained through zero1_mpi's stages 1, 2 and 3 and through FSDP2 with
``reshard_after_forward=True``. Imported only by the worker."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from mpi4py import MPI

from zero1_mpi.torch import ZeroOptimizer

from . import common
from .stage2 import WEIGHT_DECAY, first_line, mlp_dims, param_count
from .stage2_torch import build_model, local_bytes, make_batches, train


def measure(args) -> dict:
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    dims = mlp_dims(args.model)
    result = {"world_size": comm.Get_size(), "model": args.model, "dims": list(dims),
              "psi": param_count(dims), "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "lr": args.lr, "fsdp_bf16": args.fsdp_bf16,
              "torch": torch.__version__, "cells": []}
    ready = False
    for dtype in args.dtypes:
        batches = make_batches(comm.Get_rank(), dims, args, 1)
        cell = {"dtype": dtype}
        for stage in (1, 2, 3):
            cell[f"stage{stage}"] = run_zero(comm, dims, batches, dtype, stage, args)
            gc.collect()
        error = out = None
        try:
            if not ready:
                common.init_gloo(comm)
                ready = True
            out = run_fsdp(comm, dims, batches, dtype, args)
        except Exception as exc:  # noqa: BLE001 (reported, never hidden)
            error = f"{type(exc).__name__}: {exc}".strip()
        errors = [e for e in comm.allgather(error) if e]
        cell["fsdp2"] = {"skipped": first_line(errors[0])} if errors else out
        gc.collect()
        result["cells"].append(cell)
    if ready:
        dist.destroy_process_group()
    return result


def run_zero(comm, dims, batches, dtype: str, stage: int, args) -> dict:
    model = build_model(dims)
    kind = {1: {"overlap": True}, 2: {"shard_gradients": True},
            3: {"shard_params": True}}[stage]
    opt = ZeroOptimizer(model, "adamw", comm, max_grad_norm=None, param_dtype=dtype,
                        lr=args.lr, weight_decay=WEIGHT_DECAY, **kind)
    out = train(comm, model, batches, args, input_dtype=getattr(torch, dtype),
                micro_context=lambda m: contextlib.nullcontext(), step=opt.step)
    opt.wait()
    report = opt.memory_report()
    out.update(bytes=comm.allreduce(report.total, op=MPI.MAX),
               breakdown={"parameters": report.parameters, "gradients": report.gradients,
                          "master_weights": report.master_weights,
                          "state": sum(report.state.values()), "padding": report.padding,
                          "comm_scratch": report.comm_scratch})
    opt.close()
    return out


def run_fsdp(comm, dims, batches, dtype, args) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(dims)
    options, input_dtype = {"reshard_after_forward": True}, torch.float32
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
    held = {}

    def probe(point, m):
        if point == "step":
            params = list(model.parameters())
            held["sharded_params"] = local_bytes(params)
            held["sharded_grads"] = local_bytes(p.grad for p in params)
            held["state"] = local_bytes(t for s in opt.state.values() for t in s.values())

    def step():
        opt.step()
        opt.zero_grad()

    out = train(comm, model, batches, args, input_dtype=input_dtype,
                micro_context=lambda m: contextlib.nullcontext(), step=step, probe=probe)
    out.update(bytes=comm.allreduce(sum(held.values()), op=MPI.MAX), breakdown=held)
    return out
