"""What depends on the MPI library at hand: the started collectives it is given, the network
path (shared memory off), a rank killed mid-step, and the launcher. CI runs this file, like the
rest of the suite, under the MPICH, Open MPI and Intel MPI wheels."""

import os
import re
import subprocess
import sys
import time

import pytest

from mpirun import mpi_flavor, run_mpi
from zero1_mpi.comm.capabilities import PERSISTENT_PROVEN, mpi_library, resolve_persistent
from zero1_mpi.launcher import LauncherError, launch_command

VERSIONS = {
    "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25": ("MPICH", (5, 0, 2)),
    "Open MPI v5.0.11, package: Open MPI user@localhost Distribution": ("Open MPI", (5, 0, 11)),
    "Intel(R) MPI Library 2021.18.1 for Linux* OS": ("Intel MPI", (2021, 18, 1)),
    "MPI VERSION    : CRAY MPICH version 8.1.25.17 (ANL base 3.4a2)": ("Cray MPICH",
                                                                        (8, 1, 25, 17)),
    "MVAPICH2 Version      :\t2.3.7": ("MVAPICH", (2, 3, 7)),
    "Some MPI 1.0": ("unknown", ()),
}


@pytest.mark.parametrize("text", VERSIONS)
def test_library_is_recognised_from_its_version_string(text):
    assert mpi_library(text) == VERSIONS[text]


@pytest.mark.parametrize("library, expected", [
    (("MPICH", (5, 0, 2)), True),
    (("Open MPI", (5, 0, 11)), False),        # persistent reduce-scatter: scratch kept on free
    (("Intel MPI", (2021, 18, 1)), False),    # persistent in-place Allgather: stale blocks
    (("MPICH", (4, 2, 0)), False),            # not proven
    (("Cray MPICH", (8, 1, 25)), False), (("unknown", ()), False)])
def test_persistent_collectives_only_where_proven(library, expected):
    use, why = resolve_persistent(environ={}, library=library)
    assert use is expected and library[0] in why
    assert any(name == library[0] and library[1] >= lowest
               for name, lowest in PERSISTENT_PROVEN) is expected


def test_persistent_setting_overrides_the_library():
    assert resolve_persistent(environ={"ZERO1_MPI_PERSISTENT": "1"},
                              library=("Intel MPI", (2021, 18))) == (True,
                                                                     "ZERO1_MPI_PERSISTENT=1")
    assert resolve_persistent(environ={"ZERO1_MPI_PERSISTENT": "off"},
                              library=("MPICH", (5, 0))) == (False, "ZERO1_MPI_PERSISTENT=off")
    assert resolve_persistent(True, environ={"ZERO1_MPI_PERSISTENT": "0"}) == (True, "argument")
    with pytest.raises(ValueError, match="ZERO1_MPI_PERSISTENT='2'"):
        resolve_persistent(environ={"ZERO1_MPI_PERSISTENT": "2"})
    with pytest.raises(TypeError, match="persistent='yes'"):
        resolve_persistent("yes")


def test_launcher_errors_name_the_setting():
    with pytest.raises(LauncherError, match="ZERO1_MPIEXEC='no-such-mpiexec'"):
        launch_command(2, ["true"], environ={"ZERO1_MPIEXEC": "no-such-mpiexec", "PATH": ""})
    with pytest.raises(LauncherError, match="mpiexec on PATH"):
        launch_command(2, ["true"], environ={"PATH": ""})
    with pytest.raises(ValueError, match="n=0"):
        launch_command(0, ["true"])


@pytest.mark.parametrize("n", [3])
def test_started_collectives_compute_the_right_thing(n):
    """tools/mpi_probe.py on what zero1_mpi uses with this MPI (persistent where proven), on 3
    ranks (a count that is no power of two: the algorithms MPI picks for those)."""
    result = run_mpi(n, "tools/mpi_probe.py", "--mode", "default", "--iterations", "3",
                     timeout=240, check=False)
    assert result.returncode == 0 and "mpi_probe: all right" in result.stdout, result
    if mpi_flavor() in ("MPICH", "Open MPI", "Intel MPI"):  # the ranks loaded the launcher's MPI
        assert result.stdout.startswith(mpi_flavor()), result.stdout


def test_device_probe_says_when_mpi_takes_no_device_buffers():
    """On a CPU machine (or an MPI that is not CUDA-aware) ``--device`` says why it cannot
    probe, and exits non-zero instead of passing what it never ran."""
    result = run_mpi(2, "tools/mpi_probe.py", "--device", timeout=120, check=False,
                     env={"ZERO1_MPI_CUDA_AWARE": "0"})
    assert result.returncode != 0
    assert "MPI is not CUDA-aware here (ZERO1_MPI_CUDA_AWARE=0): nothing to probe" \
        in result.stdout, result


