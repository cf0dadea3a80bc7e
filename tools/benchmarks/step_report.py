"""The step benchmark's report (``step.py``): its four markdown tables and the optional plot."""

from __future__ import annotations

from zero1_mpi.rules.registry import builtin_rules

from .common import row, rule

PHASES = ("reduce", "optimizer", "gather")
MIB = 2 ** 20


def report(args, results: list[dict]) -> list[dict]:
    r0 = results[0]
    print(f"{r0['model']}: {r0['psi'] / 1e6:.1f}M {r0['dtype']} parameters, "
          f"{rule_label(args.optimizer)}, CPU kernel {r0['kernel']}, one thread per rank, "
          f"median of {args.steps} steps\n")
    print(table(results))
    if args.plot and not plot(results, args.plot):
        print("(no plot: matplotlib is not installed)")
    return results


def rule_label(name: str) -> str:
    """``Adam``, ``SGD``, ``Lion``, ``LAMB``: the rule ``name``'s optimizer, for tables."""
    return builtin_rules()[name].optimizer.__name__.removeprefix("Zero")


def total(r: dict) -> float:
    return sum(r[p] for p in PHASES if p in r)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def table(results: list[dict]) -> str:
    lines = [row("N", "implementation", "reduce ms", "optimizer ms", "gather ms", "total ms",
                 "bytes/rank", "optimizer state/rank"), rule("rlrrrrrr")]
    label = rule_label(results[0].get("optimizer", "adam"))
    for r in results:
        for key, name in (("baseline", f"(a) DP: Allreduce + full {label}"),
                          ("zero1", "(b) zero1_mpi"),
                          ("torch_zero", "(c) torch ZeroRedundancyOptimizer")):
            if key == "torch_zero" and "torch_zero_skipped" in r:
                lines.append(row(r["world_size"], f"{name}: skipped, {r['torch_zero_skipped']}",
                                 *"------"))
            if key in r:
                x = r[key]
                lines.append(row(r["world_size"], name, ms(x["reduce"]), ms(x["optimizer"]),
                                 ms(x.get("gather", 0)), ms(total(x)),
                                 f"{x['bytes'] / MIB:.0f} MiB",
                                 f"{x['state_bytes'] / MIB:.0f} MiB"))
    lines += ["", row("N", "(b)/(a) total", "(b)/(c) total", "(b) RS+AG / (a) Allreduce",
                      "(b) optimizer vs N=1"), rule("rrrrr")]
    first = results[0]["zero1"]["optimizer"] if results[0]["world_size"] == 1 else None
    for r in results:
        z, a = r["zero1"], r["baseline"]
        vs_c = f"{total(z) / total(r['torch_zero']):.2f}x" if "torch_zero" in r else "-"
        comm_ratio = "-" if r["world_size"] == 1 else \
            f"{(z['reduce'] + z['gather']) / a['reduce']:.2f}x"
        vs_1 = f"{z['optimizer'] / first:.2f}x" if first else "-"
        lines.append(row(r["world_size"], f"{total(z) / total(a):.2f}x", vs_c, comm_ratio, vs_1))
    reference = results[0]["kernels"].get("reference", "torch_fused_adamw")
    lines += ["", row("N", "kernel", "G elements/s per rank", "GB/s", "of in-place stream",
                      f"vs {reference}"), rule("rlrrrr")]
    for r in results:
        k = r["kernels"]
        for name in [key for key in k if key.startswith(("zero1", "torch"))]:
            ref = reference_rate(k, name)
            vs = f"{k[name]['Gelem_per_s'] / ref:.2f}x" if ref else "-"
            lines.append(row(r["world_size"], name, f"{k[name]['Gelem_per_s']:.2f}",
                             f"{k[name]['GBps']:.1f}",
                             f"{k[name]['GBps'] / k['stream_GBps']:.0%}", vs))
    lines += ["", row("N", "backward ms", "reduce left in step(), blocking",
                      "... overlapped with grads_ready()", "hidden",
                      "iteration ms blocking / overlapped"), rule("rrrrrr")]
    for r in results:
        o = r.get("overlap")
        if o and r["world_size"] > 1:
            b, v = o["blocking"], o["overlapped"]
            lines.append(row(r["world_size"], ms(b["backward"]), ms(b["reduce_in_step"]),
                             ms(v["reduce_in_step"]), f"{o['hidden_fraction']:.0%}",
                             f"{ms(b['iteration'])} / {ms(v['iteration'])}"))
    return "\n".join(lines)


def reference_rate(kernels: dict, name: str) -> float | None:
    """The reference's elements/s for the row ``name``: torch's one row, or the NumPy twin's
    row with the same input (16-bit gradients in, or fp32 sums)."""
    reference = kernels.get("reference", "torch_fused_adamw")
    if reference == "zero1_numpy" and " " in name:
        reference += name[name.index(" "):]
    return kernels.get(reference, {}).get("Gelem_per_s")


def plot(results: list[dict], file: str) -> bool:
    """Time split and bytes per rank against N, as a PNG; False without matplotlib."""
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
                   [r[key]["bytes"] / MIB for r in results], marker="o", label=key)
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
