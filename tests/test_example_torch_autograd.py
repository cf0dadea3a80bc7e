"""examples/torch_autograd.py on 2 ranks (skipped where torch is not installed): a torch model
whose parameters and ``.grad`` are views of the flat buffers trains with zero1_mpi to the loss
curve of DistributedDataParallel + torch.optim.AdamW, step by step; with ``--overlap``
(reductions started from post-accumulate-grad hooks, gathers completed by a forward pre-hook)
to the same losses bit for bit; in bfloat16 it learns and ``--plot`` writes the curve."""

import json

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

torch = pytest.importorskip("torch")


def losses(*args):
    out = run_mpi(2, "examples/torch_autograd.py", "--steps", "60", *args, timeout=300).stdout
    line = next(line for line in out.splitlines() if line.startswith("losses: "))
    return json.loads(line[len("losses: "):])


@pytest.fixture(scope="module")
def plain():
    """The plain loop's losses (fp32), which two tests compare with."""
    return losses()


def test_torch_model_on_flat_buffers_matches_ddp(plain):
    ddp = losses("--reference", "ddp")
    assert len(plain) == len(ddp) == 60
    assert plain[-1] < 0.2 * plain[0]                       # it learns
    assert plain == pytest.approx(ddp, rel=1e-4, abs=1e-7)  # step by step, like DDP


def test_overlap_through_autograd_hooks_changes_nothing(plain):
    assert losses("--overlap") == plain


def test_torch_model_in_bfloat16_learns(tmp_path):
    png = tmp_path / "loss.png"
    curve = losses("--dtype", "bfloat16", "--plot", str(png))
    assert curve[-1] < 0.2 * curve[0]
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot wrote the loss curve
