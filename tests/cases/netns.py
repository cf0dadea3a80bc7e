"""Run under ``tools/netns_cluster.sh``: where each rank is, and what one Allreduce sends over
the link between the two namespaces.

Each rank finds its network namespace (``/proc/self/ns/net`` against ``/run/netns/NAME`` of
``ZERO1_NETNS_NAMES``), its host name, its rank in ``COMM_TYPE_SHARED`` (the ranks its MPI
takes for one node) and its namespace's IPv4 routes; then all ranks Allreduce ``MB`` megabytes
of float64 (``argv[1]``, default 4) with their own node's link counters
(``/sys/class/net/$ZERO1_NETNS_LINK/statistics``) read before and after, and check the sum
exactly. Rank 0 prints one line per rank,
``rank R node NAME host HOST shared-memory rank L of S routes IFACE:NET/BITS,...``, then
``allreduce BYTES: node0 tx T rx R`` (node 0's counters over the collective) and
``OK netns on N ranks``.
"""

import os
import socket
import sys

import numpy as np
from mpi4py import MPI


def my_namespace() -> str:
    here = os.stat("/proc/self/ns/net")
    for name in os.environ["ZERO1_NETNS_NAMES"].split():
        there = os.stat(f"/run/netns/{name}")
        if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
            return name
    return f"none of {os.environ['ZERO1_NETNS_NAMES']} (net:[{here.st_ino}])"


def link_counters() -> tuple[int, int]:
    stats = f"/sys/class/net/{os.environ['ZERO1_NETNS_LINK']}/statistics"
    with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def routes() -> str:
    """This namespace's IPv4 routes, ``IFACE:NET/BITS`` each (``/proc/self/net/route``)."""
    found = []
    with open("/proc/self/net/route") as table:
        next(table)
        for row in table:
            iface, dest, _, _, _, _, _, mask = row.split()[:8]
            net = socket.inet_ntoa(int(dest, 16).to_bytes(4, "little"))
            found.append(f"{iface}:{net}/{bin(int(mask, 16)).count('1')}")
    return ",".join(sorted(found)) or "none"


def main():
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # the ranks the MPI calls local
    where = world.gather((my_namespace(), socket.gethostname(), node.rank, node.size, routes()))
    node.Free()
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    count = int(megabytes * 2**20) // 8
    data = np.arange(count, dtype=np.float64) * (rank + 1)
    world.Barrier()
    before = link_counters()
    world.Barrier()
    world.Allreduce(MPI.IN_PLACE, data)
    world.Barrier()
    after = link_counters()
    expected = np.arange(count, dtype=np.float64) * (size * (size + 1) // 2)
    if not np.array_equal(data, expected):
        raise AssertionError(f"rank {rank}: Allreduce gave a wrong sum")
    moved = world.gather((after[0] - before[0], after[1] - before[1]))
    if rank == 0:
        for r, (name, host, local, local_size, table) in enumerate(where):
            print(f"rank {r} node {name} host {host} shared-memory rank {local} of {local_size} "
                  f"routes {table}")
        print(f"allreduce {count * 8}: node0 tx {moved[0][0]} rx {moved[0][1]}")
        print(f"OK netns on {size} ranks", flush=True)


if __name__ == "__main__":
    main()
