"""examples/gpt_torch.py on 2 ranks, at a tiny size (skipped where torch is not installed).

- float32: the zero1_mpi run's loss curve equals DistributedDataParallel + torch.optim.AdamW's
  on the same batches, step by step (the tolerance of tests/test_example_torch_autograd.py);
  with matplotlib installed, ``--plot`` writes a PNG.
- bfloat16 (the default): a run whose last rank is SIGKILLed resumes from its last checkpoint
  and goes on with the losses, bit for bit, of an uninterrupted run; the sample is printed.
- ``--plot`` without matplotlib stops before training with a message that says so.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os

import pytest

from mpirun import ROOT, run_mpi

torch = pytest.importorskip("torch")

EXAMPLE = "examples/gpt_torch.py"
LAUNCH = "mpiexec -n 4 python -m mpi4py examples/gpt_torch.py"
TINY = ("--layers", "2", "--dim", "32", "--heads", "2", "--context", "32", "--batch", "8",
        "--sample", "0", "--log-every", "5")
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run(*args: str, check: bool = True, env: dict | None = None):
    """``(returncode, stdout + stderr)`` of the tiny example on 2 ranks."""
    result = run_mpi(2, EXAMPLE, *TINY, *args, check=check, env=env, timeout=150)
    return result.returncode, result.stdout + result.stderr


def losses(out: str) -> list[float]:
    line = next((line for line in out.splitlines() if line.startswith("losses: ")), None)
    assert line, out
    return json.loads(line[len("losses: "):])


@pytest.mark.mpi_independent
def test_docstring_opens_with_launch_command():
    doc = ast.get_docstring(ast.parse((ROOT / EXAMPLE).read_text(encoding="utf-8")))
    assert doc.splitlines()[0].strip() == LAUNCH


@pytest.mark.mpi_independent
def test_float32_matches_ddp_and_plots(tmp_path):
    """zero1_mpi.torch.ZeroOptimizer and DDP + torch.optim.AdamW, both driven by the same torch
    LR scheduler (warm-up, then cosine): the same losses step by step."""
    plot = tmp_path / "loss.png"
    schedule = ("--schedule", "cosine", "--warmup", "4")
    _, out = run("--dtype", "float32", "--steps", "16", *schedule,
                 *(("--plot", str(plot)) if HAVE_MATPLOTLIB else ()))
    assert "world_size=2 dtype=float32 " in out and "optimizer=zero1_mpi" in out, out
    assert "schedule=cosine" in out and "tokens/s" in out, out
    ours = losses(out)
    _, out = run("--dtype", "float32", "--steps", "16", *schedule, "--reference", "ddp")
    assert "optimizer=DDP + torch.optim.AdamW" in out, out
    ddp = losses(out)
    assert len(ours) == len(ddp) == 16
    assert ours[-1] < 0.85 * ours[0]                        # it learns
    assert ours == pytest.approx(ddp, rel=1e-4, abs=1e-7)   # step by step, like DDP
    if HAVE_MATPLOTLIB:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# (a SIGKILLed rank ending the job, under every MPI: tests/test_mpi_library.py; a resume bit
# for bit, under every MPI: tests/test_checkpoint.py)
@pytest.mark.mpi_independent
def test_killed_bfloat16_run_resumes_where_it_was(tmp_path):
    """Checkpoints every 5 steps, the last rank SIGKILLed at step 8: the job ends; resumed,
    it starts at step 5 and its losses are those of an uninterrupted run, bit for bit (with a
    warm-up and cosine schedule: the learning rate resumes too)."""
    steps = ("--steps", "12", "--schedule", "cosine", "--warmup", "3")
    ckpt = str(tmp_path / "ckpt")
    _, out = run(*steps, "--sample", "40")
    assert "dtype=bfloat16 " in out and "\nsample:\n" in out, out
    uninterrupted = losses(out)
    assert len(uninterrupted) == 12 and uninterrupted[-1] < 0.9 * uninterrupted[0]

    rc, out = run(*steps, "--checkpoint", ckpt, "--save-every", "5", "--crash-at-step", "8",
                  check=False)
    assert rc != 0 and "crash: rank 1 kills itself at step 8" in out, out
    assert "losses:" not in out, out
    assert [p.name.split("-")[1] for p in (tmp_path / "ckpt").glob("ckpt-*")] == ["00000005"]

    _, out = run(*steps, "--checkpoint", ckpt, "--save-every", "5", "--resume")
    assert "resumed from" in out and "ckpt-00000005" in out, out
    assert losses(out) == uninterrupted[5:]


@pytest.mark.mpi_independent
def test_plot_without_matplotlib_says_so_before_training(tmp_path):
    hide = tmp_path / "hide" / "matplotlib"  # an import of matplotlib that fails, as if missing
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    path = os.pathsep.join([str(hide.parent), str(ROOT), str(ROOT / "tests")])
    rc, out = run("--plot", str(tmp_path / "loss.png"), check=False, env={"PYTHONPATH": path})
    assert rc != 0, out
    assert "--plot needs matplotlib, which is not installed here" in out, out
    assert "pip install matplotlib" in out and "step " not in out, out
    assert "Traceback" not in out, out


@pytest.mark.mpi_independent
def test_fused_reference_trains_in_one_process_and_matches_in_float32():
    """``--reference fused``: torch.optim.AdamW(fused=True) in one process, the device
    script's tokens/s yardstick; in fp32 on one rank its losses are zero1_mpi's."""
    def one_rank(*args):
        return run_mpi(1, EXAMPLE, *TINY, "--dtype", "float32", "--steps", "8", *args,
                       timeout=150).stdout
    fused, ours = one_rank("--reference", "fused"), one_rank()
    assert "optimizer=torch.optim.AdamW(fused=True)" in fused and "device=cpu" in fused
    assert losses(fused) == pytest.approx(losses(ours), rel=1e-4, abs=1e-7)
    rc, out = run("--reference", "fused", check=False)
    assert rc != 0 and "--reference fused trains in one process: run it on 1 rank" in out


@pytest.mark.mpi_independent  # (the 8-bit paths' bits under every MPI: tests/cases/wire.py)
def test_8bit_collectives_through_the_torch_binding():
    """``--reduce-dtype int8 --gather-dtype int8 --error-feedback``: it trains, and ends near
    the 16-bit run (the loss curves of issue 28 are tools/gpt_losses.py's)."""
    _, out = run("--steps", "30")
    plain = losses(out)
    _, out = run("--steps", "30", "--reduce-dtype", "int8", "--gather-dtype", "int8",
                 "--error-feedback")
    int8 = losses(out)
    assert int8[-1] < int8[0] - 0.5, int8
    assert abs(sum(int8[-5:]) - sum(plain[-5:])) / sum(plain[-5:]) < 0.05, (int8, plain)


@pytest.mark.mpi_independent  # (the modes' numerics: tests/cases/masters.py, state_dtypes.py)
def test_state_modes_through_the_torch_binding():
    """``--masters fp32`` and the default (remainder masters) give the same losses, bit for bit;
    ``--state-dtype bfloat16`` and ``int8`` train and end near them (the 1,000-step curves of
    issue 29 are ``tools/gpt_losses.py --compare state``'s)."""
    _, out = run("--steps", "20", "--masters", "fp32")
    fp32 = losses(out)
    _, out = run("--steps", "20")
    assert losses(out) == fp32
    for dtype in ("bfloat16", "int8"):
        _, out = run("--steps", "20", "--state-dtype", dtype)
        got = losses(out)
        assert got[-1] < got[0] - 0.5, (dtype, got)
        assert abs(sum(got[-5:]) - sum(fp32[-5:])) / sum(fp32[-5:]) < 0.05, (dtype, got, fp32)


@pytest.mark.mpi_independent  # (stage 3's numerics: tests/cases/torch_stage3.py)
def test_stage3_trains_the_gpt_as_stage2_does():
    """``--stage 3`` (each block a unit, the tied embedding in the root unit; the sample drawn
    after ``unbind()``): the losses of ``--stage 2`` within the rounding of the clipping norm's
    sum, which the units' layout changes."""
    _, out = run("--steps", "12", "--stage", "2")
    stage2 = losses(out)
    _, out = run("--steps", "12", "--stage", "3", "--sample", "5")
    stage3 = losses(out)
    assert "stage=3 " in out and "sample:" in out, out
    assert max(abs(a - b) for a, b in zip(stage2, stage3)) < 1e-3, (stage2, stage3)
