"""Flat versus node-level sharding across nodes, side by side in one run: run it on the
two-node test bed (or any multi-node job):

    sudo tools/netns_cluster.sh --rate 1gbit -- python tools/node_bench.py [--params 8M]
        [--dtype bfloat16] [--steps 5] [--json F]

For each of ``shard_group_size=None`` (flat: the state sharded over all N ranks) and
``shard_group_size="node"`` (sharded within each node, replicated across nodes), on the same
parameters and gradients: the median step time (the slowest rank), the bytes that crossed the
inter-node link per step, and the bytes each rank holds (``memory_report().total``, its
optimizer state apart). The link's bytes are read from its interface counters on the test bed
(``ZERO1_NETNS_LINK``: both directions, counted on node 0's side, between barriers around the
timed steps, so the barriers' few bytes are included); elsewhere that column is left out.
One thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from zero1_mpi import ZeroAdamW  # noqa: E402
from zero1_mpi.backend import resolve_dtype  # noqa: E402
from zero1_mpi.memory import parse_param_count  # noqa: E402

LAYOUTS = (("flat", None), ("node-level", "node"))


def link_bytes() -> int | None:
    """Bytes through this node's end of the test bed's link so far (both directions)."""
    link = os.environ.get("ZERO1_NETNS_LINK")
    if not link:
        return None
    stats = Path("/sys/class/net") / link / "statistics"
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def measure(comm, psi: int, dtype_name: str, steps: int, shard_group) -> dict:
    dtype = resolve_dtype(dtype_name)
    params = {"w": np.random.default_rng(0).standard_normal(psi).astype(np.float32)}
    opt = ZeroAdamW(params, comm, param_dtype=dtype_name, shard_group_size=shard_group)
    grad = np.random.default_rng(1 + comm.rank).standard_normal(psi).astype(dtype)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        opt.grads["w"][...] = grad
        comm.Barrier()
        if step == 2:
            before = link_bytes()
        start = time.perf_counter()
        opt.step()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if step >= 2:
            times.append(elapsed)
    comm.Barrier()
    after = link_bytes()
    report = opt.memory_report()
    crossed = None if before is None else (after - before) / steps
    return {"shard_group_size": opt.shard_group_size, "replicas": opt.replicas,
            "step_ms": statistics.median(times) * 1e3,
            "link_bytes_per_step": comm.bcast(crossed, root=0),
            "bytes_per_rank": comm.allreduce(report.total, op=MPI.MAX),
            "state_bytes_per_rank": comm.allreduce(report.optimizer_state, op=MPI.MAX)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="8M")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the numbers to this file (rank 0)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    psi = parse_param_count(args.params)
    rows = [(name, measure(comm, psi, args.dtype, args.steps, group))
            for name, group in LAYOUTS]
    if comm.rank != 0:
        return
    nodes = comm.size // rows[1][1]["shard_group_size"]
    print(f"{psi:,} {args.dtype} parameters (AdamW), {comm.size} ranks on {nodes} nodes, "
          f"median of {args.steps} steps\n")
    print("| sharding | K | step ms | link bytes/step | bytes/rank | optimizer state/rank |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        link = "-" if r["link_bytes_per_step"] is None else f"{r['link_bytes_per_step']:,.0f}"
        print(f"| {name} | {r['shard_group_size']} | {r['step_ms']:.1f} | {link} | "
              f"{r['bytes_per_rank']:,} | {r['state_bytes_per_rank']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"params": psi, "dtype": args.dtype, "ranks": comm.size, "nodes": nodes,
             "rows": [{"sharding": n, **r} for n, r in rows]}, indent=1))


if __name__ == "__main__":
    main()
