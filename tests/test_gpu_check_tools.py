"""The helpers of the device script (tools/gpu_check.sh), which CI can run without a GPU: the
slim Intel MPI runtime tools/pack_mpi.py packs runs a job, and tools/same_losses.py compares
the final losses of the checks in a log."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mpirun import mpi_flavor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import pack_mpi  # noqa: E402
import same_losses  # noqa: E402

LOG = """=== train_mlp cupy bfloat16: python examples/train_mlp.py
step 20 loss 0.9
final: first_loss=2.302585 last_loss=0.654247
=== train_mlp cupy bfloat16: PASS in 10.0s
=== impi train_mlp cupy bfloat16: python examples/train_mlp.py
final: first_loss=2.302585 last_loss={loss}
=== impi train_mlp cupy bfloat16: {verdict} in 9.0s
"""


@pytest.mark.parametrize("loss, verdict, rtol, rc", [
    ("0.654247", "PASS", 0.0, 0), ("0.654248", "PASS", 0.0, 1), ("0.654248", "PASS", 1e-5, 0),
    ("0.654247", "FAIL", 0.0, 0), ("0.7", "PASS", 1e-5, 1)])
def test_same_losses_compares_the_last_loss_of_each_check(tmp_path, capsys, loss, verdict,
                                                          rtol, rc):
    log = tmp_path / "gpu_check.log"
    log.write_text(LOG.format(loss=loss, verdict=verdict))
    pair = "train_mlp cupy bfloat16=impi train_mlp cupy bfloat16"
    assert same_losses.main([str(log), pair, "--rtol", str(rtol)]) == rc
    assert f"impi train_mlp cupy bfloat16: last_loss={loss}" in capsys.readouterr().out


def test_same_losses_fails_on_a_check_that_never_ran(tmp_path, capsys):
    log = tmp_path / "gpu_check.log"
    log.write_text(LOG.format(loss="0.654247", verdict="PASS"))
    assert same_losses.main([str(log), "train_mlp cupy float32=impi train_mlp cupy float32"]) == 1
    assert "DIFFER: train_mlp cupy float32 (None)" in capsys.readouterr().out


def _impi_wheel() -> Path | None:
    """The impi-rt wheel, downloaded once into pip's cache (None where pip cannot get it)."""
    target = Path(os.environ.get("ZERO1_WHEEL_CACHE", "/tmp/zero1-wheels"))
    found = sorted(target.glob("impi_rt-2021.18*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(target), pack_mpi.IMPI], capture_output=True, timeout=600)
        found = sorted(target.glob("impi_rt-2021.18*.whl"))
    return found[0] if found else None


def test_slim_intel_mpi_runs_a_job(tmp_path):
    """The slim runtime, unpacked and set up by tools/impi_env.sh, runs 2 ranks of mpi4py and
    zero1_mpi knows it for Intel MPI (without I_MPI_OFFLOAD: staging, and why). In the Intel
    MPI pass of CI only (the wheel is in pip's cache there; the test needs no other MPI)."""
    if mpi_flavor() != "Intel MPI":
        pytest.skip("runs where the launcher is Intel MPI (pip install '.[impi]')")
    wheel = _impi_wheel()
    if wheel is None:
        pytest.skip("pip could not download impi-rt (no registry?)")
    slim = pack_mpi.slim_impi(wheel, tmp_path / "impi-rt-slim.tar.xz")
    assert slim.stat().st_size < 16 * 2**20  # carried to a GPU machine: it must stay small
    with tarfile.open(slim) as tar:
        tar.extractall(tmp_path / "unpacked", filter="tar")
    script = ("from mpi4py import MPI; from zero1_mpi import Communicator; "
              "c = Communicator(MPI.COMM_WORLD); w = MPI.COMM_WORLD; "
              "total, why = w.allreduce(c.rank + 1), w.gather(c.cuda_aware_source); "
              "c.rank or print('sum', total, *why, sep=chr(10))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("I_MPI_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT)
    command = (f'source "{ROOT}/tools/impi_env.sh" "{tmp_path / "unpacked"}" && '
               f'mpiexec -n 2 "{sys.executable}" -c "{script}"')
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["sum", "3"], result.stdout
    assert len(lines) == 4 and all(line.startswith("Intel MPI 2021.18.1 without I_MPI_OFFLOAD=1")
                                   for line in lines[2:]), result.stdout
