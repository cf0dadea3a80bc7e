"""`tools/bench.py stage3` at a tiny size: 2 ranks, a 1024->64->64->1024 MLP, 2 steps, float32.
The table has the four rows with numbers, stages 1, 2 and 3 end at the same loss, and stage 3
holds fewer bytes than stage 1 once the model outweighs the working buffers (the MLP of 64)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("(a) zero1_mpi stage 1", "(b) zero1_mpi stage 2", "(c) zero1_mpi stage 3",
          "(d) FSDP2")


def test_tiny_run_has_four_rows_and_the_stages_agree(tmp_path):
    pytest.importorskip("torch")
    if shutil.which("mpiexec") is None and not os.environ.get("ZERO1_MPIEXEC"):
        pytest.skip("mpiexec not on PATH (pip install mpich)")
    out = tmp_path / "stage3.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "ZERO1_MPI_KERNEL": "numpy"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "stage3", "--ranks", "2",
         "--dtypes", "float32", "--model", "mlp:64", "--batch", "8", "--steps", "2",
         "--warmup", "1", "--timeout", "100", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | float32 | (")]
    assert [next(label for label in LABELS if label in r) for r in rows] == list(LABELS), rows
    (result,) = json.loads(out.read_text())
    (cell,) = result["cells"]
    losses = [cell[f"stage{s}"]["loss"] for s in (1, 2, 3)]
    assert losses[0] == losses[1] == losses[2], losses  # fp32, no clipping: the same bits
    s1, s3 = cell["stage1"]["breakdown"], cell["stage3"]["breakdown"]
    assert s3["parameters"] * 2 <= s1["parameters"] + 4 * 64 * 2, (s1, s3)  # its shard alone
    assert "ratios" in cell and cell["ratios"]["loss_max_rel_diff"] == 0.0