@pytest.fixture
def network():
    """Skip where the launcher's MPI is not one whose shared memory launch_command can turn off
    (e.g. ZERO1_MPIEXEC="srun ...")."""
    if mpi_flavor() not in ("MPICH", "Open MPI", "Intel MPI"):
        pytest.skip(f"cannot turn shared memory off for this launcher ({mpi_flavor()})")


@pytest.mark.parametrize("n", [3])
def test_network_mode_joins_every_rank_pair_by_tcp(n, network):
    out = run_mpi(n, "network.py", network=True, timeout=120).stdout
    pairs = n * (n - 1) // 2
    assert f"rank pairs joined by TCP: {pairs} of {pairs}" in out, out


def test_parity_and_checkpoints_over_the_network(tmp_path, network):
    """TCP between the ranks (no shared memory): the awkward layouts' parity on 3 ranks, and
    Adam's checkpoints saved on 3 loaded on 2."""
    out = run_mpi(3, "parity.py", "layouts", network=True, timeout=300).stdout
    assert "OK parity: 11 layouts on 3 ranks" in out, out
    run_mpi(3, "checkpoint.py", "save", str(tmp_path / "N3"), "--rule", "adam", network=True)
    out = run_mpi(2, "checkpoint.py", "load", str(tmp_path), "--rule", "adam", network=True,
                  timeout=300).stdout
    assert "OK checkpoints: 8 loads on 2 ranks (adam)" in out, out


@pytest.mark.parametrize("with_mpi4py_runner", [True, False])
def test_a_rank_failing_inside_step_aborts_the_job(with_mpi4py_runner):
    """An exception on one rank (tests/cases/step_failure.py), also without ``python -m
    mpi4py``: step() aborts the job instead of leaving the others waiting in the all-gather."""
    start = time.monotonic()
    result = run_mpi(3, "step_failure.py", timeout=120, check=False,
                     abort_on_exception=with_mpi4py_runner)
    assert result.returncode != 0
    assert "injected failure in the Adam kernel" in result.stderr
    assert "UNREACHABLE" not in result.stdout
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("n", [3])
def test_a_rank_killed_mid_step_ends_the_job(n):
    """SIGKILL between the reduce-scatter and the all-gather: the launcher ends the job."""
    start = time.monotonic()
    result = run_mpi(n, "kill_mid_step.py", timeout=60, check=False)
    took = time.monotonic() - start
    assert f"KILLING rank {n - 1} after the reduce-scatter" in result.stdout, result
    assert result.returncode != 0 and "UNREACHABLE" not in result.stdout, result
    assert took < 30, f"the job took {took:.1f} s to end"
    print(f"{mpi_flavor()}: a killed rank ended the {n}-rank job in {took:.1f} s")



def test_launcher_command_line_runs_a_program_on_n_ranks():
    program = ("from mpi4py import MPI; c = MPI.COMM_WORLD; ranks = c.gather(c.rank)\n"
               "if c.rank == 0: print('ranks', ranks, 'of', c.size)")
    result = subprocess.run([sys.executable, "-m", "zero1_mpi.launcher", "-n", "2", "--",
                             sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result
    assert "ranks [0, 1] of 2" in result.stdout, result
    result = subprocess.run([sys.executable, "-m", "zero1_mpi.launcher", "-n", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no program given" in result.stderr


def test_a_timed_out_job_is_killed_whole_and_fails_promptly():
    """The runner kills the launcher and every process below it (hydra puts ranks in sessions
    of their own), and no wait is unbounded."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 5s") as failed:
        run_mpi(2, "hang.py", timeout=5)
    assert time.monotonic() - start < 45
    pids = [int(p) for p in re.findall(r"hanging rank \d pid (\d+)", str(failed.value))]
    assert len(pids) == 2, str(failed.value)
    time.sleep(0.5)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
             not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"]
    assert not alive, f"ranks left running: {alive}"


@pytest.mark.mpi_independent
def test_only_a_launcher_that_failed_on_its_own_is_launched_again():
    """tests/mpirun.py launches a job once more only when mpiexec itself failed to start
    (Open MPI's PMIx listener), never when a rank ran and failed."""
    from mpirun import launcher_did_not_start

    def result(rc, out, err):
        return subprocess.CompletedProcess(["mpiexec"], rc, out, err)
    pmix = "--\nThe PMIx server's listener thread failed to start. We cannot\ncontinue.\n--"
    assert launcher_did_not_start(result(213, "", pmix))
    assert not launcher_did_not_start(result(0, "", pmix))
    assert not launcher_did_not_start(result(213, "rank 0 started\n", pmix))
    assert not launcher_did_not_start(result(1, "", "Traceback (most recent call last):"))
