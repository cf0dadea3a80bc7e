"""python tools/stage2_bench.py [--ranks 2,4] [--dtypes float32,bfloat16] [--accumulate 1,4]
[--model mlp] [--batch 32] [--steps 10] [--warmup 3] [--bucket-elements E] [--grad-staging S]
[--fsdp-bf16 mixed|module] [--json F] [--mpiexec CMD]

What gradient sharding (ZeRO stage 2) costs on a torch client, measured beside stage 1 and
FSDP2. For each world size N (``--ranks``), parameter dtype (``--dtypes``) and number of
micro-batches per step (``--accumulate``) it trains the same torch MLP (``--model mlp``:
1024->4096->4096->1024 with GELUs, 25M parameters, as ``bench_worker``'s; ``mlp:H``: hidden size
H) from the same seed on the same per-rank batches (``--batch`` rows each, MSE loss against
random targets, each micro-batch's loss divided by the count) with AdamW (lr ``--lr``,
weight decay 0.01, no clipping), three ways:

(a) stage 1: ``zero1_mpi.torch.ZeroOptimizer(model, "adamw", comm, overlap=True,
    max_grad_norm=None, param_dtype=dtype)``; accumulating, every backward but the last runs
    inside ``with opt.no_sync():`` (the full gradient buffer sums them; one reduce-scatter per
    step);
(b) stage 2: the same with ``shard_gradients=True``: every micro-batch's backward hands its
    gradients over from the post-accumulate-grad hooks (one reduce-scatter per micro-batch into
    the gradient shard);
(c) FSDP2: ``fully_shard(module, reshard_after_forward=False)`` on each Linear and on the root,
    ``torch.optim.AdamW`` (foreach), over gloo; bf16 through ``MixedPrecisionPolicy(param_dtype=
    bf16, reduce_dtype=fp32)`` (fp32 sharded parameters: its master weights) or, with
    ``--fsdp-bf16 module``, a bf16 module (no fp32 master). Accumulating, every micro-batch but
    the last runs with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(
    False)`` (no communication, the parameters stay gathered: they are held anyway). A cell that
    FSDP2 cannot run is printed as skipped with the exact error.

Per cell: the median over ``--steps`` (after ``--warmup``) of the step time of the slowest rank
(each rank times every step, from the end of the previous one to the end of its own, with no
barrier; the per-step maximum over ranks is taken after the run); bytes per rank, the largest
rank's: zero1_mpi's ``opt.memory_report().total`` plus torch gradient tensors alive at the step
that are not views of its buffers (stage 1: the ``.grad`` are views, 0; stage 2: ``.grad`` is
None after each hook, 0); FSDP2's local shards (``to_local()``) of the parameters, gradients and
AdamW state, plus the unsharded parameters it keeps after forward (``reshard_after_forward=
False``), plus, accumulating, the unsharded gradients it holds between micro-batches. Neither
counts activations or transient collective buffers; zero1_mpi's total includes its
communication scratch (stage 2: ``grad_staging`` staging buckets of ``bucket_elements``), which
on a small model can outweigh what sharding the gradients saves (``--bucket-elements`` sets the
buckets of both stages, ``--grad-staging`` stage 2's count). And the loss (mean over ranks and
micro-batches) at the last step of each, with their largest relative difference.

One thread per rank (torch and BLAS). One ``mpiexec -n N`` job per N (``tools/launch.py``),
measuring its cells in turn. ``--json`` writes all numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread per rank, for every library

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(ROOT))  # this checkout's zero1_mpi, whatever else is installed

from launch import run_ranks  # noqa: E402

IMPLEMENTATIONS = (("stage1", "(a) zero1_mpi stage 1"), ("stage2", "(b) zero1_mpi stage 2"),
                   ("fsdp2", "(c) FSDP2 reshard_after_forward=False"))
WEIGHT_DECAY = 0.01
SEED = 1234


def mlp_dims(model: str) -> tuple[int, ...]:
    """``mlp``: 1024->4096->4096->1024 (bench_worker's 25M MLP); ``mlp:H``: hidden size H."""
    if model == "mlp":
        return (1024, 4096, 4096, 1024)
    if model.startswith("mlp:") and model[4:].isdigit() and int(model[4:]) > 0:
        hidden = int(model[4:])
        return (1024, hidden, hidden, 1024)
    raise SystemExit(f"--model {model!r}: use mlp or mlp:<hidden size>")


def param_count(dims) -> int:
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


# -- the worker: runs on every rank ------------------------------------------------------------

def worker(args) -> dict:
    import numpy as np
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    dims = mlp_dims(args.model)
    result = {"world_size": comm.Get_size(), "model": args.model, "dims": list(dims),
              "psi": param_count(dims), "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "lr": args.lr, "fsdp_bf16": args.fsdp_bf16,
              "bucket_elements": args.bucket_elements, "grad_staging": args.grad_staging,
              "torch": torch.__version__, "cells": []}
    group = {"error": None, "ready": False}
    for dtype in args.dtypes.split(","):
        for accumulate in (int(a) for a in args.accumulate.split(",")):
            batches = make_batches(torch, comm.Get_rank(), dims, args, accumulate)
            cell = {"dtype": dtype, "accumulate": accumulate}
            for stage in (1, 2):
                cell[f"stage{stage}"] = run_zero(np, torch, MPI, comm, dims, batches, dtype,
                                                 accumulate, stage, args)
                gc.collect()  # its buffers go before the next run allocates
            cell["fsdp2"] = run_fsdp_cell(np, torch, MPI, comm, dims, batches, dtype,
                                          accumulate, args, group)
            result["cells"].append(cell)
    if group["ready"]:
        import torch.distributed as dist
        dist.destroy_process_group()
    return result


def make_batches(torch, rank: int, dims, args, accumulate: int) -> list:
    """This rank's micro-batches ``[iteration][micro-batch] = (x, y)`` in fp32, the same for
    every implementation: warmup + steps iterations and one more for the byte count."""
    gen = torch.Generator().manual_seed(SEED * 7919 + rank)
    return [[(torch.randn(args.batch, dims[0], generator=gen),
              torch.randn(args.batch, dims[-1], generator=gen))
             for _ in range(accumulate)] for _ in range(args.warmup + args.steps + 1)]


def build_model(torch, dims):
    torch.manual_seed(SEED)  # the same initial values on every rank and for every run
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def train(np, torch, MPI, comm, model, batches, args, *, input_dtype, micro_context, step,
          probe=None) -> dict:
    """``warmup + steps`` timed iterations, then one untimed one that calls ``probe(point,
    micro_batch)`` at "forward" (after each forward), "backward" (after each backward) and
    "step" (before the step). Returns the median step time of the slowest rank and the loss
    (mean over ranks and micro-batches) at the last timed step."""
    import torch.nn.functional as F

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


def run_zero(np, torch, MPI, comm, dims, batches, dtype: str, accumulate: int, stage: int,
             args) -> dict:
    """(a) stage 1 or (b) stage 2 of zero1_mpi's torch binding."""
    from zero1_mpi.torch import ZeroOptimizer, as_array

    model = build_model(torch, dims)
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

    out = train(np, torch, MPI, comm, model, batches, args,
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


def init_gloo(torch, comm) -> None:
    """gloo's rendezvous as examples/gpt_torch.py's setup_ddp: rank 0 serves a TCPStore on a
    port the OS picks, MPI tells the others."""
    from datetime import timedelta

    import torch.distributed as dist
    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                          wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None)
    store = store or dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def run_fsdp_cell(np, torch, MPI, comm, dims, batches, dtype, accumulate, args, group) -> dict:
    """(c), or ``{"skipped": "<exact error>", "errors": [each rank's or None]}`` when FSDP2
    raises on any rank (all ranks agree on it; a rank left waiting by another's failure raises
    gloo's timeout after 120 s)."""
    error = group["error"]
    out = None
    if error is None:
        try:
            if not group["ready"]:
                init_gloo(torch, comm)
                group["ready"] = True
            out = run_fsdp(np, torch, MPI, comm, dims, batches, dtype, accumulate, args)
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


def run_fsdp(np, torch, MPI, comm, dims, batches, dtype, accumulate, args) -> dict:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model = build_model(torch, dims)
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

    def local_bytes(tensors) -> int:
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

    out = train(np, torch, MPI, comm, model, batches, args, input_dtype=input_dtype,
                micro_context=micro_context, step=step, probe=probe)
    held.setdefault("unsharded_grads", 0)
    mine = sum(held.values())
    out.update(bytes=comm.allreduce(mine, op=MPI.MAX), breakdown=held,
               config={**{k: str(v) for k, v in options.items()},
                       "module_dtype": str(next(model.parameters()).dtype)})
    return out


# -- reporting ---------------------------------------------------------------------------------

def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0].replace("|", "/")


