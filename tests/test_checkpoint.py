"""Sharded checkpoints and consolidated exports across world sizes, crashes and bad files."""

import pytest

from mpirun import run_mpi

RANKS = [1, 2, 3, 4]


def test_every_world_size_loads_every_other(tmp_path):
    for n in RANKS:
        run_mpi(n, "checkpoint.py", "save", str(tmp_path / f"N{n}"))
    for m in RANKS:
        out = run_mpi(m, "checkpoint.py", "load", str(tmp_path), timeout=300).stdout
        assert f"OK checkpoints: {2 * len(RANKS)} loads on {m} ranks" in out


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("moment", ["mid-shard", "before-rename", "before-latest"])
def test_a_job_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, n, moment):
    run_mpi(n, "checkpoint_crash.py", "prepare", str(tmp_path))
    crashed = run_mpi(n, "checkpoint_crash.py", "crash", str(tmp_path), moment, check=False,
                      timeout=120)
    assert crashed.returncode != 0 and "UNREACHABLE" not in crashed.stdout
    out = run_mpi(n, "checkpoint_crash.py", "check", str(tmp_path)).stdout
    assert f"OK crash recovery on {n} ranks" in out


@pytest.mark.parametrize("n", RANKS)
def test_bad_checkpoints_are_refused_on_every_rank(tmp_path, n):
    out = run_mpi(n, "checkpoint_errors.py", str(tmp_path), timeout=120).stdout
    assert f"OK bad checkpoints: 13 cases on {n} ranks" in out
