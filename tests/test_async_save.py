"""Non-blocking saves (``save(..., blocking=False)``): tests/cases/async_save.py on 1 and 3
ranks and with hierarchical sharding; a job killed while the background write is under way
keeps the previous checkpoint (tests/cases/checkpoint_crash.py's ``background`` moment)."""

import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("n, group", [(1, None), (3, None), (4, 2)])
def test_non_blocking_saves(tmp_path, n, group):
    args = [str(tmp_path)] + ([] if group is None else [str(group)])
    out = run_mpi(n, "async_save.py", *args, timeout=240).stdout
    assert f"OK non-blocking saves on {n} ranks, shard_group_size={group or n}" in out
