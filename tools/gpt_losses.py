"""The GPT example's loss under each choice of a comparison, over seeds:

    python tools/gpt_losses.py [--compare wire|state] [--ranks 4] [--steps 600]
        [--seeds 0,1] [--out DIR] [--plot FILE]

Runs ``examples/gpt_torch.py`` (bf16 parameters, ``mpiexec -n RANKS``) for each seed and each
choice. ``--compare wire`` (issue 28): ``bf16`` (16-bit gradients summed in fp32, 16-bit
gathers), ``int8`` (``--reduce-dtype int8 --gather-dtype int8``), ``int8+ef`` (with
``--error-feedback``), ``int8 reduce`` (16-bit gathers). ``--compare state`` (issue 29): ``fp32
state`` (fp32 masters and moments), ``remainder`` (remainder masters: the same bits),
``bf16 state`` (remainders and bf16 moments), ``int8 state`` (remainders and 8-bit moments).
The first choice is the baseline. The final loss
is the mean over the last ``--tail`` steps (one step's loss is noisy). Prints, per choice, the
final loss of each seed (and its difference from the baseline's of the same seed), whether it
ends within the baseline's range over the seeds or 1% of their mean, whichever is wider
("in range"), and whether each seed's difference from the baseline's same seed is within the
baseline's run-to-run spread (its seeds' max - min: "paired"); writes every loss curve to
DIR/losses.json and plots them. The learning
rate is annealed (``--schedule cosine``, default) so that the runs end comparable; with a
constant rate, runs that differ by any rounding drift apart mid-descent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zero1_mpi.launcher import launch_command  # noqa: E402

COMPARISONS = {
    "wire": {
        "bf16": [],
        "int8": ["--reduce-dtype", "int8", "--gather-dtype", "int8"],
        "int8+ef": ["--reduce-dtype", "int8", "--gather-dtype", "int8", "--error-feedback"],
        "int8 reduce": ["--reduce-dtype", "int8"],
    },
    "state": {
        "fp32 state": ["--masters", "fp32"],
        "remainder": ["--masters", "remainder"],
        "bf16 state": ["--masters", "remainder", "--state-dtype", "bfloat16"],
        "int8 state": ["--masters", "remainder", "--state-dtype", "int8"],
    },
}
STYLES = ("k", "tab:blue", "tab:orange", "tab:green", "tab:red")


def run(ranks: int, steps: int, seed: int, name: str, flags, out: Path, extra=()) -> list[float]:
    path = out / f"{name.replace(' ', '_').replace('+', '_')}-seed{seed}.json"
    if not path.exists():
        program = [sys.executable, "-m", "mpi4py", str(ROOT / "examples" / "gpt_torch.py"),
                   "--steps", str(steps), "--seed", str(seed), "--sample", "0", "--log-every",
                   "100", "--losses", str(path), *flags, *extra]
        command, env = launch_command(ranks, program, environ={**os.environ,
                                                               "OMP_NUM_THREADS": "1"})
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        print(f"{name}, seed {seed}: done", flush=True)
    return json.loads(path.read_text())["losses"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", default="wire", choices=list(COMPARISONS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tail", type=int, default=50)
    parser.add_argument("--out", help="where the runs' losses go (default: <compare>_losses)")
    parser.add_argument("--plot", help="a PNG of the curves")
    parser.add_argument("--schedule", default="cosine", choices=["constant", "cosine"],
                        help="the example's LR schedule (default cosine: annealed to the end, "
                        "so that the final losses compare)")
    args = parser.parse_args(argv)
    choices = COMPARISONS[args.compare]
    out = Path(args.out or f"{args.compare}_losses")
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = ["--schedule", args.schedule]
    curves = {name: {s: run(args.ranks, args.steps, s, name, flags, out, extra) for s in seeds}
              for name, flags in choices.items()}
    final = {name: {s: sum(c[-args.tail:]) / args.tail for s, c in runs.items()}
             for name, runs in curves.items()}
    first = next(iter(choices))
    base = list(final[first].values())
    mean = sum(base) / len(base)
    lo, hi = min(min(base), 0.99 * mean), max(max(base), 1.01 * mean)  # whichever is wider
    print(f"final loss: mean of the last {args.tail} of {args.steps} steps, {args.ranks} ranks, "
          f"{args.schedule} LR; {first} {mean:.4f} (seeds {min(base):.4f}..{max(base):.4f}); "
          f"target {lo:.4f}..{hi:.4f}")
    spread = max(base) - min(base)
    for name, by_seed in final.items():
        values = " ".join(f"seed {s}: {v:.4f} ({v / final[first][s] - 1:+.2%})"
                          for s, v in by_seed.items())
        ok = all(lo <= v <= hi for v in by_seed.values())
        paired = all(abs(v - final[first][s]) <= spread for s, v in by_seed.items())
        print(f"  {name:<12} {values}   {'in range' if ok else 'OUT OF RANGE'}, "
              f"{'paired within' if paired else 'paired OUTSIDE'} the spread {spread:.4f}")
    (out / "losses.json").write_text(json.dumps({"args": vars(args), "final": final,
                                                 "curves": curves}) + "\n")
    if args.plot:
        plot(args.plot, curves, args)
    return 0


def plot(path, curves, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(curves.items(), STYLES):
        for seed, values in runs.items():
            ax.plot(smooth(values, 50), color=color, linewidth=1.0,
                    linestyle="-" if seed == min(runs) else "--", label=f"{name}, seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of the last 50 steps)")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"GPT example, {args.ranks} ranks, bf16 parameters, {args.schedule} LR: "
                 f"{', '.join(curves)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def smooth(values, width):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


if __name__ == "__main__":
    sys.exit(main())
