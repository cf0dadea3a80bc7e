"""The 8-bit wire across nodes: link bytes, step and communication time, against the model.

Run it on the two-node test bed (or any two-node job), once per link rate:

    sudo tools/netns_cluster.sh --rate 1gbit -- python tools/bench.py wire --rate 1gbit
        [--params 25M] [--steps 5] [--json F]

For each configuration (flat, K = N, and node-level sharding, K = ranks per node; fp32 and
bf16 parameters; reduction in 16 bits or int8, every hop or only across the groups; gathers in
16 bits or int8), in one run on the same gradients: the median step time and its communication
(``last_step_seconds``: reduce + agree + gather, quantizing and dequantizing included; the
slowest rank), the link bytes per step (node 0's interface counters, both directions, between
barriers), and what ``zero1_mpi.plan`` predicts for both: bytes, and the ring bound of the link.
"""

from __future__ import annotations

import statistics

from . import common
from .node import link_bytes

RANKS, TIMEOUT = False, None
#: (name, param dtype, sharding, reduce_dtype, compress_hops, gather_dtype)
CONFIGS = (
    ("fp32", "float32", "flat", "float32", "all", None),
    ("bf16", "bfloat16", "flat", "float32", "all", None),
    ("int8 reduce", "bfloat16", "flat", "int8", "all", None),
    ("int8 reduce+gather", "bfloat16", "flat", "int8", "all", "int8"),
    ("fp32", "float32", "node", "float32", "all", None),
    ("bf16", "bfloat16", "node", "float32", "all", None),
    ("int8 across", "bfloat16", "node", "int8", "across", None),
    ("int8 reduce", "bfloat16", "node", "int8", "all", None),
    ("int8 reduce+gather", "bfloat16", "node", "int8", "all", "int8"),
)


def options(parser) -> None:
    common.params(parser, "25M")
    common.steps(parser, 5)
    parser.add_argument("--rate", required=True,
                        help="the link's rate, for the model (e.g. 1gbit: as --rate was given "
                        "to tools/netns_cluster.sh)")
    parser.add_argument("--only", help="run only the configurations whose name holds this")


def worker(args) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    one_node = common_node_size(comm) == comm.size  # no node-level groups to compare
    rows = [measure(comm, args, *config) for config in CONFIGS
            if (not args.only or args.only in config[0]) and not (one_node and config[2] == "node")]
    return {"params": args.params, "ranks": comm.size, "rate": args.rate, "steps": args.steps,
            "rows": rows}


def measure(comm, args, name, dtype, sharding, reduce, hops, gather) -> dict:
    import numpy as np

    from zero1_mpi import ZeroAdamW
    from zero1_mpi.kernels.backend import resolve_dtype
    from zero1_mpi.cli.plan import plan

    psi = args.params
    params = {"w": np.random.default_rng(0).standard_normal(psi).astype(np.float32)}
    opt = ZeroAdamW(params, comm, lr=1e-4, param_dtype=dtype, reduce_dtype=reduce,
                    compress_hops=hops, gather_dtype=gather,
                    shard_group_size=None if sharding == "flat" else "node")
    grad = np.random.default_rng(1 + comm.rank).standard_normal(psi).astype(resolve_dtype(dtype))
    steps, comms = [], []
    for step in range(args.steps + 2):  # two warm-up steps
        opt.grads["w"][...] = grad
        if step == 2:
            comm.Barrier()
            before = link_bytes()
        elapsed = common.timed(comm, opt.step)
        phases = opt.last_step_seconds
        if step >= 2:
            steps.append(elapsed)
            comms.append(common.slowest(comm, phases["reduce"] + phases["agree"]
                                        + phases["gather"]))
    comm.Barrier()
    after = link_bytes()
    k = opt.shard_group_size
    opt.close()
    per_node = common_node_size(comm)
    model = plan(psi, comm.size, per_node, None if sharding == "flat" else "node", dtype,
                 reduce=reduce, compress_hops=hops, gather=gather, bandwidth=args.rate)
    crossed = None if before is None else comm.bcast((after - before) / args.steps, root=0)
    return {"name": name, "dtype": dtype, "sharding": sharding, "shard_group_size": k,
            "reduce": reduce, "compress_hops": hops, "gather": gather,
            "step_ms": statistics.median(steps) * 1e3, "comm_ms": statistics.median(comms) * 1e3,
            "link_bytes": crossed, "model_link_bytes": model["link_bytes_per_step_both"],
            "model_link_ms": model["link_seconds"] * 1e3,
            "model_codec_ms": model["codec_seconds"] * 1e3}


def common_node_size(comm) -> int:
    """Ranks per node (every node the same here), from ``MPI.COMM_TYPE_SHARED``."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size()
    finally:
        local.Free()


def report(args, results: list[dict]) -> dict:
    found = results[0]
    print(f"{found['params']:,} parameters (AdamW), {found['ranks']} ranks, link {found['rate']},"
          f" median of {found['steps']} steps; link MB both directions per step\n")
    print(common.row("config", "K", "step ms", "comm ms", "link MB", "model MB", "meas/model",
                     "link bound ms", "bound/comm", "codec ms (model)"))
    print(common.rule("lrrrrrrrrr"))
    for r in found["rows"]:
        measured = r["link_bytes"]
        print(common.row(
            f"{r['name']} ({r['sharding']})", r["shard_group_size"], f"{r['step_ms']:.0f}",
            f"{r['comm_ms']:.0f}", "-" if measured is None else f"{measured / 1e6:.1f}",
            f"{r['model_link_bytes'] / 1e6:.1f}",
            "-" if measured is None else f"{measured / r['model_link_bytes']:.3f}",
            f"{r['model_link_ms']:.0f}", f"{r['model_link_ms'] / r['comm_ms']:.2f}",
            f"{r['model_codec_ms']:.0f}"))
    return found
