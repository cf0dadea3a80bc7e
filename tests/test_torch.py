"""PyTorch as the reference and as a gradient source (skipped where torch is not installed).

- ZeroAdam/ZeroAdamW on 1-4 ranks against torch.optim.Adam/AdamW + clip_grad_norm_.
- examples/torch_autograd.py: a torch model whose parameters and .grad are views of the flat
  buffers trains with zero1_mpi to the same loss curve as DistributedDataParallel + AdamW.
"""

import json

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_with_torch_optim(n):
    out = run_mpi(n, "torch_parity.py", timeout=300).stdout
    assert f"OK torch parity: 4 cases x 25 steps on {n} ranks" in out


def losses(n, *args):
    out = run_mpi(n, "examples/torch_autograd.py", "--steps", "60", *args, timeout=300).stdout
    line = next(line for line in out.splitlines() if line.startswith("losses: "))
    return json.loads(line[len("losses: "):])


@pytest.mark.parametrize("n", [2, 4])
def test_torch_model_on_flat_buffers_matches_ddp(n):
    ours, ddp = losses(n), losses(n, "--reference", "ddp")
    assert len(ours) == len(ddp) == 60
    assert ours[-1] < 0.2 * ours[0]                       # it learns
    assert ours == pytest.approx(ddp, rel=1e-4, abs=1e-7)  # step by step, like DDP


def test_torch_model_in_bfloat16_learns(tmp_path):
    png = tmp_path / "loss.png"
    curve = losses(2, "--dtype", "bfloat16", "--plot", str(png))
    assert curve[-1] < 0.2 * curve[0]
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot wrote the loss curve


def test_overlap_through_autograd_hooks_changes_nothing():
    """Reductions started from post-accumulate-grad hooks, gathers completed by a forward
    pre-hook: the same losses, bit for bit, as the plain loop."""
    assert losses(2, "--overlap") == losses(2)