def max_rel_diff(losses: list[float]) -> float:
    ref = abs(losses[0]) or 1.0
    return max(abs(a - b) for a in losses for b in losses) / ref


def table(results: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| N | dtype | micro-batches | implementation | step ms | MiB/rank | "
             "loss (last step) |", "|---:|---|---:|---|---:|---:|---:|"]
    for r in results:
        for c in r["cells"]:
            head = f"| {r['world_size']} | {c['dtype']} | {c['accumulate']} |"
            for key, label in IMPLEMENTATIONS:
                x = c[key]
                if "skipped" in x:
                    lines.append(f"{head} {label}: skipped: {first_line(x['skipped'])} | - | "
                                 "- | - |")
                else:
                    lines.append(f"{head} {label} | {x['step_s'] * 1e3:.1f} | "
                                 f"{x['bytes'] / mib:.2f} | {x['loss']:.6g} |")
    lines += ["", "| N | dtype | micro-batches | stage2/stage1 time | stage2/stage1 bytes | "
              "FSDP2/stage2 time | FSDP2/stage2 bytes | loss max rel diff |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for c in r["cells"]:
            s1, s2, f = c["stage1"], c["stage2"], c["fsdp2"]
            ran = "skipped" not in f
            losses = [s1["loss"], s2["loss"]] + ([f["loss"]] if ran else [])
            c["ratios"] = {"stage2_stage1_time": s2["step_s"] / s1["step_s"],
                           "stage2_stage1_bytes": s2["bytes"] / s1["bytes"],
                           "loss_max_rel_diff": max_rel_diff(losses),
                           "stage1_stage2_loss_rel_diff": max_rel_diff(losses[:2])}
            if ran:
                c["ratios"].update(fsdp2_stage2_time=f["step_s"] / s2["step_s"],
                                   fsdp2_stage2_bytes=f["bytes"] / s2["bytes"])
            q = c["ratios"]
            fsdp = (f"{q['fsdp2_stage2_time']:.2f}x | {q['fsdp2_stage2_bytes']:.2f}x" if ran
                    else "- | -")
            lines.append(f"| {r['world_size']} | {c['dtype']} | {c['accumulate']} | "
                         f"{q['stage2_stage1_time']:.2f}x | {q['stage2_stage1_bytes']:.2f}x | "
                         f"{fsdp} | {q['loss_max_rel_diff']:.1e} |")
    return "\n".join(lines)


def parse(argv=None, worker_mode=False):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, one mpiexec job each")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="parameter dtypes (float32, bfloat16)")
    parser.add_argument("--accumulate", default="1,4", help="micro-batches per step")
    parser.add_argument("--model", default="mlp", help="mlp (25M) or mlp:<hidden size>")
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-elements", type=int,
                        help="zero1_mpi's bucket size in elements (default: the engine's)")
    parser.add_argument("--grad-staging", type=int,
                        help="stage 2's staging buckets (default: the engine's)")
    parser.add_argument("--fsdp-bf16", choices=["mixed", "module"], default="mixed",
                        help="FSDP2's bf16: MixedPrecisionPolicy(param_dtype=bf16, "
                        "reduce_dtype=fp32) over fp32 shards (default), or a bf16 module")
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--mpiexec", help="MPI launcher, flags allowed "
                        "(default: $ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mpiexec job")
    parser.add_argument("--worker", action="store_true",
                        help="(internal) measure on this job's ranks, print one JSON line")
    args = parser.parse_args(argv)
    mlp_dims(args.model)
    for d in args.dtypes.split(","):
        if d not in ("float32", "bfloat16"):
            parser.error(f"--dtypes: {d!r} is not float32 or bfloat16")
    if any(int(a) < 1 for a in args.accumulate.split(",")) or args.steps < 1 \
            or args.warmup < 0 or args.batch < 1:
        parser.error("--accumulate, --steps and --batch must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        result = worker(args)
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(result), flush=True)
        return 0
    forwarded = ["--worker", "--dtypes", args.dtypes, "--accumulate", args.accumulate,
                 "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--lr", repr(args.lr),
                 "--fsdp-bf16", args.fsdp_bf16]
    for flag, value in (("--bucket-elements", args.bucket_elements),
                        ("--grad-staging", args.grad_staging)):
        if value is not None:
            forwarded += [flag, str(value)]
    results = []
    for n in (int(x) for x in args.ranks.split(",")):
        results.append(run_ranks(n, str(Path(__file__).resolve()), forwarded, args.mpiexec,
                                 args.timeout))
        print(f"N={n} done", file=sys.stderr, flush=True)
    r0 = results[0]
    text = table(results)
    print(f"torch MLP {'->'.join(map(str, r0['dims']))} ({r0['psi'] / 1e6:.2f}M parameters), "
          f"{r0['batch']} rows per micro-batch per rank, AdamW, one thread per rank, median "
          f"of {r0['steps']} steps after {r0['warmup']} (slowest rank), torch {r0['torch']}, "
          f"FSDP2 over gloo (bf16: {r0['fsdp_bf16']}), zero1_mpi buckets: "
          f"{r0['bucket_elements'] or 'default'} elements, stage 2 staging: "
          f"{r0['grad_staging'] or 'default'}\n")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
