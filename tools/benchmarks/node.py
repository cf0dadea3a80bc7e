"""Flat versus node-level sharding across nodes: step time, link bytes, bytes per rank.

Side by side in one run: run it on the two-node test bed (or any multi-node job):

    sudo tools/netns_cluster.sh --rate 1gbit -- python tools/bench.py node [--params 8M]
        [--dtype bfloat16] [--steps 5] [--json F]

For each of ``shard_group_size=None`` (flat: the state sharded over all N ranks) and
``shard_group_size="node"`` (sharded within each node, replicated across nodes), on the same
parameters and gradients: the median step time (the slowest rank), the bytes that crossed the
inter-node link per step, and the bytes each rank holds (``memory_report().total``, its
optimizer state apart). The link's bytes are read from its interface counters on the test bed
(``ZERO1_NETNS_LINK``: both directions, counted on node 0's side, between barriers around the
timed steps, so the barriers' few bytes are included); elsewhere that column is left out.
It measures the ranks of the job it runs in (it has no --ranks: the job spans the nodes).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from . import common

RANKS, TIMEOUT = False, None
LAYOUTS = (("flat", None), ("node-level", "node"))


def options(parser) -> None:
    common.params(parser, "8M")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float32", "float16", "bfloat16"])
    common.steps(parser, 5)


def link_bytes() -> int | None:
    """Bytes through this node's end of the test bed's link so far (both directions)."""
    link = os.environ.get("ZERO1_NETNS_LINK")
    if not link:
        return None
    stats = Path("/sys/class/net") / link / "statistics"
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def worker(args) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = [{"sharding": name, **measure(comm, args.params, args.dtype, args.steps, group)}
            for name, group in LAYOUTS]
    return {"params": args.params, "dtype": args.dtype, "ranks": comm.size,
            "nodes": comm.size // rows[1]["shard_group_size"], "rows": rows}


def measure(comm, psi: int, dtype_name: str, steps: int, shard_group) -> dict:
    import numpy as np

    from zero1_mpi import ZeroAdamW
    from zero1_mpi.kernels.backend import resolve_dtype

    dtype = resolve_dtype(dtype_name)
    params = {"w": np.random.default_rng(0).standard_normal(psi).astype(np.float32)}
    opt = ZeroAdamW(params, comm, param_dtype=dtype_name, shard_group_size=shard_group)
    grad = np.random.default_rng(1 + comm.rank).standard_normal(psi).astype(dtype)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        opt.grads["w"][...] = grad
        if step == 2:
            comm.Barrier()
            before = link_bytes()
        elapsed = common.timed(comm, opt.step)
        if step >= 2:
            times.append(elapsed)
    comm.Barrier()
    after = link_bytes()
    report = opt.memory_report()
    crossed = None if before is None else (after - before) / steps
    return {"shard_group_size": opt.shard_group_size, "replicas": opt.replicas,
            "step_ms": statistics.median(times) * 1e3,
            "link_bytes_per_step": comm.bcast(crossed, root=0),
            "bytes_per_rank": common.slowest(comm, report.total),
            "state_bytes_per_rank": common.slowest(comm, report.optimizer_state)}


def report(args, results: list[dict]) -> dict:
    found = results[0]
    print(f"{found['params']:,} {found['dtype']} parameters (AdamW), {found['ranks']} ranks on "
          f"{found['nodes']} nodes, median of {args.steps} steps\n")
    print(common.row("sharding", "K", "step ms", "link bytes/step", "bytes/rank",
                     "optimizer state/rank"))
    print(common.rule("lrrrrr"))
    for r in found["rows"]:
        link = "-" if r["link_bytes_per_step"] is None else f"{r['link_bytes_per_step']:,.0f}"
        print(common.row(r["sharding"], r["shard_group_size"], f"{r['step_ms']:.1f}", link,
                         f"{r['bytes_per_rank']:,}", f"{r['state_bytes_per_rank']:,}"))
    return found
