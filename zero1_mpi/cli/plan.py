"""The communication model: ``zero1-plan --params 25M --ranks 4 --ranks-per-node 2 --bandwidth
1gbit`` (or ``python -m zero1_mpi.plan``), to choose a sharding and a wire format before queueing.

``plan(...)`` gives, for Ψ parameters on N ranks placed by node, the collectives of one step
(the gradients' reduction within the shard groups, their sum across the groups, the parameters'
all-gather, the agreement), each with its bytes, the bytes that cross between nodes, its ring
bound and link time, and the memory per rank; ``compare`` tabulates the wire choices. The
algorithms assumed are MPICH's for large messages (``MODEL``). Bytes and seconds; rates in
bits/s. Stdlib only: no numpy, no MPI.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter, defaultdict
from typing import NoReturn

from ..flat.layout import DEFAULT_BUCKET_ELEMENTS
from ..memory import (
    STATE_BYTES,
    bytes_per_param,
    format_param_count,
    parse_param_count,
    stage_bytes,
)
from ..wire.sizes import packed_bytes

__all__ = ["plan", "compare", "packed_bytes", "parse_rate", "parse_seconds", "main"]

#: What is modelled, in full.
MODEL = """
``plan`` gives, for Ψ parameters on N ranks placed by node (ranks 0..p-1 on node 0, ...),
shard groups of K consecutive ranks (flat: K = N; ``"node"``: K = p) and R = N/K replicas, the
collectives of one step, which the engine runs one after another (stages 1 and 2 alike; stage 2
repeats the first per micro-batch):

1. the gradients summed within each group: fp32 by ``Reduce_scatter_block`` (4Ψ bytes), 16-bit
   by ``Alltoall`` (2Ψ, summed in fp32 after), fp16 sums (``reduce="float16"``) by
   ``Reduce_scatter_block`` (2Ψ), int8 by ``Alltoall`` of K rows of ``packed_bytes(Ψ/K)``;
2. with R > 1, each reduced shard summed across the groups among the ranks holding it (r, r+K,
   ...): ``Allreduce`` of 4Ψ/K (fp32 sums; 2Ψ/K for fp16 ones); int8: ``Allgather`` of R rows
   (R = 2), or (R > 2) ``Alltoall`` of the shard's R packed parts and ``Allgather`` of each
   part's sum, packed again;
3. the parameters all-gathered within each group: ``Allgather`` of bΨ (int8: K packed rows);
4. the step's agreement, an ``Allreduce`` of 64 bytes over all N ranks: latency only.

