"""checkpoint_on_signal: the scheduler's warning, sent to one rank or to the launcher, becomes
a checkpoint on every rank at the next step and a clean exit; the resumed run is bitwise the
uninterrupted one (tests/cases/preemption.py). Runs under every MPI: what a launcher does with
a signal is the MPI's own (docs/checkpoints.md lists it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, mpi_flavor, run_mpi
from zero1_mpi.launcher import kill_job, launch_command

STEPS, SIGNAL_AT = 12, 5


def lines(out: str, word: str) -> list[str]:
    return re.findall(rf"^{word} (.*)$", out, re.MULTILINE)


def test_a_signal_to_one_rank_checkpoints_every_rank_and_resumes_bitwise(tmp_path):
    n = 3
    whole = run_mpi(n, "preemption.py", "train", str(tmp_path / "whole"), str(STEPS)).stdout
    assert not lines(whole, "STOP") and len(lines(whole, "LOSS")) == STEPS, whole
    cut = run_mpi(n, "preemption.py", "train", str(tmp_path / "cut"), str(STEPS),
                  "--signal-at", str(SIGNAL_AT)).stdout
    stops = lines(cut, "STOP")
    assert sorted(s.split()[0] for s in stops) == [f"rank={r}" for r in range(n)], cut
    names = {re.search(r"checkpoint=(\S+)", s).group(1) for s in stops}
    assert len(names) == 1 and next(iter(names)).startswith(f"ckpt-{SIGNAL_AT + 1:08d}-"), cut
    assert all(f"after_step={SIGNAL_AT} step_count={SIGNAL_AT + 1} " in s for s in stops), cut
    # The loop ended at the step that saw the signal: no step after it ran.
    assert lines(cut, "LOSS") == lines(whole, "LOSS")[:SIGNAL_AT + 1], cut
    assert (tmp_path / "cut" / "ckpt" / "LATEST").read_text().splitlines()[0] == next(iter(names))
    resumed = run_mpi(n, "preemption.py", "train", str(tmp_path / "cut"), str(STEPS),
                      "--resume").stdout
    assert f"RESUMED at {SIGNAL_AT + 1}" in resumed, resumed
    assert lines(cut, "LOSS") + lines(resumed, "LOSS") == lines(whole, "LOSS"), resumed
    assert lines(resumed, "PARAMS") == lines(whole, "PARAMS"), (whole, resumed)


def test_overflow_and_bad_arguments(tmp_path):
    """An overflowed step still checkpoints and stops; bad arguments raise on every rank and
    an armed step adds no collective (one job, 3 ranks)."""
    out = run_mpi(3, "preemption.py", "overflow,errors", str(tmp_path)).stdout
    assert "OK overflow: skipped, checkpointed and stopped on 3 ranks" in out, out
    assert "OK preemption errors on 3 ranks" in out, out


#: Signals sent to ``mpiexec`` that it forwards to every rank and then lets the ranks finish,
#: by MPI (checked with tests/cases/preemption.py's ``launcher`` mode; docs/checkpoints.md).
#: Open MPI 5's mpiexec (prterun) forwards SIGUSR1/SIGUSR2, but on SIGTERM or SIGINT it
#: sends the ranks SIGTERM and kills them about 0.3 s later: no time for a checkpoint.
FORWARDED = {"MPICH": {"SIGTERM", "SIGUSR1", "SIGINT"},
             "Intel MPI": {"SIGTERM", "SIGUSR1", "SIGINT"},
             "Open MPI": {"SIGUSR1"}}


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_signal_to_the_launcher_checkpoints_and_ends_the_job_cleanly(tmp_path, name):
    kind = mpi_flavor()
    if kind not in FORWARDED:
        pytest.skip(f"launcher {kind}: which signals it forwards is not known")
    if name not in FORWARDED[kind]:
        pytest.skip(f"{kind}'s mpiexec kills the ranks on {name}: use SIGUSR1 with it")
    n = 2
    env = {k: v for k, v in os.environ.items() if k != "SLURM_NTASKS"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                           env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", ZERO1_MPI_KERNEL="numpy")
    cmd, env = launch_command(n, [sys.executable, "-m", "mpi4py", "tests/cases/preemption.py",
                                  "launcher", str(tmp_path), name], environ=env)
    # The launcher's SIGINT must not be ignored (it would be in a non-interactive shell's
    # background job).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
                pytest.fail(f"the job did not start training (rc {proc.poll()}):\n{out}")
            time.sleep(0.05)
        proc.send_signal(signal.Signals[name])
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        out = proc.communicate(timeout=30)[0]
        pytest.fail(f"the job did not end within 180 s of {name}:\n{out}")
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
    assert proc.returncode == 0, out
    stopped = [(tmp_path / f"stopped-{r}").read_text() for r in range(n)
               if (tmp_path / f"stopped-{r}").exists()]
    assert len(stopped) == n, out
    names = {re.search(r"checkpoint=(\S+)", s).group(1) for s in stopped}
    steps = {re.search(r"step=(\d+)", s).group(1) for s in stopped}
    assert len(names) == 1 and len(steps) == 1, stopped
    assert (tmp_path / "ckpt" / "LATEST").read_text().splitlines()[0] == next(iter(names)), stopped
    # The launcher forwarded the signal to every rank (each counted it itself).
    assert all(f"received=['{name}']" in s for s in stopped), stopped
