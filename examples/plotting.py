"""Plots for the examples: ``save_plot(path, title, panels)`` writes one PNG with a panel per
``(label, values)`` against the step, with matplotlib when it is installed; without it, it says
how to install it and writes nothing (training is never affected)."""

from __future__ import annotations


def save_plot(path, title: str, panels, first_step: int = 0) -> bool:
    """Write ``panels`` (``[(y label, values per step), ...]``) to ``path``; True if written."""
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib)", flush=True)
        return False
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.4 * len(panels) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (label, values) in zip(axes[:, 0], panels):
        ax.plot(range(first_step, first_step + len(values)), values, linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"--plot: wrote {path}", flush=True)
    return True
