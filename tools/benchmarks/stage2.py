"""Stage 2 (gradient sharding) on a torch model, beside stage 1 and FSDP2: time and bytes.

What gradient sharding (ZeRO stage 2) costs on a torch client, measured beside stage 1 and
FSDP2. For each world size N (--ranks), parameter dtype (--dtypes) and number of micro-batches
per step (--accumulate) it trains the same torch MLP (--model mlp: 1024->4096->4096->1024 with
GELUs, 25M parameters, as the step benchmark's; mlp:H: hidden size H) from the same seed on the
same per-rank batches (--batch rows each, MSE loss against random targets, each micro-batch's
loss divided by the count) with AdamW (lr --lr, weight decay 0.01, no clipping), three ways:

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
    --fsdp-bf16 module, a bf16 module (no fp32 master). Accumulating, every micro-batch but
    the last runs with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(
    False)`` (no communication, the parameters stay gathered: they are held anyway). A cell that
    FSDP2 cannot run is printed as skipped with the exact error.

Per cell: the median over --steps (after --warmup) of the step time of the slowest rank
(each rank times every step, from the end of the previous one to the end of its own, with no
barrier; the per-step maximum over ranks is taken after the run); bytes per rank, the largest
rank's: zero1_mpi's ``opt.memory_report().total`` plus torch gradient tensors alive at the step
that are not views of its buffers (stage 1: the ``.grad`` are views, 0; stage 2: ``.grad`` is
None after each hook, 0); FSDP2's local shards (``to_local()``) of the parameters, gradients and
AdamW state, plus the unsharded parameters it keeps after forward (``reshard_after_forward=
False``), plus, accumulating, the unsharded gradients it holds between micro-batches. Neither
counts activations or transient collective buffers; zero1_mpi's total includes its
communication scratch (stage 2: ``grad_staging`` staging buckets of ``bucket_elements``), which
on a small model can outweigh what sharding the gradients saves (--bucket-elements sets the
buckets of both stages, --grad-staging stage 2's count). And the loss (mean over ranks and
micro-batches) at the last step of each, with their largest relative difference.
One ``mpiexec -n N`` job per N, measuring its cells in turn.
"""

from __future__ import annotations

import argparse

from . import common

RANKS, TIMEOUT = "2,4", 1800
IMPLEMENTATIONS = (("stage1", "(a) zero1_mpi stage 1"), ("stage2", "(b) zero1_mpi stage 2"),
                   ("fsdp2", "(c) FSDP2 reshard_after_forward=False"))
WEIGHT_DECAY = 0.01
SEED = 1234


def mlp_dims(model: str) -> tuple[int, ...]:
    """``mlp``: 1024->4096->4096->1024 (the step benchmark's 25M MLP); ``mlp:H``: hidden size H;
    ``mlp:HxL``: L hidden layers of size H (``mlp:1024x24``: 24 layers, 25M parameters)."""
    if model == "mlp":
        return (1024, 4096, 4096, 1024)
    hidden, _, layers = model[4:].partition("x")
    if model.startswith("mlp:") and hidden.isdigit() and int(hidden) > 0:
        if not layers:
            return (1024, int(hidden), int(hidden), 1024)
        if layers.isdigit() and int(layers) > 0:
            return (1024, *[int(hidden)] * int(layers), 1024)
    raise argparse.ArgumentTypeError(
        f"{model!r}: use mlp, mlp:<hidden size> or mlp:<hidden size>x<layers>")


def param_count(dims) -> int:
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def worker(args) -> dict:
    from .stage2_torch import measure
    return measure(args)


# -- reporting ---------------------------------------------------------------------------------

def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0].replace("|", "/")


def max_rel_diff(losses: list[float]) -> float:
    ref = abs(losses[0]) or 1.0
    return max(abs(a - b) for a in losses for b in losses) / ref


