"""Run a case script under ``mpiexec -n N python -m mpi4py`` from pytest, with a timeout.

``python -m mpi4py`` turns an uncaught exception on any rank into ``MPI_Abort`` of the whole
job, so a failing rank ends the run instead of leaving the others waiting. ``zero1_mpi.launcher``
gives the command line (``ZERO1_MPIEXEC``, and what each MPI needs) and kills the whole job on
timeout; the test then fails with everything the job printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero1_mpi.launcher import LauncherError, LaunchTimeout, flavor, launcher, run

CASES = Path(__file__).parent / "cases"
ROOT = Path(__file__).parent.parent


def SIBLING(*values):  # noqa: N802 - reads as a parametrization's values
    """A parametrization whose MPI calls a sibling left in every pass also makes (another world
    size, moment or phase of the same case): marked ``mpi_independent``, so CI runs it in the
    first MPI's pass only."""
    return pytest.param(*values, marks=pytest.mark.mpi_independent)


def mpi_flavor() -> str:
    """The launcher's MPI: "MPICH", "Open MPI", "Intel MPI", ..."""
    return flavor(*launcher())


#: What Open MPI's mpiexec prints when its own PMIx server fails to start, before any rank runs
#: (seen once in about 400 launches on a loaded 2-core machine; open-mpi/ompi and lfortran CI
#: report it too): a failure of the launcher, not of the job, which a second launch clears.
LAUNCHER_FAILURES = ("The PMIx server's listener thread failed to start",)


def launcher_did_not_start(result: subprocess.CompletedProcess) -> bool:
    """Did ``mpiexec`` fail on its own, before any rank ran (nothing on stdout)?"""
    return result.returncode != 0 and not result.stdout.strip() \
        and any(text in result.stderr for text in LAUNCHER_FAILURES)


def run_mpi(n: int, script: str, *args: str, timeout: float = 180, check: bool = True,
            env: dict | None = None, abort_on_exception: bool = True, network: bool = False
            ) -> subprocess.CompletedProcess:
    """Run ``script`` on ``n`` ranks from the repository root; fail the test on timeout or
    (with ``check``) a non-zero exit or a Python traceback on stderr.

    ``script`` is a case name of ``tests/cases`` or a path from the root (``examples/...``).
    ``abort_on_exception=False`` runs plain ``python script`` instead of ``python -m mpi4py``;
    ``network=True`` keeps the ranks off shared memory (TCP, as between nodes).
    A ``SLURM_NTASKS`` of the surrounding job is dropped (the runs are not srun steps). Cases
    use the NumPy kernel unless ``env`` says otherwise: the Numba one is bitwise the same
    (tests/test_rule_kernels.py) and costs every short-lived rank its start-up.
    """
    path = script if "/" in script else str((CASES / script).relative_to(ROOT))
    runner = ["-m", "mpi4py"] if abort_on_exception else []
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                  os.environ.get("PYTHONPATH", "")])
    base = {k: v for k, v in os.environ.items() if k != "SLURM_NTASKS"}
    base.update({"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "ZERO1_MPI_KERNEL": "numpy",
                 **(env or {})})
    for attempt in (1, 2):
        try:
            result = run(n, [sys.executable, *runner, path, *args], timeout=timeout,
                         network=network, environ=base, cwd=ROOT)
        except LauncherError as exc:
            pytest.fail(str(exc))
        except LaunchTimeout as exc:
            pytest.fail(f"{' '.join(exc.cmd)} did not finish in {timeout}s\n--- stdout\n"
                        f"{exc.stdout}\n--- stderr\n{exc.stderr}")
        if attempt == 1 and launcher_did_not_start(result):
            print(f"the launcher failed before any rank ran; once more:\n{result.stderr}")
            continue
        break
    cmd, out, err = result.args, result.stdout, result.stderr
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {result.returncode}\n--- stdout\n{out}\n"
                    f"--- stderr\n{err}")
    if check and "Traceback (most recent call last)" in err:
        pytest.fail(f"{' '.join(cmd)} exited with 0 but printed a traceback\n--- stdout\n{out}\n"
                    f"--- stderr\n{err}")
    return result
