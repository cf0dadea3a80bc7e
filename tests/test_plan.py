"""``zero1_mpi.plan`` and ``zero1-plan``: the communication model's bytes by hand for 2 nodes x 2
ranks, the test bed's measured link bytes (docs/clusters.md) within 0.3%, closed forms on 4 nodes,
times, memory, the int8 codec's break-even, and the CLI (text, JSON, --compare, exit status 2
with the value and its fix). No MPI: the module imports where there is none."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import run_mpi

from zero1_mpi.cli import plan as model
from zero1_mpi.cli.plan import main, packed_bytes, parse_rate, parse_seconds, plan

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PSI = 25_000_000
GBIT = 1e9


def by_name(result) -> dict:
    """``{collective: entry}`` (the step's collectives are of distinct kinds in these cases)."""
    return {s["collective"] + (" agree" if "agreement" in s["what"] else ""): s
            for s in result["collectives"]}


def test_flat_bf16_two_nodes_of_two_by_hand():
    result = plan(PSI, 4, 2, bandwidth="1gbit", latency="20us")
    steps = by_name(result)
    alltoall, allgather = steps["Alltoall"], steps["Allgather"]
    assert alltoall["buffer_bytes"] == 2 * PSI and alltoall["sent_bytes_per_rank"] == 37.5e6
    # 2 ranks x 2 peers on the other node x 2Ψ/4 bytes each
    assert alltoall["link_bytes"] == 2 * 2 * (2 * PSI / 4) == 50e6
    # the ring 0->1->2->3->0: edges 1->2 and 3->0 cross, each 3/4 x 2Ψ
    assert allgather["link_bytes"] == 3 / 4 * 2 * PSI == 37.5e6
    assert allgather["link_bytes_both"] == 75e6
    assert result["link_bytes_per_step"] == 87.5e6
    assert result["link_bytes_per_step_both"] == 175e6
    assert steps["Allreduce agree"]["link_bytes"] == 0 and steps["Allreduce agree"]["rounds"] == 2
    # times: 6 buckets of 4M; the link's 0.4 s beats the alltoall's ring bound (0.3 s + 18 rounds)
    assert result["buckets"] == 6
    assert alltoall["link_seconds"] == pytest.approx(0.4)
    assert alltoall["ring_seconds"] == pytest.approx(0.3 + 18 * 20e-6)
    assert allgather["seconds"] == pytest.approx(0.3 + 18 * 20e-6)
    assert result["step_seconds"] == pytest.approx(0.4 + 0.3 + 18 * 20e-6 + 2 * 20e-6)


def test_node_level_bf16_keeps_the_group_on_the_node_by_hand():
    result = plan(PSI, 4, 2, "node", bandwidth="1gbit")
    assert (result["shard_group"], result["replicas"]) == (2, 2)
    steps = by_name(result)
    assert steps["Alltoall"]["link_bytes"] == steps["Allgather"]["link_bytes"] == 0
    assert not steps["Alltoall"]["crosses_nodes"]
    across = steps["Allreduce"]
    assert across["n"] == 2 and across["buffer_bytes"] == 4 * PSI / 2 == 50e6
    assert across["sent_bytes_per_rank"] == 2 * (1 / 2) * 50e6
    assert across["link_bytes"] == 2 * 50e6  # 2 ranks a node, one peer each on the other
    assert result["link_bytes_per_step_both"] == 200e6  # 8 bytes a parameter, as measured
    assert across["ring_seconds"] == pytest.approx(0.4 + 2 * 6 * model.LINK_LATENCY)


def test_int8_across_gathers_packed_rows_by_hand():
    result = plan(PSI, 4, 2, 2, reduce="int8", compress_hops="across", bandwidth="1gbit")
    steps = by_name(result)
    row = packed_bytes(12_500_000)
    assert row == 4 * 48_829 + 12_500_000
    assert steps["Alltoall"]["buffer_bytes"] == 2 * PSI  # within the node: 16-bit rows
    gathers = [s for s in result["collectives"] if s["collective"] == "Allgather"]
    across = next(s for s in gathers if s["crosses_nodes"])
    assert across["buffer_bytes"] == 2 * row and across["sent_bytes_per_rank"] == row
    assert across["link_bytes"] == 2 * row
    assert result["link_bytes_per_step"] == 2 * row


def test_int8_reduce_and_gather_roughly_halve_the_bf16_link_bytes():
    for group in (None, "node"):
        bf16 = plan(PSI, 4, 2, group, bandwidth="1gbit")
        int8 = plan(PSI, 4, 2, group, reduce="int8", gather="int8", bandwidth="1gbit")
        assert int8["link_bytes_per_step"] <= 0.55 * bf16["link_bytes_per_step"]
    flat = plan(PSI, 4, 2, reduce="int8", gather="int8", bandwidth="1gbit")
    row = packed_bytes(PSI // 4)
    assert flat["link_bytes_per_step"] == 2 * 2 * row + 3 / 4 * 4 * row


@pytest.mark.parametrize("p, dtype, group, measured", [
    (2, "bfloat16", None, 56.1e6), (2, "bfloat16", "node", 64.1e6),
    (4, "bfloat16", None, 92.2e6), (4, "bfloat16", "node", 64.1e6),
    (2, "float32", None, 112.2e6), (2, "float32", "node", 64.1e6),
    (4, "float32", None, 184.5e6), (4, "float32", "node", 64.1e6),
])
def test_the_test_beds_measured_link_bytes(p, dtype, group, measured):
    """docs/clusters.md: 8M parameters on 2 nodes, interface counters (tx + rx) per step."""
    result = plan(8_000_000, 2 * p, p, group, dtype, bandwidth="1gbit")
    assert result["link_bytes_per_step_both"] == pytest.approx(measured, rel=0.003)


@pytest.mark.parametrize("dtype, b", [("bfloat16", 2), ("float32", 4)])
def test_closed_forms_on_four_nodes_of_four(dtype, b):
    n, p, r = 16, 4, 4
    flat = by_name(plan(PSI, n, p, dtype=dtype, bandwidth="10gbit"))
    reduction = flat["Reduce_scatter_block" if b == 4 else "Alltoall"]
    assert reduction["link_bytes"] == pytest.approx(p * (n - p) * b * PSI / n)
    assert flat["Allgather"]["link_bytes"] == pytest.approx((n - 1) / n * b * PSI)  # one edge
    node = by_name(plan(PSI, n, p, "node", dtype=dtype, bandwidth="10gbit"))
    # p rings over the 4 nodes, one edge out of each node each: 2(R-1)/R x 4Ψ/p
    assert node["Allreduce"]["link_bytes"] == pytest.approx(2 * (r - 1) / r * 4 * PSI)
    assert node["Allreduce"]["rounds"] == 2 * (r - 1) * 6


def test_stage_2_and_float16_sums():
    one = plan(PSI, 4, 2, "node", "float16", 2, bandwidth="1gbit")
    assert by_name(one)["Allreduce"]["buffer_bytes"] == 2 * PSI / 2  # the fp16 gradient shard
    four = plan(PSI, 4, 2, None, "bfloat16", 2, bandwidth="1gbit", micro_batches=4)
    steps = by_name(four)
    assert steps["Alltoall"]["link_bytes"] == 4 * 50e6 and steps["Alltoall"]["times_per_step"] == 4
    assert steps["Allgather"]["link_bytes"] == 37.5e6
    sums = by_name(plan(PSI, 4, 2, dtype="float16", reduce="float16", bandwidth="1gbit"))
    assert sums["Reduce_scatter_block"]["buffer_bytes"] == 2 * PSI


def test_memory_per_rank():
    """Adam's K as the engine keeps it by default: bf16 parameters' remainder masters (10), or
    fp32 masters with 8-bit gathers or on request (12); ``state_dtype`` narrows it."""
    assert plan(PSI, 4, 2, bandwidth=1e9)["memory"]["bytes_per_rank"] == 2 * PSI + 2 * PSI \
        + 10 * PSI / 4
    node = plan(PSI, 4, 2, "node", bandwidth=1e9)["memory"]
    assert node["bytes_per_rank"] == 9 * PSI and node["formula"] == "2Ψ+2Ψ+10Ψ/2"
    assert plan(PSI, 4, 2, stage=2, bandwidth=1e9)["memory"]["formula"] == "2Ψ+12Ψ/4"
    for options in ({"masters": "fp32"}, {"gather": "int8"}, {"dtype": "float16"}):
        assert plan(PSI, 4, 2, bandwidth=1e9, **options)["memory"]["formula"] == "2Ψ+2Ψ+12Ψ/4"
    assert plan(PSI, 4, 2, bandwidth=1e9, state_dtype="int8")["memory"]["formula"] == \
        "2Ψ+2Ψ+4.03125Ψ/4"
    with pytest.raises(ValueError, match="masters='remainder'"):
        plan(PSI, 4, 2, bandwidth=1e9, masters="remainder", gather="int8")
    fp32 = plan(PSI, 4, 2, dtype="float32", bandwidth=1e9)["memory"]
    assert fp32["bytes_per_rank"] == 8 * PSI + 8 * PSI / 4
    # error feedback: a residual per compressed hop: Ψ of the gradients' dtype within the group,
    # Ψ/K of the reduced shard's across (fp32 in stage 1, the gradient shard's in stage 2)
    fed = plan(PSI, 4, 2, "node", reduce="int8", error_feedback=True, bandwidth=1e9)["memory"]
    assert fed["error_feedback_bytes"] == 2 * PSI + 4 * PSI / 2
    across = plan(PSI, 4, 2, "node", reduce="int8", compress_hops="across",
                  error_feedback=True, bandwidth=1e9)["memory"]
    assert across["error_feedback_bytes"] == 4 * PSI / 2
    stage2 = plan(PSI, 4, 2, "node", stage=2, reduce="int8", compress_hops="across",
                  error_feedback=True, bandwidth=1e9)["memory"]
    assert stage2["error_feedback_bytes"] == 2 * PSI / 2
    assert plan(PSI, 4, 2, rule_bytes=8, bandwidth=1e9)["memory"]["formula_bytes"] == 6 * PSI


def test_codec_time_and_break_even():
    plain = plan(PSI, 4, 2, bandwidth="1gbit")
    assert plain["codec_seconds"] == 0 and plain["break_even_bits"] is None
    int8 = plan(PSI, 4, 2, reduce="int8", bandwidth="1gbit", codec_rate=100e6)
    assert int8["codec_seconds"] == pytest.approx(PSI / 100e6)  # Ψ encoded and Ψ decoded
    saved = plain["link_bytes_per_step"] - int8["link_bytes_per_step"]
    assert int8["break_even_bits"] == pytest.approx(saved * 8 / int8["codec_seconds"])
    # at the break-even rate, the link time saved equals the codec's time
    slow = plan(PSI, 4, 2, bandwidth=int8["break_even_bits"])
    fast = plan(PSI, 4, 2, reduce="int8", bandwidth=int8["break_even_bits"], codec_rate=100e6)
    assert slow["link_seconds"] - fast["link_seconds"] == pytest.approx(fast["codec_seconds"])
    assert model.CODEC_VALUES_PER_SECOND == 1.0e9  # tools/bench.py quant, this machine


def test_packed_bytes_is_the_wires():
    """The planner counts with the codec's own sizes (tests/cases/plan_bytes.py: with the bytes
    a step hands to MPI)."""
    from zero1_mpi.wire import codec
    assert model.packed_bytes is codec.packed_bytes
    for n, expected in ((0, 0), (1, 8), (4, 8), (5, 12), (256, 260), (257, 268)):
        assert packed_bytes(n) == expected, n


def test_rates_and_latencies():
    for text, bits in (("1gbit", 1e9), ("10gbit", 1e10), ("100gbit", 1e11), ("200gbit", 2e11),
                       ("25Gbit/s", 25e9), ("10Gbps", 1e10), ("100GB/s", 8e11), ("1e9", 1e9),
                       ("500mbit", 5e8)):
        assert parse_rate(text) == pytest.approx(bits), text
    for text, seconds in (("5us", 5e-6), ("0.2ms", 2e-4), ("20 us", 2e-5), ("1e-5", 1e-5)):
        assert parse_seconds(text) == pytest.approx(seconds), text
    for bad in ("fast", "0gbit", "1 lightyear", ""):
        with pytest.raises(ValueError, match=re.escape("write e.g. 1gbit")):
            parse_rate(bad)
    with pytest.raises(ValueError, match=re.escape("write e.g. 20us")):
        parse_seconds("soon")


@pytest.mark.parametrize("kwargs, words", [
    ({"ranks_per_node": 3}, "ranks_per_node=3 does not divide ranks=4"),
    ({"shard_group": 3}, "shard_group=3"),
    ({"shard_group": 1}, "divisor K > 1"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"stage": 3}, "stage=3"),
    ({"reduce": "float16"}, "float16 params only"),
    ({"compress_hops": "across"}, "with reduce='int8'"),
    ({"gather": "int8", "dtype": "float32"}, "16-bit params"),
    ({"error_feedback": True}, "pass reduce='int8' too"),
    ({"params": 0}, "params=0"),
    ({"bandwidth": -1.0}, "rates > 0"),
])
def test_bad_values_name_the_value_and_the_fix(kwargs, words):
    args = {"params": PSI, "ranks": 4, "ranks_per_node": 2, "bandwidth": 1e9, **kwargs}
    with pytest.raises(ValueError, match=re.escape(words)):
        plan(**args)


def test_plan_imports_only_the_stdlib_and_runs_without_mpi():
    tree = ast.parse((ROOT / "zero1_mpi" / "cli" / "plan.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= set(sys.stdlib_module_names), imported
    relative = {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level}
    assert relative <= {"memory", "flat.layout", "wire.sizes"}, relative
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPI4PY_LIBMPI": "/nonexistent"}
    code = ("import sys, zero1_mpi.plan\nassert 'mpi4py.MPI' not in sys.modules\n"
            "sys.exit(zero1_mpi.plan.main(['--params', '1B', '--ranks', '8', "
            "'--ranks-per-node', '4', '--bandwidth', '1gbit']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0 and "link bytes per step" in done.stdout, done.stderr
    helped = subprocess.run([sys.executable, "-m", "zero1_mpi.plan", "--help"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                            check=False)
    assert helped.returncode == 0 and "--bandwidth" in helped.stdout, helped.stderr


BASE = ["--params", "25M", "--ranks", "4", "--ranks-per-node", "2", "--bandwidth", "1gbit"]


def test_cli_text_and_json(capsys):
    assert main(BASE) == 0
    text = capsys.readouterr().out
    assert "link bytes per step (one direction): 87.50 MB per node" in text
    assert "both directions: 175.00 MB" in text and "pairwise exchange" in text
    assert main(BASE + ["--shard-group", "node", "--reduce", "int8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(json.dumps(plan(PSI, 4, 2, "node", reduce="int8",
                                                bandwidth=1e9)))
    assert result["link_bytes_per_step_both"] == 4 * packed_bytes(PSI // 2)
    assert main(BASE + ["--reduce", "int8", "--codec-rate", "100M"]) == 0
    assert "int8 pays below" in capsys.readouterr().out


def test_cli_compare_prints_every_wire_choice(capsys):
    assert main(BASE + ["--compare"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]
    assert [tuple(r[:4]) for r in rows] == [
        ("4", "reduce float32, gather bfloat16", "87.50", "175.00"),
        ("4", "reduce int8, gather bfloat16", "62.89", "125.78"),
        ("4", "reduce int8, gather int8", "44.43", "88.87"),
        ("2", "reduce float32, gather bfloat16", "100.00", "200.00"),
        ("2", "reduce int8, gather bfloat16", "25.39", "50.78"),
        ("2", "reduce int8 across, gather bfloat16", "25.39", "50.78"),
        ("2", "reduce int8, gather int8", "25.39", "50.78"),
    ]
    assert [r[6] for r in rows[:3]] == ["-", "7.87 Gbit/s", "8.48 Gbit/s"]
    assert main(BASE + ["--compare", "--json", "--dtype", "float32"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [(r["shard_group"], r["reduce"], r["gather"]) for r in table] == [
        (4, "float32", None), (4, "int8", None), (2, "float32", None), (2, "int8", None),
        (2, "int8", None)]


@pytest.mark.parametrize("extra, words", [
    (["--ranks-per-node", "3"], "does not divide"),
    (["--shard-group", "3"], "shard_group=3"),
    (["--shard-group", "rack"], "write node, flat or a number of ranks K"),
    (["--bandwidth", "fast"], "rate 'fast' is not understood"),
    (["--latency", "soon"], "latency 'soon' is not understood"),
    (["--params", "lots"], "parameter count 'lots' is not a number"),
    (["--codec-rate", "quick"], "codec rate 'quick'"),
    (["--gather", "int8", "--dtype", "float32"], "16-bit params"),
    (["--error-feedback"], "pass reduce='int8' too"),
    (["--compress-hops", "across"], "with reduce='int8'"),
])
def test_cli_bad_input_exits_2_naming_the_value(capsys, extra, words):
    with pytest.raises(SystemExit) as exc:
        main(BASE + extra)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_int8_across_groups_sends_a_quarter_of_fp32_at_every_replica_count():
    """The int8 sum across groups: for R = 2 each replica's packed row to the other, for R > 2
    the shard's R packed parts reduce-scattered and each part's sum gathered: 2(R-1)/R x 1.016
    bytes a value either way (as a ring), against the fp32 ring's 2(R-1)/R x 4."""
    for nodes in (2, 3, 4, 8, 16):
        plain = plan(PSI * 8, 8 * nodes, 8, "node", bandwidth="100gbit")
        int8 = plan(PSI * 8, 8 * nodes, 8, "node", reduce="int8", compress_hops="across",
                    bandwidth="100gbit")
        ratio = int8["link_bytes_per_step"] / plain["link_bytes_per_step"]
        assert 0.25 < ratio < 0.26, (nodes, ratio)
        assert int8["break_even_bits"] > 0


def test_small_gathers_by_recursive_doubling_as_measured_on_the_test_bed():
    """The GPT example (463,584 parameters) on 2 x 2 ranks: its int8 gather, 470 KB a step,
    is below MPICH's 512 KiB ring threshold, so it goes by recursive doubling, whose second
    exchange crosses the link with two blocks from each rank. Measured on the test bed
    (docs/performance.md, bytes per step by differencing 80- and 20-step runs): 3,255,597,
    2,339,652 and 1,890,954 bytes both ways for bf16, int8 reduction, int8 reduction and
    gather."""
    measured = {("float32", None): 3_255_597, ("int8", None): 2_339_652,
                ("int8", "int8"): 1_890_954}
    for (reduce, gather), bytes_ in measured.items():
        model = plan(463_584, 4, 2, reduce=reduce, gather=gather, bandwidth="1gbit")
        assert abs(model["link_bytes_per_step_both"] / bytes_ - 1) < 0.01, (reduce, gather)


@pytest.mark.parametrize("n", [4, 6])
def test_the_plans_bytes_are_what_a_step_hands_to_mpi(n):
    """tests/cases/plan_bytes.py: a spy communicator notes every array collective of a step;
    for each combination the plan models (stage, dtypes, sums, hops, gathers, shard groups,
    micro-batches), the bytes of each collective equal the plan's (6 ranks: 3 replicas). The
    engine chooses the collectives, not MPI: run under the first MPI only."""
    out = run_mpi(n, "plan_bytes.py", timeout=300).stdout
    assert f"OK plan bytes on {n} ranks: 87 combinations" in out, out
