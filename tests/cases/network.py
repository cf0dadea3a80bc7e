"""Which ranks talk over TCP: after traffic between every pair of ranks, each rank lists its
established TCP connections (from /proc), and rank 0 matches them up: a connection whose two ends
belong to two ranks of this job joins those ranks. Connections to the launcher do not count.

Prints ``rank pairs joined by TCP: K of P``. Run under ``launch_command(..., network=True)``
every pair must be joined; under shared memory usually none is.
"""

import os

import numpy as np
from mpi4py import MPI


def tcp_connections() -> set[tuple[str, str]]:
    """(local address:port, remote address:port) of this process's established TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                        found.add((fields[1], fields[2]))
        except OSError:
            continue
    return found


def main():
    world = MPI.COMM_WORLD
    buf = np.ones(1 << 16, np.float32)
    world.Allreduce(MPI.IN_PLACE, buf)
    for peer in range(world.size):  # every pair exchanges a message, whatever the algorithm
        if peer != world.rank:
            world.Sendrecv(buf[:1024].copy(), dest=peer, recvbuf=buf[1024:2048], source=peer)
    everyone = world.gather(tcp_connections())
    if world.rank == 0:
        joined = set()
        for a, mine in enumerate(everyone):
            for b, theirs in enumerate(everyone):
                if a < b and any((remote, local) in theirs for local, remote in mine):
                    joined.add((a, b))
        pairs = world.size * (world.size - 1) // 2
        print(f"rank pairs joined by TCP: {len(joined)} of {pairs}", flush=True)


if __name__ == "__main__":
    main()
