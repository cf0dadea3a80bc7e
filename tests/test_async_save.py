"""Non-blocking saves (``save(..., blocking=False)``): tests/cases/async_save.py on 3 ranks
and with hierarchical sharding (4 ranks in groups of 2: the replicas write nothing); a job
killed while the background write is under way keeps the previous checkpoint
(tests/cases/checkpoint_crash.py's ``background`` moment)."""

import subprocess
import sys

import pytest

from mpirun import ROOT, SIBLING, run_mpi


@pytest.mark.parametrize("n, group", [SIBLING(3, None), (4, 2)])
def test_non_blocking_saves(tmp_path, n, group):
    args = [str(tmp_path)] + ([] if group is None else [str(group)])
    out = run_mpi(n, "async_save.py", *args, timeout=240).stdout
    assert f"OK non-blocking saves on {n} ranks, shard_group_size={group or n}" in out


@pytest.mark.mpi_independent
def test_the_training_benchmark_reports_the_held_and_overlapped_steps():
    """`tools/bench.py checkpoint --training`: one row per world size, the host copy's size."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "checkpoint",
                             "--training", "--params", "200K", "--ranks", "2", "--steps", "2"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 8 and all(c.endswith(" s") for c in cells[1:4]), row
    # bf16 Adam: master, exp_avg, exp_avg_sq and the parameters, 4 bytes each, half of 200K
    assert cells[7] == f"{round(4 * 4 * 100_000 / 2**20)} MiB", row
