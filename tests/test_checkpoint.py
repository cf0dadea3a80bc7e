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
