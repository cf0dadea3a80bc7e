"""examples/train_mlp.py runs under ``mpiexec -n N python -m mpi4py`` and its loss falls.

Each case launches the example as a user would (``mpiexec`` from ``tests/mpirun.py``), with a
timeout that kills the whole process group, and checks the header and the machine-checkable
last line ``final: first_loss=... last_loss=...``.
"""

from __future__ import annotations

import ast
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_mlp.py"
LAUNCH = "mpiexec -n 4 python -m mpi4py examples/train_mlp.py"
sys.path.insert(0, str(Path(__file__).parent))
from mpirun import mpiexec_command  # noqa: E402


def run_example(n: int, *args: str, env: dict | None = None, timeout: float = 120):
    """``(returncode, stdout + stderr)`` of the example on ``n`` ranks, run from the repo root."""
    cmd = [*mpiexec_command(n), sys.executable, "-m", "mpi4py", str(EXAMPLE.relative_to(ROOT)),
           *args]
    full_env = {k: v for k, v in os.environ.items() if k != "SLURM_NTASKS"}
    full_env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                     "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                     "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})})
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n{out}")
    return proc.returncode, out


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
