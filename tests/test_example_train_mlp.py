"""examples/train_mlp.py runs under ``mpiexec -n N python -m mpi4py`` and its loss falls.

Each case launches the example as a user would (``mpiexec`` from ``tests/mpirun.py``), with a
timeout that kills the whole process group, and checks the header and the machine-checkable
last line ``final: first_loss=... last_loss=...``.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import time
from pathlib import Path

import pytest

from mpirun import run_mpi

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_mlp.py"
LAUNCH = "mpiexec -n 4 python -m mpi4py examples/train_mlp.py"


def run_example(n: int, *args: str, env: dict | None = None, timeout: float = 120):
    """``(returncode, stdout + stderr)`` of the example on ``n`` ranks."""
    env = {"ZERO1_MPI_KERNEL": "auto", **(env or {})}  # as a user runs it: Numba if installed
    result = run_mpi(n, "examples/train_mlp.py", *args, env=env, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi_independent
@pytest.mark.parametrize("n, dtype", [(1, "float32"), (2, "bfloat16"), (4, "float16")])
def test_loss_falls(n, dtype, tmp_path):
    """(fp32 on 4 ranks: the uninterrupted run of the resume test below.) On 2 ranks
    ``--plot`` writes a PNG, or says that matplotlib is missing."""
    png = tmp_path / "loss.png"
    plot = ("--plot", str(png)) if n == 2 else ()
    rc, out = run_example(n, "--steps", "60", "--dtype", dtype, "--log-every", "20", *plot)
    assert rc == 0, out
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert "matplotlib is not installed" in out and not png.exists(), out
        else:
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out, out
    assert f"world_size={n} " in out and f"dtype={dtype} " in out, out
    family = "numba" if importlib.util.find_spec("numba") else "numpy"  # (ZERO1_MPI_KERNEL unset)
    assert f"backend=numpy kernels={family} " in out, out
    assert "ms/step" in out and "bytes/rank" in out, out
    final = re.search(r"^final: first_loss=(\S+) last_loss=(\S+)$", out, re.MULTILINE)
    assert final, out
    first, last = map(float, final.groups())
    assert first == pytest.approx(math.log(10), abs=1e-3), out   # zero output layer
    assert last < 0.5 * first, out


@pytest.mark.mpi_independent
def test_docstring_opens_with_launch_command():
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text(encoding="utf-8")))
    assert doc.splitlines()[0].strip() == LAUNCH


def test_slurm_ntasks_mismatch_fails_on_every_rank():
    rc, out = run_example(2, "--steps", "5", env={"SLURM_NTASKS": "3"}, timeout=60)
    assert rc != 0, out
    assert "SLURM_NTASKS=3 but MPI.COMM_WORLD.size=2" in out, out
    assert "srun --mpi=pmix" in out, out


def final_losses(out: str) -> tuple[float, float]:
    found = re.search(r"^final: first_loss=(\S+) last_loss=(\S+)$", out, re.MULTILINE)
    assert found, out
    return float(found.group(1)), float(found.group(2))


# (under every MPI: a SIGKILLed rank, tests/test_mpi_library.py; checkpoints loaded on other
# world sizes, tests/test_checkpoint.py)
@pytest.mark.mpi_independent
def test_a_killed_run_resumes_on_fewer_ranks_and_reaches_the_same_loss(tmp_path):
    """4 ranks, checkpoints every 20 steps, the last rank SIGKILLed at step 50: the job ends;
    2 ranks resume from step 40 and end where an uninterrupted 4-rank run does (the global
    batch is the same at any world size; only the order of the sums over ranks differs)."""
    steps, ckpt = ("--steps", "60", "--log-every", "30"), str(tmp_path / "ckpt")
    rc, out = run_example(4, *steps)
    assert rc == 0, out
    uninterrupted = final_losses(out)[1]

    start = time.monotonic()
    rc, out = run_example(4, *steps, "--checkpoint", ckpt, "--save-every", "20",
                          "--crash-at-step", "50")
    assert rc != 0 and "crash: rank 3 kills itself at step 50" in out, out
    assert "final:" not in out and time.monotonic() - start < 60, out
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "ckpt").glob("ckpt-*")) == \
        ["00000020", "00000040"]

    rc, out = run_example(2, *steps, "--checkpoint", ckpt, "--save-every", "20")
    assert rc == 0 and "at step 40" in out and "world_size=2 " in out, out
    assert final_losses(out)[1] == pytest.approx(uninterrupted, rel=1e-4), out


def test_batch_must_divide_among_the_ranks():
    rc, out = run_example(3, "--steps", "2", "--batch", "256", timeout=60)
    assert rc != 0 and "--batch 256 is not divisible by the 3 ranks" in out, out


@pytest.mark.mpi_independent
def test_plot_without_matplotlib_writes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    from plotting import save_plot
    assert save_plot(tmp_path / "x.png", "t", [("loss", [1.0, 0.5])]) is False
    assert "pip install matplotlib" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


@pytest.mark.mpi_independent
def test_stage3_trains_as_stage2_and_holds_its_shard():
    """``--stage 3``: each layer gathered in its block, the gradients handed over there; the
    same losses as ``--stage 2`` (the same gradient shards), and the Stage 3 formula."""
    finals = {}
    for stage in (2, 3):
        rc, out = run_example(2, "--steps", "20", "--dtype", "bfloat16", "--stage", str(stage))
        assert rc == 0 and f"stage={stage} " in out, out
        finals[stage] = re.search(r"^final: .*$", out, re.MULTILINE).group(0)
        if stage == 3:
            assert "formula 14Ψ/N" in out, out
    assert finals[2] == finals[3], finals
