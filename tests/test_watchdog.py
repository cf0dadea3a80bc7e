"""The step watchdog (``step_timeout``, zero1_mpi/comm/watchdog.py): a rank that stops taking part
in a step ends the job within the timeout plus a few seconds, each waiting rank naming the step,
the phase and the bucket; bad values are refused on every rank; it changes no result. (The
network link going down: tests/test_netns.py.)"""

from __future__ import annotations

import re
import time

import pytest

from mpirun import SIBLING, run_mpi
from zero1_mpi.comm.watchdog import Watchdog, check_step_timeout

TIMEOUT = 2.5
#: From the hang to the end of the job: the timeout, at most a quarter more (the thread wakes
#: every timeout / 4), the launcher's teardown, and slack for a loaded 2-core machine.
SLACK = 15.0


@pytest.mark.parametrize("n, mode, phase", [
    SIBLING(3, "reduce", "'reduce' of bucket 0"),
    (2, "agree", "'agree' within"),
    (3, "update", "'gather' of bucket 0"),
    SIBLING(2, "add", "'reduce' of bucket {bucket}"),
])
def test_a_hung_rank_ends_the_job_naming_step_phase_and_bucket(n, mode, phase):
    result = run_mpi(n, "watchdog.py", mode, str(TIMEOUT), timeout=90, check=False)
    ended = time.time()
    out, err = result.stdout, result.stderr
    assert result.returncode != 0, out + err
    assert "UNREACHABLE" not in out, out + err
    hung = float(re.search(r"hang at (\d+\.\d+)", out).group(1))
    bucket = re.search(r"expect bucket (\w+) of (\d+)", out).group(1)
    # Every rank that waits names where (rank 0 at least: the others' lines may lose the race
    # with the first Abort); the hung rank (the last) has nothing to say.
    lines = re.findall(r"zero1_mpi: rank (\d+): step (\d+) has not finished (.*?) ?within "
                       r"(\S+) s \(step_timeout\): ending the job", err)
    assert "0" in [rank for rank, *_ in lines], err
    where = phase.format(bucket=bucket).replace(" within", "")
    assert all((step, what, seconds) == ("4", where, f"{TIMEOUT:g}")
               for _, step, what, seconds in lines), (where, lines)
    if mode != "agree":  # (there it hangs inside the armed phase, and says so too)
        assert str(n - 1) not in [rank for rank, *_ in lines], err
    assert TIMEOUT <= ended - hung <= TIMEOUT * 1.25 + SLACK, (ended - hung, err)


def test_bad_step_timeouts_are_refused_on_every_rank_and_the_watchdog_changes_no_bit():
    """One job on 3 ranks: bad or differing values raise on every rank; training with and
    without a watchdog gives the same bits (stage 1 and 2, ``wait=False``), and its thread
    ends with the optimizer."""
    out = run_mpi(3, "watchdog.py", "bad,same", timeout=180).stdout
    assert "OK watchdog bad values on 3 ranks" in out, out
    assert "OK watchdog same bits on 3 ranks" in out, out


def test_saves_inside_a_step_are_not_timed(tmp_path):
    """Publishing a non-blocking save and a preemption checkpoint, each 2.5 timeouts long."""
    out = run_mpi(2, "watchdog.py", "slow-save", "1", str(tmp_path), timeout=120).stdout
    assert "OK slow saves inside steps outlived step_timeout=1 on 2 ranks" in out


def test_check_step_timeout():
    assert check_step_timeout(None) is None and check_step_timeout(5) == 5.0
    for bad in (0, -1, float("nan"), float("inf"), True, "5", [5]):
        with pytest.raises(ValueError, match=re.escape(f"step_timeout={bad!r}") + ".*or None"):
            check_step_timeout(bad)


def test_fires_once_armed_too_long_and_never_when_disarmed_in_time():
    """In one process, with the ending replaced: a wait disarmed in time is never ended, one
    armed for the timeout is, within a quarter of it more, with the message naming where."""
    fired = []
    written = []
    watchdog = Watchdog(0.4, rank=3, abort=lambda: fired.append("abort"), write=written.append,
                        exit_grace=60, exit=fired.append)
    try:
        for step in range(1, 6):  # armed ~0.2 s at a time: never ended
            assert watchdog.arm(step, "reduce")
            assert not watchdog.arm(step, "gather")  # nested: the outer arm holds
            time.sleep(0.2)
            watchdog.disarm()
        assert fired == [] and written == []
        start = time.monotonic()
        watchdog.arm(7, "reduce")
        watchdog.bucket = 2
        while not fired and time.monotonic() - start < 10:
            time.sleep(0.01)
        took = time.monotonic() - start
        time.sleep(0.3)
        assert fired == ["abort", 1], fired  # Abort returned (here): the exit follows
        assert 0.4 <= took <= 0.4 * 1.25 + 0.5, took
        assert written[0].startswith("zero1_mpi: rank 3: step 7 has not finished 'reduce' of "
                                     "bucket 2 within 0.4 s (step_timeout): ending the job")
    finally:
        watchdog.close()