def table(results: list[dict]) -> str:
    """The two tables; each cell gains its ``ratios`` (written by --json too)."""
    lines = [common.row("N", "dtype", "micro-batches", "implementation", "step ms", "MiB/rank",
                        "loss (last step)"), common.rule("rlrlrrr")]
    for r in results:
        for c in r["cells"]:
            for key, label in IMPLEMENTATIONS:
                x, head = c[key], (r["world_size"], c["dtype"], c["accumulate"])
                lines.append(common.row(*head, f"{label}: skipped: {first_line(x['skipped'])}",
                                        "-", "-", "-") if "skipped" in x else
                             common.row(*head, label, f"{x['step_s'] * 1e3:.1f}",
                                        f"{x['bytes'] / 2**20:.2f}", f"{x['loss']:.6g}"))
    lines += ["", common.row("N", "dtype", "micro-batches", "stage2/stage1 time",
                             "stage2/stage1 bytes", "FSDP2/stage2 time", "FSDP2/stage2 bytes",
                             "loss max rel diff"), common.rule("rlrrrrrr")]
    for r in results:
        for c in r["cells"]:
            s1, s2, f = c["stage1"], c["stage2"], c["fsdp2"]
            ran = "skipped" not in f
            losses = [s1["loss"], s2["loss"]] + ([f["loss"]] if ran else [])
            c["ratios"] = q = {"stage2_stage1_time": s2["step_s"] / s1["step_s"],
                               "stage2_stage1_bytes": s2["bytes"] / s1["bytes"],
                               "loss_max_rel_diff": max_rel_diff(losses),
                               "stage1_stage2_loss_rel_diff": max_rel_diff(losses[:2])}
            if ran:
                q.update(fsdp2_stage2_time=f["step_s"] / s2["step_s"],
                         fsdp2_stage2_bytes=f["bytes"] / s2["bytes"])
            fsdp = [f"{q['fsdp2_stage2_time']:.2f}x", f"{q['fsdp2_stage2_bytes']:.2f}x"] \
                if ran else ["-", "-"]
            lines.append(common.row(r["world_size"], c["dtype"], c["accumulate"],
                                    f"{q['stage2_stage1_time']:.2f}x",
                                    f"{q['stage2_stage1_bytes']:.2f}x", *fsdp,
                                    f"{q['loss_max_rel_diff']:.1e}"))
    return "\n".join(lines)


def model(text: str) -> str:
    mlp_dims(text)
    return text


def dtypes(text: str) -> list[str]:
    found = text.split(",")
    for d in found:
        if d not in ("float32", "bfloat16"):
            raise argparse.ArgumentTypeError(f"{d!r} is not float32 or bfloat16")
    return found


def options(parser) -> None:
    parser.add_argument("--dtypes", type=dtypes, default="float32,bfloat16",
                        help="parameter dtypes (float32, bfloat16)")
    parser.add_argument("--accumulate", type=common.comma_list(common.at_least(1)), default="1,4",
                        help="micro-batches per step, e.g. 1,4")
    parser.add_argument("--model", type=model, default="mlp",
                        help="mlp (25M), mlp:<hidden size> or mlp:<hidden size>x<layers>")
    parser.add_argument("--batch", type=common.at_least(1), default=32,
                        help="rows per micro-batch per rank")
    common.steps(parser, 10, warmup=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-elements", type=int,
                        help="zero1_mpi's bucket size in elements (default: the engine's)")
    parser.add_argument("--grad-staging", type=int,
                        help="stage 2's staging buckets (default: the engine's)")
    parser.add_argument("--fsdp-bf16", choices=["mixed", "module"], default="mixed",
                        help="FSDP2's bf16: MixedPrecisionPolicy(param_dtype=bf16, "
                        "reduce_dtype=fp32) over fp32 shards (default), or a bf16 module")


def report(args, results: list[dict]) -> list[dict]:
    r0 = results[0]
    text = table(results)
    print(f"torch MLP {'->'.join(map(str, r0['dims']))} ({r0['psi'] / 1e6:.2f}M parameters), "
          f"{r0['batch']} rows per micro-batch per rank, AdamW, one thread per rank, median "
          f"of {r0['steps']} steps after {r0['warmup']} (slowest rank), torch {r0['torch']}, "
          f"FSDP2 over gloo (bf16: {r0['fsdp_bf16']}), zero1_mpi buckets: "
          f"{r0['bucket_elements'] or 'default'} elements, stage 2 staging: "
          f"{r0['grad_staging'] or 'default'}\n")
    print(text)
    return results