Algorithms assumed (MPICH's for large messages): ``Alltoall`` and ``Reduce_scatter_block`` by
pairwise exchange (n-1 rounds, each rank sends 1/n of its buffer straight to each other rank),
``Allgather`` by a ring in rank order (n-1 rounds, each rank sends (n-1)/n of the total; below
512 KiB a bucket, in a power-of-two group, by recursive doubling, which crosses nodes more),
``Allreduce`` by a ring (2(n-1) rounds, 2(n-1)/n of the buffer sent; recursive doubling,
log2 n rounds, for the agreement). Per collective: the buffer (an all-to-all's or
reduce-scatter's input, an all-gather's result, an all-reduce's buffer), the bytes each rank
sends, and the link bytes: what crosses between nodes, per node per direction (the busiest
node; ``both``: tx + rx, one interface's counters). Times: the ring bound, the bytes each rank
sends over the bandwidth of the slowest link its group spans plus rounds x latency (rounds per
bucket of ``bucket_elements``), and the link time, the link bytes over the link's bandwidth (a
node's ranks share one link); the step's bound sums their maximum over the collectives.
Padding and the rounding of packed rows per bucket are ignored. Memory per rank: the ZeRO
formula of ``zero1_mpi.memory`` with the state over K (Adam's, kept as ``masters`` and
``state_dtype`` say), plus error feedback's residuals (the
gradients' dtype for each compressed hop: Ψ values within the group, Ψ/K across, in fp32
for stage 1's fp32 sums). All
numbers are bytes and seconds; rates are bits/s. Stdlib only: no numpy, no MPI.
"""

#: Values one rank quantizes and dequantizes per second (a value through both): measured with
#: ``tools/bench.py quant`` (Numba, bf16, block 256, one core of this project's 2-core machine:
#: encode 0.76 + decode 0.23 ms per million values). Pass ``--codec-rate`` for yours.
CODEC_VALUES_PER_SECOND = 1.0e9
#: MPICH gathers totals below this many bytes by recursive doubling (power-of-two groups), by a
#: ring from it on (``MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE``).
ALLGATHER_LONG = 512 * 1024
#: Within a node: shared memory, bits/s (100 GB/s) and seconds per round.
NODE_BANDWIDTH, NODE_LATENCY = 800e9, 1e-6
#: A link's latency when none is given (TCP over Ethernet; InfiniBand is nearer 2 us).
LINK_LATENCY = 20e-6
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ALGORITHMS = (
    "MPICH, large messages: Alltoall/Reduce_scatter_block pairwise exchange, Allgather ring "
    "in rank order (recursive doubling below 512 KiB a bucket), Allreduce ring (agreement: "
    "recursive doubling)"
)


_NUMBER = r"(\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_RATE = re.compile(_NUMBER + r"\s*([kKmMgGtT]?)(bits|bit|bps|b|Bps|B|bytes|byte)?(/s)?")
_TIME = re.compile(_NUMBER + r"\s*(s|ms|us|µs|ns)?")


def parse_rate(text) -> float:
    """``'1gbit'``, ``'25Gbit/s'``, ``'10Gbps'``, ``'100GB/s'`` (bytes), ``'1e9'`` -> bits/s."""
    match = _RATE.fullmatch(str(text).strip())
    if match:
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match[2].lower()]
        rate = float(match[1]) * scale * (8 if (match[3] or "").startswith(("B", "byte")) else 1)
        if 0 < rate < math.inf:
            return rate
    raise ValueError(f"rate {text!r} is not understood: write e.g. 1gbit, 25Gbit/s or 100GB/s")


def parse_seconds(text) -> float:
    """``'20us'``, ``'0.2ms'``, ``'1e-5'`` (seconds) -> seconds."""
    match = _TIME.fullmatch(str(text).strip())
    if match:
        scale = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[match[2] or "s"]
        return float(match[1]) * scale
    raise ValueError(f"latency {text!r} is not understood: write e.g. 20us, 0.2ms or 5e-6")


def _fail(what: str, fix: str) -> NoReturn:
    raise ValueError(f"{what}: {fix}")


def _crossing(groups, p: int, ring: bool, unit: float) -> tuple[float, float]:
    """(one direction, both): link bytes of the busiest node when each group's members send
    ``unit`` to each other member (pairwise) or along the ring in rank order (``ring``)."""
    tx: dict[int, float] = defaultdict(float)
    rx: dict[int, float] = defaultdict(float)
    for members in groups:
        nodes = [rank // p for rank in members]
        count = Counter(nodes)
        for i, node in enumerate(nodes):
            if ring and node != nodes[i - 1]:  # the edge into this member
                tx[nodes[i - 1]] += unit
                rx[node] += unit
            elif not ring:  # to (and from) each member on another node
                tx[node] += (len(nodes) - count[node]) * unit
                rx[node] += (len(nodes) - count[node]) * unit
    one = max((max(tx[x], rx[x]) for x in set(tx) | set(rx)), default=0.0)
    return one, max((tx[x] + rx[x] for x in set(tx) | set(rx)), default=0.0)


def _doubling(groups, p: int, block: float) -> tuple[float, float]:
    """(one direction, both) of an ``Allgather`` by recursive doubling (a power-of-two group):
    at distance d = 1, 2, 4, ... each member sends the d blocks it holds to member i ^ d."""
    tx: dict[int, float] = defaultdict(float)
    for members in groups:
        d = 1
        while d < len(members):
            for i, rank in enumerate(members):
                if rank // p != members[i ^ d] // p:
                    tx[rank // p] += d * block
            d *= 2
    one = max(tx.values(), default=0.0)  # symmetric: each node receives what it sends
    return one, 2 * one


def _value(value, parse) -> float:
    return float(value) if isinstance(value, (int, float)) else parse(value)


def plan(
    params, ranks: int, ranks_per_node: int, shard_group=None, dtype: str = "bfloat16",
    stage: int = 1, reduce: str = "float32", compress_hops: str = "all",
    gather: str | None = None, error_feedback: bool = False, *, bandwidth,
    latency=LINK_LATENCY, node_bandwidth=NODE_BANDWIDTH, micro_batches: int = 1,
    rule_bytes: float | None = None, codec_rate: float = CODEC_VALUES_PER_SECOND,
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, masters: str = "auto",
    state_dtype: str = "float32",
) -> dict:  # fmt: skip
    """One step's collectives, link bytes, time bounds and memory per rank, as a JSON-ready
    dict (the module's docstring says what each number is); a ValueError names a bad value
    and its fix. ``bandwidth``, ``node_bandwidth``: bits/s or text (``'1gbit'``);
    ``latency``: seconds or text (``'20us'``); ``rule_bytes``: the rule's sharded bytes per
    parameter (default Adam's with ``masters`` and ``state_dtype`` as the engine takes them:
    12 for fp16 parameters, 10 for bf16 ones' remainder masters unless 8-bit gathers keep fp32
    ones, 8 for float32); ``codec_rate``: values per second."""
    psi, n, p = params, ranks, ranks_per_node
    counts = {"params": psi, "ranks": n, "ranks_per_node": p, "micro_batches": micro_batches}
    for name, value in {**counts, "bucket_elements": bucket_elements}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(f"{name}={value!r}", "pass a whole number >= 1")
    if n % p:
        _fail(f"ranks_per_node={p} does not divide ranks={n}", "ranks are placed by node, p each")
    k = {None: n, "flat": n, "node": p}.get(shard_group, shard_group)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or n % k or (k == 1 and n > 1):
        _fail(f"shard_group={shard_group!r}", f"use None/'flat', 'node' or a divisor K > 1 of {n}")
    if dtype not in DTYPE_BYTES:
        _fail(f"dtype={dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    if stage not in (1, 2):
        _fail(f"stage={stage!r}", "use 1 or 2 (2: shard_gradients=True)")
    if reduce not in ("float32", "float16", "int8") or (reduce == "float16" and dtype != "float16"):
        _fail(f"reduce={reduce!r}", "use 'float32', 'int8', or 'float16' (float16 params only)")
    if compress_hops not in ("all", "across") or (compress_hops == "across" and reduce != "int8"):
        _fail(f"compress_hops={compress_hops!r}", "use 'all', or 'across' with reduce='int8'")
    if compress_hops == "across" and k == n:
        _fail("compress_hops='across' with one shard group", "pass shard_group='node' or K < N")
    if gather not in (None, "int8") or (gather and dtype == "float32"):
        _fail(f"gather={gather!r}", "use None, or 'int8' with 16-bit params")
    if error_feedback and reduce != "int8":
        _fail("error_feedback=True", "pass reduce='int8' too, or drop it")
    rate, local = _value(bandwidth, parse_rate), _value(node_bandwidth, parse_rate)
    alpha = _value(latency, parse_seconds)
    if not (0 < rate < math.inf and 0 < local < math.inf and 0 <= alpha < math.inf):
        _fail(f"bandwidth={bandwidth!r}, node_bandwidth={node_bandwidth!r}, latency={latency!r}",
              "rates > 0 bits/s, latency >= 0 s")  # fmt: skip
    if not (isinstance(codec_rate, (int, float)) and 0 < codec_rate < math.inf):
        _fail(f"codec_rate={codec_rate!r}", "pass values per second > 0, e.g. 2e8")

    b, r, m = DTYPE_BYTES[dtype], n // k, micro_batches if stage == 2 else 1
    shard, row = psi / k, packed_bytes(-(-psi // k))
    int8_within, int8_across = reduce == "int8" and compress_hops == "all", reduce == "int8"
    groups = [range(g * k, (g + 1) * k) for g in range(r)]
    replicas = [range(j, n, k) for j in range(k)]
    buckets = -(-psi // bucket_elements)
    steps = []

    def add(what, name, members, size, buffer, ring, times=1, rounds=None):
        factor = 2 if name == "Allreduce" else 1
        sent = factor * (size - 1) / size * buffer if rounds is None else 0.0
        one, both = _crossing(members, p, ring, sent if ring else buffer / size)
        if name == "Allgather" and buffer / buckets < ALLGATHER_LONG and size & (size - 1) == 0:
            one, both = _doubling(members, p, buffer / size)  # MPICH's choice below 512 KiB
        crosses = any(len({x // p for x in g}) > 1 for g in members)
        rounds = factor * (size - 1) * buckets if rounds is None else rounds
        wait = rounds * (alpha if crosses else NODE_LATENCY)
        ring_s = sent * 8 / (rate if crosses else local) + wait
        link_s = one * 8 / rate
        steps.append({
            "what": what, "collective": name, "n": size, "groups": len(members),
            "buffer_bytes": buffer, "sent_bytes_per_rank": sent * times,
            "link_bytes": one * times, "link_bytes_both": both * times, "crosses_nodes": crosses,
            "rounds": rounds * times, "times_per_step": times, "ring_seconds": ring_s * times,
            "link_seconds": link_s * times, "seconds": max(ring_s, link_s) * times,
        })  # fmt: skip

    if k > 1 and int8_within:
        add("gradient sum in group (int8)", "Alltoall", groups, k, k * row, False, m)
    elif k > 1 and (dtype == "float32" or reduce == "float16"):
        add("gradient sum in group", "Reduce_scatter_block", groups, k, b * psi, False, m)
    elif k > 1:
        add("gradient sum in group (16-bit rows)", "Alltoall", groups, k, 2 * psi, False, m)
    if r == 2 and int8_across:
        add("shard sum across groups (int8)", "Allgather", replicas, r, r * row, True)
    elif r > 2 and int8_across:  # reduce-scattered in R parts, each part's sum gathered
        part = packed_bytes(-(-psi // k // r))
        add("shard sum across groups (int8, parts)", "Alltoall", replicas, r, r * part, False)
        add("shard sum across groups (int8, gather)", "Allgather", replicas, r, r * part, True)
    elif r > 1:
        fp16 = reduce == "float16" or (stage == 2 and dtype == "float16")
        add("shard sum across groups", "Allreduce", replicas, r, (2 if fp16 else 4) * shard, True)
    if k > 1:
        param_bytes = k * row if gather else b * psi
        add(f"parameter gather{' (int8)' if gather else ''}", "Allgather", groups, k,
            param_bytes, True)  # fmt: skip
    if n > 1:  # recursive doubling, once a step
        rounds = (n - 1).bit_length()
        add("agreement (latency only)", "Allreduce", [range(n)], n, 64, True, 1, rounds)

    # values per rank per step through the int8 codec: encoded + decoded, a round trip each
    codec = 2 * m * psi if int8_within and k > 1 else 0.0
    codec += shard + psi if gather and k > 1 else 0.0
    codec += shard + r * shard if int8_across and r == 2 else 0.0
    codec += 2 * shard + 2 * shard if int8_across and r > 2 else 0.0  # two quantizations
    codec_seconds = codec / 2 / codec_rate
    link = sum(s["link_bytes"] for s in steps)
    result = {
        "params": psi, "ranks": n, "ranks_per_node": p, "nodes": n // p, "shard_group": k,
        "replicas": r, "dtype": dtype, "stage": stage, "micro_batches": micro_batches,
        "reduce": reduce, "compress_hops": compress_hops, "gather": gather,
        "error_feedback": error_feedback, "bandwidth_bits": rate, "latency_seconds": alpha,
        "node_bandwidth_bits": local, "buckets": buckets, "algorithms": ALGORITHMS,
        "collectives": steps, "link_bytes_per_step": link,
        "link_bytes_per_step_both": sum(s["link_bytes_both"] for s in steps),
        "ring_seconds": sum(s["ring_seconds"] for s in steps),
        "link_seconds": sum(s["link_seconds"] for s in steps),
        "step_seconds": sum(s["seconds"] for s in steps),
        "codec_rate": codec_rate, "codec_seconds": codec_seconds,
    }  # fmt: skip
    result["step_seconds_with_codec"] = result["step_seconds"] + codec_seconds
    result["break_even_bits"] = None  # int8 pays on links slower than this
    if codec_seconds:
        plain = plan(psi, n, p, k if k < n else None, dtype, stage, bandwidth=rate,
                     micro_batches=micro_batches, bucket_elements=bucket_elements)  # fmt: skip
        saved = plain["link_bytes_per_step"] - link
        result["break_even_bits"] = saved * 8 / codec_seconds if saved > 0 else 0.0
    if masters not in ("auto", "fp32", "remainder") or state_dtype not in STATE_BYTES:
        _fail(f"masters={masters!r}, state_dtype={state_dtype!r}",
              f"use auto, fp32 or remainder, and one of {', '.join(STATE_BYTES)}")  # fmt: skip
    kept = "remainder" if dtype == "bfloat16" and gather is None and masters != "fp32" else "fp32"
    if masters == "remainder" and kept == "fp32":
        _fail("masters='remainder'", "it takes bfloat16 parameters and no gather='int8'")
    adam = bytes_per_param(("exp_avg", "exp_avg_sq"), dtype, kept, state_dtype)
    rule = adam if rule_bytes is None else rule_bytes
    formula = stage_bytes(psi, k, stage, rule, dtype)
    across = 4 if stage == 1 else b  # stage 1 sums across the groups in fp32
    feedback = (b * psi if int8_within and k > 1 else 0) + (across * shard if r > 1 else 0)
    feedback *= bool(error_feedback)
    rep = f"{b}Ψ+{b}Ψ+{rule:g}Ψ/{k}" if stage == 1 else f"{b}Ψ+{b + rule:g}Ψ/{k}"
    result["memory"] = {
        "formula": rep, "formula_bytes": formula, "error_feedback_bytes": feedback,
        "bytes_per_rank": formula + feedback,
        "scratch": "communication scratch: a few buckets (bucket_elements), not counted",
    }  # fmt: skip
    return result


def compare(params, ranks, ranks_per_node, shard_group=None, **options) -> list[dict]:
    """``plan`` for each wire choice: fp32/16-bit, int8 reduce, int8 reduce and gather, flat
    and (where 1 < K < N) hierarchical with ``shard_group`` (default 'node': K = p)."""
    if shard_group in (None, "flat", "node"):  # K = p where that is neither flat nor K = 1
        p = ranks_per_node
        groups = [None] + (["node"] if 1 < p < ranks and ranks % p == 0 else [])
    else:
        groups = [None, shard_group]
    rows = []
    for group in groups:
        choices: list[dict] = [{}, {"reduce": "int8"}]
        if group is not None:
            choices.append({"reduce": "int8", "compress_hops": "across"})
        if options.get("dtype", "bfloat16") != "float32":
            choices.append({"reduce": "int8", "gather": "int8"})
        for choice in choices:
            rows.append(plan(params, ranks, ranks_per_node, group, **options, **choice))
    return rows


def _units(rows) -> tuple[str, float, str, float]:
    """MB or GB, ms or s: the units that keep a table's columns narrow."""
    most = max(max(r["link_bytes_per_step_both"], 2 * r["params"]) for r in rows)
    slowest = max(max(r["step_seconds"], r["codec_seconds"]) for r in rows)
    size = ("MB", 1e6) if most < 1e11 else ("GB", 1e9)
    return size + (("ms", 1e3) if slowest < 100 else ("s", 1.0))


def _wire(row) -> str:
    hops = " across" if row["compress_hops"] == "across" else ""
    return f"reduce {row['reduce']}{hops}, gather {row['gather'] or row['dtype']}"


def _bits(x) -> str:
    return "-" if x is None else "never" if x == 0 else f"{x / 1e9:.3g} Gbit/s"


def format_plan(row) -> str:
    """The text ``zero1-plan`` prints for one ``plan``."""
    k, n, (b, bs, t, ts) = row["shard_group"], row["ranks"], _units([row])
    layout = "flat" if k == n else f"{row['replicas']} replicas"
    lines = [
        f"{format_param_count(row['params'])} {row['dtype']} parameters, stage {row['stage']}, "
        f"{n} ranks on {row['nodes']} nodes ({row['ranks_per_node']} per node), shard group "
        f"K = {k} ({layout}); {_wire(row)}",
        f"link {_bits(row['bandwidth_bits'])}, latency {row['latency_seconds'] * 1e6:g} us; "
        f"within a node {_bits(row['node_bandwidth_bits'])}; {row['buckets']} buckets",
        f"{'collective':<44}{'n':>6}{'buffer ' + b:>12}{'sent/rank ' + b:>14}"
        f"{'link ' + b + '/node/dir':>18}{'ring ' + t:>10}{'link ' + t:>10}",
    ]
    for c in row["collectives"]:
        lines.append(
            f"{c['collective'] + ': ' + c['what']:<44}{c['n']:>6}{c['buffer_bytes'] / bs:>12.2f}"
            f"{c['sent_bytes_per_rank'] / bs:>14.2f}{c['link_bytes'] / bs:>18.2f}"
            f"{c['ring_seconds'] * ts:>10.2f}{c['link_seconds'] * ts:>10.2f}"
        )
    lines += [
        f"link bytes per step (one direction): {row['link_bytes_per_step'] / bs:.2f} {b} per "
        f"node; both directions: {row['link_bytes_per_step_both'] / bs:.2f} {b}",
        f"communication bound: {row['step_seconds'] * ts:.1f} {t} per step (each collective's "
        "max of ring bound and link time, one after another)",
    ]
    if row["codec_seconds"]:
        pays = f"pays below {_bits(row['break_even_bits'])}"
        if not row["break_even_bits"]:
            pays = "never pays here: it sends no fewer link bytes"
        lines.append(
            f"int8 codec: {row['codec_seconds'] * ts:.1f} {t} per step at "
            f"{row['codec_rate']:.3g} values/s; int8 {pays}"
        )
    mem, extra = row["memory"], row["memory"]["error_feedback_bytes"]
    feedback = f" + error feedback {extra / 1e9:.3f} GB" if extra else ""
    lines.append(
        f"memory per rank: {mem['bytes_per_rank'] / 1e9:.3f} GB ({mem['formula']}{feedback}; "
        f"{mem['scratch']})"
    )
    return "\n".join(lines + [f"assumed: {row['algorithms']}"])


def format_compare(rows) -> str:
    """The ``--compare`` table: one row per wire choice."""
    b, bs, t, ts = _units(rows)
    head = f"{'K':>6}  {'wire':<38}{'link ' + b + '/dir':>12}{'both ' + b:>12}"
    head += f"{'bound ' + t:>11}{'codec ' + t:>11}{'int8 pays below':>17}{'GB/rank':>9}"
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{row['shard_group']:>6}  {_wire(row):<38}{row['link_bytes_per_step'] / bs:>12.2f}"
            f"{row['link_bytes_per_step_both'] / bs:>12.2f}{row['step_seconds'] * ts:>11.1f}"
            f"{row['codec_seconds'] * ts:>11.1f}{_bits(row['break_even_bits']):>17}"
            f"{row['memory']['bytes_per_rank'] / 1e9:>9.3f}"
        )
    return "\n".join(lines)


def _arg(parse):
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _group(text: str):
    if text in ("node", "flat") or text.isdigit():
        return text if text in ("node", "flat") else int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: write node, flat or a number of ranks K")


def _rate(text: str) -> float:
    try:
        return float(parse_param_count(text))
    except ValueError:
        raise ValueError(f"codec rate {text!r}: write e.g. 200M or 2e8 values/s") from None


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), print the plan (or ``--compare``'s table;
    ``--json``: every number), return 0; bad input: a one-line error, exit status 2."""
    parser = argparse.ArgumentParser(
        prog="zero1-plan",
        description="Bytes per step on each link, the ring bound and memory per rank of a "
        "zero1_mpi job, before queueing it. " + ALGORITHMS + ".",
    )
    add = parser.add_argument
    add("--params", type=_arg(parse_param_count), required=True, metavar="PSI",
        help="parameter count Ψ: 25M, 7B, 1.3e9")  # fmt: skip
    add("--ranks", type=int, required=True, metavar="N", help="ranks in the job")
    add("--ranks-per-node", type=int, required=True, metavar="P", help="ranks per node")
    add("--shard-group", type=_group, default=None, metavar="node|flat|K",
        help="shard_group_size: flat (default), node (K = P) or K ranks")  # fmt: skip
    add("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16", help="param_dtype")
    add("--stage", type=int, default=1, help="1, or 2 (shard_gradients=True)")
    add("--micro-batches", type=int, default=1, help="stage 2 reduces each one")
    add("--reduce", choices=("float32", "float16", "int8"), default="float32",
        help="reduce_dtype")  # fmt: skip
    add("--compress-hops", choices=("all", "across"), default="all", help="compress_hops")
    add("--gather", choices=("int8",), default=None, help="gather_dtype")
    add("--error-feedback", action="store_true", help="error_feedback=True")
    add("--rule-bytes", type=_arg(float), default=None, metavar="K",
        help="the rule's sharded bytes per parameter (default Adam's, as --masters and "
        "--state-dtype keep it)")  # fmt: skip
    add("--masters", choices=("auto", "fp32", "remainder"), default="auto",
        help="masters (auto: bf16's remainders, 2 bytes)")  # fmt: skip
    add("--state-dtype", choices=tuple(STATE_BYTES), default="float32", help="state_dtype")
    add("--bandwidth", type=_arg(parse_rate), required=True,
        help="the link between nodes: 1gbit, 25Gbit/s, 100GB/s")  # fmt: skip
    add("--latency", type=_arg(parse_seconds), default=LINK_LATENCY, help="default 20us")
    add("--node-bandwidth", type=_arg(parse_rate), default=NODE_BANDWIDTH,
        help="within a node (default 100GB/s)")  # fmt: skip
    add("--codec-rate", type=_arg(_rate), default=CODEC_VALUES_PER_SECOND,
        help="int8 values encoded and decoded per second per rank (default 1G)")  # fmt: skip
    add("--compare", action="store_true",
        help="a row per wire choice (--reduce, --gather... aside), flat and per node")  # fmt: skip
    add("--json", action="store_true", help="print every number as JSON")
    a = parser.parse_args(argv)
    options = {"dtype": a.dtype, "stage": a.stage, "bandwidth": a.bandwidth,
               "latency": a.latency, "node_bandwidth": a.node_bandwidth,
               "micro_batches": a.micro_batches, "rule_bytes": a.rule_bytes,
               "codec_rate": a.codec_rate, "masters": a.masters,
               "state_dtype": a.state_dtype}  # fmt: skip
    try:
        if a.compare:
            out: object = compare(a.params, a.ranks, a.ranks_per_node, a.shard_group, **options)
        else:
            out = plan(a.params, a.ranks, a.ranks_per_node, a.shard_group, reduce=a.reduce,
                       compress_hops=a.compress_hops, gather=a.gather,
                       error_feedback=a.error_feedback, **options)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_compare(out) if a.compare else format_plan(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
