"""examples/train_mlp.py runs under ``mpiexec -n N python -m mpi4py`` and its loss falls.

Each case launches the example as a user would (``mpiexec`` from ``tests/mpirun.py``), with a
timeout that kills the whole process group, and checks the header and the machine-checkable
last line ``final: first_loss=... last_loss=...``.
"""

from __future__ import annotations

import ast
import math
import re
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


@pytest.mark.parametrize("n, dtype", [(1, "float32"), (2, "float32"), (4, "float32"),
                                      (2, "bfloat16"), (4, "float16")])
def test_loss_falls(n, dtype):
    rc, out = run_example(n, "--steps", "60", "--dtype", dtype, "--log-every", "20")
    assert rc == 0, out
    assert f"world_size={n} " in out and f"dtype={dtype} " in out, out
    assert "ms/step" in out and "bytes/rank" in out, out
    final = re.search(r"^final: first_loss=(\S+) last_loss=(\S+)$", out.strip().splitlines()[-1])
    assert final, out
    first, last = map(float, final.groups())
    assert first == pytest.approx(math.log(10), abs=1e-3), out   # zero output layer
    assert last < 0.5 * first, out


def test_docstring_opens_with_launch_command():
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text(encoding="utf-8")))
    assert doc.splitlines()[0].strip() == LAUNCH


def test_slurm_ntasks_mismatch_fails_on_every_rank():
    rc, out = run_example(2, "--steps", "5", env={"SLURM_NTASKS": "3"}, timeout=60)
    assert rc != 0, out
    assert "SLURM_NTASKS=3 but MPI.COMM_WORLD.size=2" in out, out
    assert "srun --mpi=pmix" in out, out
