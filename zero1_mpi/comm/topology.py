"""Which ranks shard the state together: the shard groups and their communicators.

With ``shard_group_size`` K the N ranks form N / K groups of K consecutive ranks; each group
holds one copy of the sharded state, so rank r owns shard ``r % K`` of every bucket and is
replica ``r // K`` of it. ``Topology`` splits the two communicators that hierarchical sharding
needs (within a group: reduce-scatter and all-gather; across the groups: the sum of a shard
over its replicas), or uses the whole communicator when there is one group, and frees what it
made (and a communicator the optimizer built) on ``close()``. ``resolve_shard_group_size``
turns the option into K. Construction and ``close()`` must be called on all ranks.
"""

from __future__ import annotations

from .communicator import Communicator

__all__ = ["Topology", "resolve_shard_group_size", "check_shard_group_size"]


def resolve_shard_group_size(value, size: int, node_ranks, comm) -> int:
    """K, the ranks per shard group, for ``shard_group_size=value`` on the ``size`` ranks of
    ``comm`` (``node_ranks``: the ranks sharing this rank's node, for ``"node"``), or a
    ValueError naming the value and the fix."""
    if value is None:
        return size
    if not comm.supports_split and value != size:
        raise ValueError(
            f"shard_group_size={value!r} needs sub-communicators, which "
            f"{type(comm).__name__} cannot make yet: use zero1_mpi.Communicator "
            "(MPI) or shard over all ranks"
        )
    if value == "node":
        k = len(node_ranks)
        if node_ranks != list(range(node_ranks[0], node_ranks[0] + k)) or node_ranks[0] % k:
            raise ValueError(
                f"shard_group_size='node': this node holds ranks {node_ranks}, "
                "not a block of consecutive ranks starting at a multiple of its "
                "size: place ranks by node (mpiexec -ppn K, srun "
                "--distribution=block) or pass an integer"
            )
        value = k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or size % value:
        raise ValueError(
            f"shard_group_size={value!r} must divide the {size} ranks (or be None "
            "for all of them, or 'node')"
        )
    if value == 1 and size > 1:
        raise ValueError(
            "shard_group_size=1 keeps the whole state on every rank (plain data "
            "parallelism): use 2 or more"
        )
    return value


class Topology:
    """The shard groups of ``comm``'s ranks, groups of ``group_size`` (K) consecutive ranks.

    ``shard_rank``: which shard of each bucket this rank owns; ``replica``: which copy of the
    state its group holds, of ``replicas`` (N / K); ``shard_comm``: its group; ``replica_comm``:
    the ranks holding the same shard in the other groups (None with one group). ``owns_comm``:
    ``close()`` frees ``comm`` too (the optimizer built it).
    """

    def __init__(self, comm: Communicator, group_size: int, owns_comm: bool):
        self.comm, self.group_size, self.owns_comm = comm, group_size, owns_comm
        self.shard_rank, self.replica = comm.rank % group_size, comm.rank // group_size
        self.replicas = comm.size // group_size
        one = self.replicas == 1
        self.shard_comm = comm if one else comm.split(self.replica)
        self.replica_comm = None if one else comm.split(self.shard_rank)

    @property
    def communicators(self) -> list[Communicator]:
        """Every communicator of the groups, each once: ``comm``, and with several groups
        ``shard_comm`` and ``replica_comm`` (each with its own staging buffers and blocks)."""
        return (
            [self.comm]
            if self.replica_comm is None
            else [self.comm, self.shard_comm, self.replica_comm]
        )

    def close(self) -> None:
        """Free the sub-communicators (and ``comm`` where owned); idempotent; all ranks."""
        if self.replica_comm is not None:
            self.shard_comm.free()
            self.replica_comm.free()
        if self.owns_comm:
            self.comm.free()


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_shard_group_size(value, checked):
    comm = checked["comm"]
    k = resolve_shard_group_size(value, comm.size, checked["node"], comm)
    if checked["compress_hops"] == "across" and k == comm.size:
        raise ValueError(
            f"compress_hops='across' compresses the sum across shard groups, but "
            f"shard_group_size={value!r} makes one group of all {comm.size} ranks: pass "
            "shard_group_size='node' (or K < N), or compress_hops='all'"
        )
    return k
