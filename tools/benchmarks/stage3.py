"""Stage 3 (parameter sharding) on a torch model, beside stages 1, 2 and FSDP2: time and bytes.

What sharding the parameters too (ZeRO stage 3) costs and saves on a torch client. For each
world size N (--ranks) and parameter dtype (--dtypes) it trains the same torch MLP as the
stage 2 benchmark (--model mlp: 1024->4096->4096->1024 with GELUs, 25M parameters; mlp:H:
hidden size H) from the same seed on the same per-rank batches (--batch rows, MSE loss, one
micro-batch a step) with AdamW (lr --lr, weight decay 0.01, no clipping), four ways:

(a) stage 1: ``ZeroOptimizer(model, "adamw", comm, overlap=True, param_dtype=dtype)``;
(b) stage 2: ``shard_gradients=True``;
(c) stage 3: ``shard_params=True`` (each Linear a unit: gathered for its forward and again for
    its backward, freed between, the next one prefetched);
(d) FSDP2: ``fully_shard`` on each Linear and the root with ``reshard_after_forward=True``
    (its stage 3), ``torch.optim.AdamW`` (foreach) over gloo; bf16 as the stage 2 benchmark's
    ``--fsdp-bf16``. A cell FSDP2 cannot run is printed as skipped with the exact error.

Per cell: the median step time of the slowest rank over --steps after --warmup; the bytes the
largest rank holds at the step: zero1_mpi's ``memory_report().total`` (stage 3: its working
buffers included, two of the largest unit's size), FSDP2's local shards of the parameters,
gradients and AdamW state (its unsharded buffers are freed by then); and the loss at the last
step. Activations and transient collective buffers are not counted. One job per N.
"""

from __future__ import annotations

from . import common
from .stage2 import dtypes, first_line, max_rel_diff, mlp_dims, model, param_count  # noqa: F401

RANKS, TIMEOUT = "2,4", 1800
IMPLEMENTATIONS = (("stage1", "(a) zero1_mpi stage 1"), ("stage2", "(b) zero1_mpi stage 2"),
                   ("stage3", "(c) zero1_mpi stage 3"),
                   ("fsdp2", "(d) FSDP2 reshard_after_forward=True"))


def worker(args) -> dict:
    from .stage3_torch import measure
    return measure(args)


def table(results: list[dict]) -> str:
    """The two tables; each cell gains its ``ratios`` (written by --json too)."""
    lines = [common.row("N", "dtype", "implementation", "step ms", "MiB/rank",
                        "loss (last step)"), common.rule("rlrrrr")]
    for r in results:
        for c in r["cells"]:
            for key, label in IMPLEMENTATIONS:
                x, head = c[key], (r["world_size"], c["dtype"])
                lines.append(common.row(*head, f"{label}: skipped: {first_line(x['skipped'])}",
                                        "-", "-", "-") if "skipped" in x else
                             common.row(*head, label, f"{x['step_s'] * 1e3:.1f}",
                                        f"{x['bytes'] / 2**20:.2f}", f"{x['loss']:.6g}"))
    lines += ["", common.row("N", "dtype", "stage3/stage1 time", "stage3/stage1 bytes",
                             "stage3/stage2 bytes", "FSDP2/stage3 time", "FSDP2/stage3 bytes",
                             "loss max rel diff"), common.rule("rlrrrrrr")]
    for r in results:
        for c in r["cells"]:
            s1, s2, s3, f = c["stage1"], c["stage2"], c["stage3"], c["fsdp2"]
            ran = "skipped" not in f
            losses = [s1["loss"], s2["loss"], s3["loss"]] + ([f["loss"]] if ran else [])
            c["ratios"] = q = {"stage3_stage1_time": s3["step_s"] / s1["step_s"],
                               "stage3_stage1_bytes": s3["bytes"] / s1["bytes"],
                               "stage3_stage2_bytes": s3["bytes"] / s2["bytes"],
                               "loss_max_rel_diff": max_rel_diff(losses)}
            if ran:
                q.update(fsdp2_stage3_time=f["step_s"] / s3["step_s"],
                         fsdp2_stage3_bytes=f["bytes"] / s3["bytes"])
            fsdp = [f"{q['fsdp2_stage3_time']:.2f}x", f"{q['fsdp2_stage3_bytes']:.2f}x"] \
                if ran else ["-", "-"]
            lines.append(common.row(r["world_size"], c["dtype"],
                                    f"{q['stage3_stage1_time']:.2f}x",
                                    f"{q['stage3_stage1_bytes']:.2f}x",
                                    f"{q['stage3_stage2_bytes']:.2f}x", *fsdp,
                                    f"{q['loss_max_rel_diff']:.1e}"))
    return "\n".join(lines)


def options(parser) -> None:
    parser.add_argument("--dtypes", type=dtypes, default="float32,bfloat16",
                        help="parameter dtypes (float32, bfloat16)")
    parser.add_argument("--model", type=model, default="mlp",
                        help="mlp (25M), mlp:<hidden size> or mlp:<hidden size>x<layers>")
    parser.add_argument("--batch", type=common.at_least(1), default=32,
                        help="rows per micro-batch per rank")
    common.steps(parser, 10, warmup=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fsdp-bf16", choices=["mixed", "module"], default="mixed",
                        help="FSDP2's bf16: MixedPrecisionPolicy(param_dtype=bf16, "
                        "reduce_dtype=fp32) over fp32 shards (default), or a bf16 module")


def report(args, results: list[dict]) -> list[dict]:
    r0 = results[0]
    print(f"torch MLP {'->'.join(map(str, r0['dims']))} ({r0['psi'] / 1e6:.2f}M parameters), "
          f"{r0['batch']} rows per rank, AdamW, one thread per rank, median of {r0['steps']} "
          f"steps after {r0['warmup']} (slowest rank), torch {r0['torch']}, FSDP2 over gloo "
          f"(bf16: {r0['fsdp_bf16']})\n")
    print(table(results))
    return results
