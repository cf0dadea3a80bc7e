"""python tools/bench.py --ranks 1,2,4 [--optimizer adam] [--model mlp] [--dtype float32]
[--json F] [--plot F]

Measures, side by side in one run on the same parameters and gradients, one optimizer step of
(a) plain data parallelism: an ``Allreduce`` of the gradients, then the full update on every
    rank (the seed's baseline), with the same fused kernel as (b);
(b) zero1_mpi: ``Reduce_scatter`` (or ``Alltoall`` + fp32 sum), the update on the owned shard,
    ``Allgather``;
(c) ``torch.distributed.optim.ZeroRedundancyOptimizer`` over gloo wrapping the torch reference
    optimizer, after an all-reduce of the gradients (what DDP does), when torch is installed and
    has the optimizer (fp32 only).
For each: the step split into gradient reduction, optimizer math and parameter gathering (median
over ``--steps`` after ``--warmup``, the slowest rank each time), bytes per rank, and ratios; and
the throughput of the kernels alone (ours, NumPy and Numba, and the reference; for 16-bit, torch
doing the same job: grads to fp32, its update, fp32 to 16-bit params) against the in-place
read-write stream bandwidth measured in the same run (``a += b`` over fp32 arrays as large as
the kernel's, bytes counted as for the kernel: the gradient read, the master weights and each
state array read and written; LAMB's two passes move more than that). Each rank uses one thread.

``--optimizer`` picks any rule of ``zero1_mpi.rules.registry`` (``bench_worker.KNOWN``): ``adam``
(the default) is AdamW against ``torch.optim.AdamW(fused=True)``; ``sgd`` is SGD with momentum
0.9 against ``torch.optim.SGD(momentum=0.9, foreach=True)``; the others (Lion, LAMB) have no
torch optimizer: their reference is the rule's NumPy float32 twin at the same thread count, and
(c) is skipped.

With ``--ranks`` it launches ``tools/bench_worker.py`` under ``mpiexec -n N`` for each N and
prints one markdown table for all; under ``mpiexec`` without ``--ranks`` it measures that world
size in-process. ``--json`` writes all numbers; ``--plot`` writes a PNG (time split and bytes
per rank against N; needs matplotlib). ``--model mlp`` is the 25M-parameter MLP
1024->4096->4096->1024; ``--model flat:16M`` one flat tensor of that many elements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_worker  # noqa: E402 (sets one thread per rank before NumPy loads)
from bench_worker import PHASES, has_torch, rule_label  # noqa: E402
from launch import run_ranks  # noqa: E402

from zero1_mpi.rules.registry import builtin_rules  # noqa: E402

# -- reporting -------------------------------------------------------------------------------

def total(r: dict) -> float:
    return sum(r[p] for p in PHASES if p in r)


def table(results: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| N | implementation | reduce ms | optimizer ms | gather ms | total ms | "
             "bytes/rank | optimizer state/rank |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    rule = rule_label(results[0].get("optimizer", "adam"))
    for r in results:
        for key, label in (("baseline", f"(a) DP: Allreduce + full {rule}"),
                           ("zero1", "(b) zero1_mpi"),
                           ("torch_zero", "(c) torch ZeroRedundancyOptimizer")):
            if key == "torch_zero" and "torch_zero_skipped" in r:
                lines.append(f"| {r['world_size']} | {label}: skipped, "
                             f"{r['torch_zero_skipped']} | - | - | - | - | - | - |")
            if key in r:
                x = r[key]
                lines.append(f"| {r['world_size']} | {label} | {x['reduce'] * 1e3:.1f} | "
                             f"{x['optimizer'] * 1e3:.1f} | {x.get('gather', 0) * 1e3:.1f} | "
                             f"{total(x) * 1e3:.1f} | {x['bytes'] / mib:.0f} MiB | "
                             f"{x['state_bytes'] / mib:.0f} MiB |")
    lines += ["", "| N | (b)/(a) total | (b)/(c) total | (b) RS+AG / (a) Allreduce | "
              "(b) optimizer vs N=1 |", "|---:|---:|---:|---:|---:|"]
    first = results[0]["zero1"]["optimizer"] if results[0]["world_size"] == 1 else None
    for r in results:
        z, a = r["zero1"], r["baseline"]
        vs_c = f"{total(z) / total(r['torch_zero']):.2f}x" if "torch_zero" in r else "-"
        comm_ratio = "-" if r["world_size"] == 1 else \
            f"{(z['reduce'] + z['gather']) / a['reduce']:.2f}x"
        vs_1 = f"{z['optimizer'] / first:.2f}x" if first else "-"
        lines.append(f"| {r['world_size']} | {total(z) / total(a):.2f}x | {vs_c} | "
                     f"{comm_ratio} | {vs_1} |")
    reference = results[0]["kernels"].get("reference", "torch_fused_adamw")
    lines += ["", f"| N | kernel | G elements/s per rank | GB/s | of in-place stream | "
              f"vs {reference} |", "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        k = r["kernels"]
        for name in [key for key in k if key.startswith(("zero1", "torch"))]:
            if name in k:
                ref = reference_rate(k, name)
                vs = f"{k[name]['Gelem_per_s'] / ref:.2f}x" if ref else "-"
                lines.append(f"| {r['world_size']} | {name} | {k[name]['Gelem_per_s']:.2f} | "
                             f"{k[name]['GBps']:.1f} | {k[name]['GBps'] / k['stream_GBps']:.0%} | "
                             f"{vs} |")
    lines += ["", "| N | backward ms | reduce left in step(), blocking | ... overlapped with "
              "grads_ready() | hidden | iteration ms blocking / overlapped |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        o = r.get("overlap")
        if o and r["world_size"] > 1:
            b, v = o["blocking"], o["overlapped"]
            lines.append(f"| {r['world_size']} | {b['backward'] * 1e3:.1f} | "
                         f"{b['reduce_in_step'] * 1e3:.1f} | {v['reduce_in_step'] * 1e3:.1f} | "
                         f"{o['hidden_fraction']:.0%} | {b['iteration'] * 1e3:.1f} / "
                         f"{v['iteration'] * 1e3:.1f} |")
    return "\n".join(lines)


def reference_rate(kernels: dict, name: str) -> float | None:
    """The reference's elements/s for the row ``name``: torch's one row, or the NumPy twin's
    row with the same input (16-bit gradients in, or fp32 sums)."""
    reference = kernels.get("reference", "torch_fused_adamw")
    if reference == "zero1_numpy" and " " in name:
        reference += name[name.index(" "):]
    return kernels.get(reference, {}).get("Gelem_per_s")


def plot(results: list[dict], file: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = [k for k in ("baseline", "zero1", "torch_zero") if k in results[0]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [j + i * width for j in range(len(results))]
        bottom = [0.0] * len(results)
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange", "tab:green")):
            heights = [r[key].get(phase, 0) * 1e3 for r in results]
            left.bar(xs, heights, width, bottom=bottom, color=color,
                     label=phase if i == 0 else None, edgecolor="black", linewidth=0.3)
            bottom = [b + h for b, h in zip(bottom, heights)]
        right.plot([r["world_size"] for r in results],
                   [r[key]["bytes"] / 2 ** 20 for r in results], marker="o", label=key)
    left.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(results))],
                    [f"N={r['world_size']}" for r in results])
    left.set_ylabel("ms per step (bars: " + ", ".join(keys) + ")")
    left.legend()
    right.set_xlabel("ranks N")
    right.set_xticks([r["world_size"] for r in results])
    right.set_ylabel("MiB per rank")
    right.legend()
    fig.suptitle(f"{results[0]['model']} ({results[0]['psi'] / 1e6:.1f}M params, "
                 f"{results[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", help="launch mpiexec for each N (e.g. 1,2,4)")
    parser.add_argument("--optimizer", default="adam", choices=list(builtin_rules()),
                        help="the update rule measured, against its reference (default adam)")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    parser.add_argument("--mpiexec", help="MPI launcher, flags allowed "
                        "(default: $ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args(argv)
    args.torch = has_torch()

    if args.ranks:
        results = []
        for n in (int(x) for x in args.ranks.split(",")):
            forwarded = ["--optimizer", args.optimizer, "--model", args.model,
                         "--dtype", args.dtype,
                         "--steps", str(args.steps), "--warmup", str(args.warmup)]
            results.append(run_ranks(n, bench_worker.__file__, forwarded, args.mpiexec,
                                     args.timeout))
            print(f"N={n} done", file=sys.stderr, flush=True)
    else:
        result = bench_worker.worker(args)
        if _rank() != 0:
            return 0
        results = [result]
    r0 = results[0]
    print(f"{r0['model']}: {r0['psi'] / 1e6:.1f}M {r0['dtype']} parameters, "
          f"{rule_label(args.optimizer)}, CPU kernel {r0['kernel']}, one thread per rank, "
          f"median of {args.steps} steps\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and not plot(results, args.plot):
        print("(no plot: matplotlib is not installed)")
    return 0


def _rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


if __name__ == "__main__":
    sys.exit(main())
