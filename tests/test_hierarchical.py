"""Hierarchical sharding (``shard_group_size``): parity with one process and with flat sharding
for every rule of the registry, memory per rank, the sub-communicators' settings, bad values on
every rank, and checkpoints saved under one grouping loaded under another and at other world
sizes (tests/cases/hierarchical.py): 4 ranks in 2 groups of 2 (a replica per group), loaded
flat on 3; 6 ranks in 2 groups of 3 (more ranks per group than groups), loaded on 4, flat and
in groups of 2."""

import pytest
from mpi4py import MPI

from mpirun import SIBLING, run_mpi
from zero1_mpi import Communicator
from zero1_mpi.comm.topology import resolve_shard_group_size


@pytest.mark.parametrize("n, k, m", [(4, 2, 3), SIBLING(6, 3, 4)])
def test_hierarchical_sharding_then_checkpoints_at_other_sizes(tmp_path, n, k, m):
    out = run_mpi(n, "hierarchical.py", "save", str(tmp_path), str(k), timeout=300).stdout
    assert f"OK hierarchical sharding on {n} ranks: K = {k}" in out, out
    out = run_mpi(m, "hierarchical.py", "load", str(tmp_path), timeout=180).stdout
    assert f"OK hierarchical checkpoints loaded on {m} ranks" in out, out


def test_node_groups_must_be_consecutive_blocks():
    comm = Communicator(MPI.COMM_SELF)
    assert resolve_shard_group_size("node", 8, [4, 5, 6, 7], comm) == 4
    assert resolve_shard_group_size(None, 8, None, comm) == 8
    for node in ([0, 2, 4, 6], [2, 3, 4, 5]):  # round-robin placement; a block not aligned
        with pytest.raises(ValueError, match="place ranks by node"):
            resolve_shard_group_size("node", 8, node, comm)
    with pytest.raises(ValueError, match="use 2 or more"):
        resolve_shard_group_size("node", 8, [3], comm)
    with pytest.raises(ValueError, match="must divide the 8 ranks"):
        resolve_shard_group_size(3, 8, None, comm)
