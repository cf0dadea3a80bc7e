"""`tools/bench.py stage2` at a tiny size: 2 ranks, a 1024->64->64->1024 MLP, 2 steps, float32,
1 and 2 micro-batches. The table has the three rows of each cell with numbers, stage 1 and
stage 2 end at the same loss, and FSDP2 runs wherever torch has it and gloo (else its rows say
why they were skipped)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("(a) zero1_mpi stage 1", "(b) zero1_mpi stage 2", "(c) FSDP2")


def fsdp2_available() -> bool:
    import torch.distributed as dist
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


def test_tiny_run_has_three_rows_per_cell_and_stage_1_and_2_agree(tmp_path):
    pytest.importorskip("torch")
    if shutil.which("mpiexec") is None and not os.environ.get("ZERO1_MPIEXEC"):
        pytest.skip("mpiexec not on PATH (pip install mpich)")
    out = tmp_path / "stage2.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "ZERO1_MPI_KERNEL": "numpy"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "stage2", "--ranks", "2",
         "--dtypes", "float32", "--accumulate", "1,2", "--model", "mlp:64", "--batch", "8",
         "--steps", "2", "--warmup", "1", "--timeout", "50", "--json", str(out)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | float32 |")]
    fsdp_runs = fsdp2_available()
    for accumulate in (1, 2):
        cell = [r for r in rows if r.startswith(f"| 2 | float32 | {accumulate} | (")]
        assert [next(label for label in LABELS if label in r) for r in cell] == list(LABELS)
        for row in cell:
            fields = [f.strip() for f in row.strip("|").split("|")]
            if "skipped:" in fields[3]:
                assert row.startswith(f"| 2 | float32 | {accumulate} | (c) FSDP2"), row
                assert not fsdp_runs, f"FSDP2 is importable with gloo, yet: {row}"
                assert re.search(r"skipped: \S", fields[3]), row  # with its reason
                continue
            step_ms, mib, loss = (float(x) for x in fields[4:7])
            assert step_ms > 0 and mib > 0 and loss > 0, row
    ratios = [r for r in proc.stdout.splitlines() if re.match(r"\| 2 \| float32 \| [12] \| \d", r)]
    assert len(ratios) == 2, proc.stdout

    (result,) = json.loads(out.read_text())
    assert result["world_size"] == 2 and len(result["cells"]) == 2
    for cell in result["cells"]:
        s1, s2, fsdp = cell["stage1"]["loss"], cell["stage2"]["loss"], cell["fsdp2"]
        assert abs(s1 - s2) <= 1e-5 * abs(s1), cell
        # stage 2 holds a gradient shard, no full gradient: fewer gradient bytes than stage 1
        assert cell["stage2"]["breakdown"]["gradients"] * 2 == \
            cell["stage1"]["breakdown"]["gradients"]
        assert cell["stage2"]["breakdown"]["torch_grads_outside"] == 0
        if fsdp_runs:
            assert "skipped" not in fsdp, fsdp
            assert abs(fsdp["loss"] - s1) <= 1e-4 * abs(s1), cell
