"""The seed's memory formulas and table, each rule's bytes per parameter, MemoryReport, and
tools/memory_table.py (--optimizer, --measure too)."""

import re
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from mpirun import run_mpi
import zero1_mpi
from zero1_mpi.memory import (MemoryReport, baseline_bytes, bytes_per_param, format_param_count,
                              format_table, parse_param_count, stage1_bytes, stage1_fp32_bytes,
                              stage2_bytes, stage3_bytes)
from zero1_mpi.rules.registry import rule_bytes_per_param, rule_states

# Copied from the seed's Out[7], character by character.
SEED_TABLE = """\
Per-GPU memory (GB) for a 7B parameter model
  GPUs    Baseline    Stage 1    Stage 2    Stage 3
----------------------------------------------------
     1      112.0G     112.0G     112.0G     112.0G
     4      112.0G      49.0G      38.5G      28.0G
     8      112.0G      38.5G      26.2G      14.0G
    16      112.0G      33.2G      20.1G       7.0G
    32      112.0G      30.6G      17.1G       3.5G
    64      112.0G      29.3G      15.5G       1.8G
   128      112.0G      28.7G      14.8G       0.9G"""
SEED_GPUS = [1, 4, 8, 16, 32, 64, 128]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    path = ROOT / "tools" / "memory_table.py"
    spec = importlib.util.spec_from_file_location("memory_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- formulas and the seed's table --------------------------------------------------------------

@pytest.mark.parametrize("params", [7e9, 7 * 10**9])
def test_default_table_is_the_seeds(params):
    assert format_table(params, SEED_GPUS) == SEED_TABLE


@pytest.mark.parametrize("func, args, expected", [
    (baseline_bytes, (7e9,), 112e9),
    (stage1_bytes, (7e9, 64), 29.3125e9),          # the seed's "roughly 29.31 GB"
    (stage1_bytes, (1000, 4), 4000 + 3000),
    (stage2_bytes, (7e9, 8), 26.25e9),
    (stage2_bytes, (1000, 2), 2000 + 7000),
    (stage3_bytes, (7e9, 64), 1.75e9),             # the seed's "1.75 GB"
    (stage1_fp32_bytes, (1000, 4), 8000 + 2000),
    (stage1_fp32_bytes, (1000, 1), 16000),
    (stage1_bytes, (0, 3), 0.0),
])
def test_formula_values(func, args, expected):
    assert func(*args) == pytest.approx(expected, rel=1e-12)
    assert isinstance(func(*args), float)


@pytest.mark.parametrize("psi", [1, 12345, 7e9])
def test_every_stage_is_the_baseline_on_one_rank(psi):
    for func in (stage1_bytes, stage2_bytes, stage3_bytes):
        assert func(psi, 1) == pytest.approx(baseline_bytes(psi)) == pytest.approx(16 * psi)


@pytest.mark.parametrize("psi", [-1, float("nan"), float("inf"), "7e9", None, True])
def test_bad_psi_is_named(psi):
    with pytest.raises(ValueError, match=r"psi=.* must be .*e\.g\. 7e9"):
        stage1_bytes(psi, 2)


@pytest.mark.parametrize("n", [0, -2, 2.0, "4", True, None])
def test_bad_rank_count_is_named(n):
    with pytest.raises(ValueError, match=r"n=.* must be an integer number of ranks >= 1"):
        stage1_bytes(1000, n)
    with pytest.raises(ValueError, match=r"n=.*"):
        format_table(1000, [1, n])


@pytest.mark.parametrize("text, expected", [
    ("7B", 7 * 10**9), ("1.3B", 1_300_000_000), ("1.3e9", 1_300_000_000), ("125M", 125 * 10**6),
    ("10k", 10_000), ("10000", 10_000), ("2T", 2 * 10**12), (" 0 ", 0)])
def test_parse_param_count(text, expected):
    assert parse_param_count(text) == expected


@pytest.mark.parametrize("text", ["abc", "1.5", "-3", "7X", "", "inf"])
def test_parse_param_count_rejects(text):
    with pytest.raises(ValueError, match="e.g."):
        parse_param_count(text)


@pytest.mark.parametrize("psi, text", [(7e9, "7B"), (1.3e9, "1.3B"), (125e6, "125M"),
                                       (10_000, "10K"), (512, "512"), (175 * 10**9, "175B")])
def test_format_param_count(psi, text):
    assert format_param_count(psi) == text


# -- each rule's bytes per parameter (K) ---------------------------------------------------------

# K of the sharded part, written out: (16-bit params: master 4 + 4 per state array; fp32 params:
# 4 per state array, the param shard being its own master).
RULE_K = {("adam", True): (12, 8), ("lamb", True): (12, 8), ("sgd", True): (8, 4),
          ("sgd", False): (4, 0), ("lion", True): (8, 4)}


@pytest.mark.parametrize("rule, momentum", list(RULE_K))
def test_rule_bytes_per_param(rule, momentum):
    k16, k32 = RULE_K[rule, momentum]
    for dtype in ("float16", "bfloat16"):
        assert rule_bytes_per_param(rule, dtype, momentum) == k16
    assert rule_bytes_per_param(rule, "float32", momentum) == k32
    assert bytes_per_param(rule_states(rule, momentum), "float16") == k16
    # momentum only matters to SGD
    assert rule_bytes_per_param(rule, "float16", False) == (4 if rule == "sgd" else k16)


def test_rule_states_are_the_rules():
    from zero1_mpi.rules.adam import Adam
    from zero1_mpi.rules.lion import Lion
    from zero1_mpi.rules.sgd import SGD
    assert rule_states("adam") == Adam(False).state_names == ("exp_avg", "exp_avg_sq")
    assert rule_states("sgd") == SGD(True).state_names == ("momentum_buffer",)
    assert rule_states("sgd", momentum=False) == SGD(False).state_names == ()
    assert rule_states("lion") == Lion().state_names == ("exp_avg",)
    assert rule_states("lamb") == ("exp_avg", "exp_avg_sq")
    with pytest.raises(ValueError, match="unknown update rule 'adagrad'; known: adam, lamb"):
        rule_states("adagrad")
    with pytest.raises(ValueError, match="float64.*known: float16, bfloat16, float32"):
        bytes_per_param(("exp_avg",), "float64")


@pytest.mark.parametrize("func, args, expected", [
    (stage1_bytes, (1000, 4, 8), 4000 + 2000),              # SGD with momentum, Lion
    (stage1_bytes, (1000, 4, 4), 4000 + 1000),              # SGD without momentum
    (stage1_bytes, (1000, 4, 12), 4000 + 3000),             # Adam, LAMB: the default
    (stage1_bytes, (7e9, 64, 8), 28e9 + 0.875e9),
    (stage1_fp32_bytes, (1000, 4, 4), 8000 + 1000),
    (stage1_fp32_bytes, (1000, 4, 0), 8000),                # fp32 SGD: nothing sharded
    (baseline_bytes, (1000, 8), 12000),
    (stage2_bytes, (1000, 2, 8), 2000 + 5000),
    (stage3_bytes, (1000, 2, 4), 4000),
])
def test_formulas_with_k(func, args, expected):
    assert func(*args) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("k", [-1, float("nan"), "8", None, True])
def test_bad_k_is_named(k):
    with pytest.raises(ValueError, match=r"k=.* must be a finite number of bytes per parameter"):
        stage1_bytes(1000, 2, k)


def test_table_with_k():
    # SGD with momentum, 7B: 2Ψ+2Ψ = 28 GB replicated, 8Ψ = 56 GB sharded at stage 1.
    lines = format_table(7e9, [1, 4, 8], k=8, label="SGD").splitlines()
    assert lines[0] == "Per-GPU memory (GB) for a 7B parameter model, SGD"
    assert lines[1:3] == SEED_TABLE.splitlines()[1:3]
    assert lines[3:] == ["     1       84.0G      84.0G      84.0G      84.0G",
                         "     4       84.0G      42.0G      31.5G      21.0G",
                         "     8       84.0G      35.0G      22.8G      10.5G"]
    assert format_table(7e9, SEED_GPUS, k=12) == SEED_TABLE


# -- the CLI ------------------------------------------------------------------------------------

def test_cli_default_prints_the_seed_table(tool, capsys):
    assert tool.main([]) == 0
    assert capsys.readouterr().out == SEED_TABLE + "\n"


def test_cli_params_and_gpus(tool, capsys):
    assert tool.main(["--params", "1.3e9", "--gpus", "1,2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Per-GPU memory (GB) for a 1.3B parameter model"
    assert lines[1:3] == SEED_TABLE.splitlines()[1:3]
    assert lines[3:] == ["     1       20.8G      20.8G      20.8G      20.8G",
                         "     2       20.8G      13.0G      11.7G      10.4G",
                         "     4       20.8G       9.1G       7.2G       5.2G"]
    assert tool.main(["--params", "125M", "--gpus", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == \
        "Per-GPU memory (GB) for a 125M parameter model"


def test_stage2_column_is_the_chapters_and_memory_reports(tool, capsys):
    """``--stage 2``: the chapter's Stage 2 column (7B at 4-128 GPUs), from the function that
    ``MemoryReport.formula_bytes`` uses with a gradient shard."""
    assert tool.main(["--stage", "2", "--gpus", "4,8,16,32,64,128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[3:]] == \
        ["38.5G", "26.2G", "20.1G", "17.1G", "15.5G", "14.8G"]
    report = MemoryReport(parameters=2, gradients=1, master_weights=4,
                          state={"exp_avg": 4, "exp_avg_sq": 4}, padding=0, comm_scratch=0,
                          psi=7 * 10**9, group_size=64, rank=0, param_dtype="bfloat16",
                          grad_shard_dtype="bfloat16")
    assert report.formula_bytes == 15.53125e9 and report.formula_label == "2Ψ+14Ψ/N"
    fp32_shard = MemoryReport(**{**report.as_dict(), "grad_shard_dtype": "float32"})
    assert fp32_shard.formula_label == "2Ψ+16Ψ/N"


def test_cli_optimizer_table(tool, capsys):
    assert tool.main(["--optimizer", "adam"]) == 0
    assert capsys.readouterr().out == SEED_TABLE + "\n"
    for argv, k, title in (
            (["--optimizer", "sgd"], 8, "ZeroSGD (momentum 0.9), K = 8 (stage 1: 2Ψ+2Ψ+8Ψ/N)"),
            (["--optimizer", "sgd", "--momentum", "0"], 4,
             "ZeroSGD (momentum 0), K = 4 (stage 1: 2Ψ+2Ψ+4Ψ/N)"),
            (["--optimizer", "lion"], 8, "ZeroLion, K = 8 (stage 1: 2Ψ+2Ψ+8Ψ/N)"),
            (["--optimizer", "lamb"], 12, "ZeroLAMB, K = 12 (stage 1: 2Ψ+2Ψ+12Ψ/N)")):
        assert tool.main([*argv, "--params", "1B", "--gpus", "1,4"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"Per-GPU memory (GB) for a 1B parameter model, {title}"
        # GB for Ψ = 1e9 on 4 ranks: baseline (4 + K)Ψ; stage 1 4Ψ + KΨ/4;
        # stage 2 2Ψ + (2 + K)Ψ/4; stage 3 (4 + K)Ψ/4
        gb = (4 + k, 4 + k / 4, 2 + (2 + k) / 4, (4 + k) / 4)
        assert lines[4] == f"{4:>6}" + "".join(f"{x:>{w}.1f}G" for x, w in
                                                zip(gb, (11, 10, 10, 10)))
    assert tool.main(["--optimizer", "sgd", "--params", "7B", "--gpus", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[3] == \
        "     4       84.0G      42.0G      31.5G      21.0G"


@pytest.mark.parametrize("argv, message", [(["--gpus", "1,x"], "comma-separated integers"),
                                           (["--gpus", "0"], "comma-separated integers"),
                                           (["--params", "lots"], "is not a number"),
                                           (["--optimizer", "adagrad"], "invalid choice"),
                                           (["--momentum", "0"], "pass --optimizer sgd"),
                                           (["--optimizer", "sgd", "--momentum", "-1"],
                                            "must be a momentum >= 0")])
def test_cli_rejects_bad_arguments(tool, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_measure_without_launcher_is_a_clear_error(tool, capsys):
    assert tool.main(["--measure", "--params", "100", "--mpiexec", "no-such-mpiexec-zz"]) == 1
    err = capsys.readouterr().err
    assert "'no-such-mpiexec-zz' not found" in err and "--mpiexec" in err


def test_tensor_shapes_cover_psi_exactly(tool):
    for psi in (1, 2, 9, 100, 1001, 10_000, 10**7):
        assert sum(math.prod(s) for s in tool.tensor_shapes(psi)) == psi


# -- MemoryReport -------------------------------------------------------------------------------

def report(**changes):
    # psi=1000 float16 on 2 ranks, 64-element alignment: buffers of 1024, shards of 512;
    # this rank (1) owns 488 real elements and 24 padding ones.
    fields = dict(parameters=2000, gradients=2000, master_weights=488 * 4,
                  state={"exp_avg": 488 * 4, "exp_avg_sq": 488 * 4},
                  padding=24 * 2 * 2 + 24 * 12, comm_scratch=512 * 4,
                  psi=1000, group_size=2, rank=1, param_dtype="float16")
    fields.update(changes)
    return MemoryReport(**fields)


def sgd_report(**changes):
    # the same layout with SGD's momentum buffer: 8 bytes per owned parameter, 8 per padding one
    fields = dict(state={"momentum_buffer": 488 * 4}, padding=24 * 2 * 2 + 24 * 8, rule="sgd")
    return report(**{**fields, **changes})


def test_report_totals_and_formula():
    r = report()
    assert r.optimizer_state == 3 * 488 * 4
    assert (r.exp_avg, r.exp_avg_sq) == (488 * 4, 488 * 4)
    assert r.total == 2 * 1024 * 2 + 3 * 512 * 4 + 512 * 4   # nbytes of every buffer held
    assert r.bytes_per_param == 12 and r.formula_label == "2Ψ+2Ψ+12Ψ/N"
    assert r.formula_bytes == r.adam16_formula_bytes == stage1_bytes(1000, 2) == 10000
    assert report(param_dtype="bfloat16").formula_bytes == 10000
    fp32 = report(param_dtype="float32", parameters=4000, gradients=4000, master_weights=0)
    assert fp32.formula_bytes == stage1_fp32_bytes(1000, 2) == 12000
    assert fp32.bytes_per_param == 8 and fp32.formula_label == "4Ψ+4Ψ+8Ψ/N"
    assert fp32.adam16_formula_bytes == 10000


def test_report_of_other_rules():
    sgd = sgd_report()
    assert sgd.total == 2 * 1024 * 2 + 2 * 512 * 4 + 512 * 4
    assert sgd.optimizer_state == 2 * 488 * 4
    assert (sgd.exp_avg, sgd.exp_avg_sq) == (0, 0)
    assert sgd.bytes_per_param == 8 and sgd.formula_label == "2Ψ+2Ψ+8Ψ/N"
    assert sgd.formula_bytes == stage1_bytes(1000, 2, 8) == 8000
    assert sgd.adam16_formula_bytes == 10000
    plain = sgd_report(state={}, padding=24 * 2 * 2 + 24 * 4)
    assert plain.bytes_per_param == 4 and plain.formula_bytes == 4000 + 2000
    plain32 = sgd_report(state={}, param_dtype="float32", parameters=4000, gradients=4000,
                         master_weights=0, padding=24 * 4 * 2)
    assert plain32.bytes_per_param == 0 and plain32.formula_bytes == 8000
    assert plain32.total == 2 * 1024 * 4 + 512 * 4
    lion = sgd_report(state={"exp_avg": 488 * 4}, rule="lion")
    assert lion.exp_avg == 488 * 4 and lion.formula_bytes == 8000
    # the rule's state names, in the rule's order, in the printed table
    lines = str(sgd).splitlines()
    assert lines[0] == "rank 1/2: 1000 float16 parameters, sgd"
    assert [line.split()[0] for line in lines[2:]] == [
        "parameters", "gradients", "master_weights", "momentum_buffer", "padding",
        "comm_scratch", "total", "formula", "difference"]
    assert "(2Ψ+2Ψ+8Ψ/N)" in lines[-2]


def test_report_dict_round_trip_and_text():
    r = report()
    assert MemoryReport(**r.as_dict()) == r
    for each in (r, sgd_report(), sgd_report(state={})):
        again = MemoryReport(**json.loads(json.dumps(each.as_dict())))
        assert again == each and hash(again) == hash(each)
        assert list(again.state) == list(each.state)
    assert r != sgd_report() and len({r, report(), sgd_report()}) == 2
    text = str(r)
    assert "rank 1/2" in text and "float16" in text and "exp_avg_sq" in text
    assert "10000" in text and f"{r.total - 10000}" in text and "padding + scratch" in text
    assert "formula" not in str(report(param_dtype="float64"))


def test_report_state_is_its_own_copy():
    state = {"exp_avg": 4}
    r = report(state=state)
    state["exp_avg"] = 8
    assert r.state == {"exp_avg": 4}


@pytest.mark.parametrize("changes, message", [
    (dict(padding=-1), "padding=-1 must be >= 0"),
    (dict(state={"exp_avg": 1.5}), r"state\['exp_avg'\]=1.5 must be an integer"),
    (dict(state={"momentum_buffer": -4}), r"state\['momentum_buffer'\]=-4 must be >= 0"),
    (dict(state=[("exp_avg", 4)]), "state=.* must map each state array's name to its bytes"),
    (dict(state={"padding": 4}), "state has a bad name 'padding'"),
    (dict(state={3: 4}), "state has a bad name 3"),
    (dict(rank=2), "0 <= rank < group_size"),
    (dict(group_size=0, rank=0), "group_size >= 1"),
    (dict(param_dtype=None), "param_dtype=None must be a dtype name"),
    (dict(rule=3), "rule=3 must be a rule name"),
    (dict(offloaded=True, offload_fraction=0.25), r"offload_fraction=0.25 needs host_state"),
    (dict(offloaded=True, offload_fraction=1.5), "offload_fraction=1.5 must be a number"),
    (dict(host_state=4), "host_state=4 must be at most .* and 0 unless offloaded"),
])
def test_report_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        report(**changes)


def test_report_formula_needs_a_known_dtype():
    with pytest.raises(ValueError, match="float64.*known: float16, bfloat16, float32"):
        report(param_dtype="float64").formula_bytes


# -- --measure: real optimizers under mpiexec ---------------------------------------------------

def need_mpiexec():
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not on PATH (pip install mpich)")


def test_measure_matches_the_formula(tool):
    need_mpiexec()
    psi = 10_000
    results = tool.measure(psi, [1, 2], "float16", timeout=120)
    for n, reports in results.items():
        assert [r.rank for r in reports] == list(range(n))
        for r in reports:
            assert (r.psi, r.group_size, r.param_dtype) == (psi, n, "float16")
            assert r.parameters == r.gradients == 2 * psi       # replicated
            assert r.total >= r.formula_bytes, str(r)
        # the optimizer state is partitioned: each real element's 12 bytes live on one rank
        assert sum(r.optimizer_state for r in reports) == 12 * psi
        # 12Ψ/N is an average: summed over ranks, total - formula is padding + scratch exactly
        assert tool.balanced(reports), "\n".join(map(str, reports))
        worst = max(r.total - r.formula_bytes for r in reports)
        assert worst <= sum(r.padding + r.comm_scratch for r in reports)
    table = tool.format_measured(psi, "float16", results).splitlines()
    assert table[0] == "Measured bytes per rank, ZeroAdam, 10K float16 parameters"
    assert [line.split()[0] for line in table[3:]] == ["1", "2"]
    assert all(line.endswith("yes") for line in table[3:])


def test_measure_runs_each_rules_class(tool):
    from zero1_mpi import ZeroAdam, ZeroLion, ZeroSGD
    assert tool.optimizer_class("adam") is ZeroAdam
    assert tool.optimizer_class("sgd") is ZeroSGD
    assert tool.optimizer_class("lion") is ZeroLion
    if getattr(zero1_mpi, "ZeroLAMB", None) is not None:
        assert tool.optimizer_class("lamb") is zero1_mpi.ZeroLAMB


# One launch per rule costs a second or two: SGD (its momentum passed through) and LAMB here;
# every rule's bytes are measured in tests/cases/memory.py.
@pytest.mark.parametrize("optimizer, momentum, dtype, names, k", [
    ("sgd", 0.9, "float16", ("momentum_buffer",), 8),
    ("lamb", 0.9, "bfloat16", ("exp_avg", "exp_avg_sq"), 10),  # a remainder master
])
def test_measure_other_rules(tool, optimizer, momentum, dtype, names, k):
    """--optimizer: the rule's state by name, K bytes per parameter sharded, nothing as padding."""
    if optimizer == "lamb" and getattr(zero1_mpi, "ZeroLAMB", None) is None:
        pytest.skip("zero1_mpi has no ZeroLAMB yet: the formula table is tested without it")
    need_mpiexec()
    psi, n = 10_000, 2
    reports = tool.measure(psi, [n], dtype, timeout=120, optimizer=optimizer,
                           momentum=momentum)[n]
    itemsize = 4 if dtype == "float32" else 2
    for r in reports:
        assert (r.rule, tuple(r.state), r.bytes_per_param) == (optimizer, names, k)
        assert r.parameters == r.gradients == itemsize * psi
        assert r.formula_bytes == (stage1_fp32_bytes if itemsize == 4 else stage1_bytes)(
            psi, n, k)
    # each real element's K bytes live on one rank; padding is below N x 64 elements a buffer
    assert sum(r.optimizer_state for r in reports) == k * psi
    assert all(r.padding <= n * 64 * (2 * itemsize + k) for r in reports)
    assert tool.balanced(reports), "\n".join(map(str, reports))
    table = tool.format_measured(psi, dtype, {n: reports}, optimizer, momentum).splitlines()
    label = ("4Ψ+4Ψ" if itemsize == 4 else "2Ψ+2Ψ") + f"+{k}Ψ/N"
    assert table[0] == (f"Measured bytes per rank, {tool.describe(optimizer, momentum)}, 10K "
                        f"{dtype} parameters, formula {label}")
    assert table[3].endswith("yes")


def test_measure_of_a_rule_the_registry_lacks_is_a_clear_error(tool, capsys):
    with pytest.raises(SystemExit) as info:
        tool.main(["--measure", "--optimizer", "adagrad", "--params", "100"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'adagrad'" in err
    assert all(name in err.split("choose from")[1] for name in ("adam", "sgd", "lion", "lamb"))


# -- measured, not derived ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [3])
def test_allocations_measured_with_tracemalloc_follow_the_formula(tmp_path, n):
    """tests/cases/memory.py, for every rule: held bytes == memory_report().total, the
    rule's state by name and K, growth with Ψ == the formula's, bounded checkpoint peaks on a
    model whose state exceeds the bound."""
    out = "\n" + run_mpi(n, "memory.py", str(tmp_path), timeout=240).stdout
    assert f"OK measured memory on {n} ranks" in out
    page = (ROOT / "docs" / "memory.md").read_text()
    quoted = re.findall(r"^(adamw[^:\n]*: Ψ=\d+ K=[\d.]+) max held \d+ (bytes/rank, .*)$", page,
                        re.MULTILINE)
    assert len(quoted) >= 4
    for head, tail in quoted:  # docs/memory.md's lines, but for the bytes held
        assert re.search(rf"^{re.escape(head)} max held \d+ {re.escape(tail)}$", out,
                         re.MULTILINE), f"docs/memory.md quotes {head} ... {tail}: stale"
    for label in ("adamw", "sgd momentum", "sgd", "lion", "adamw int8 wire, error feedback"):
        assert f"\n{label}, bfloat16: " in out and f"\n{label}, float32: " in out
    if getattr(zero1_mpi, "ZeroLAMB", None) is not None:
        assert "\nlamb, bfloat16: " in out


def test_table_for_hierarchical_sharding_divides_by_the_group():
    from zero1_mpi.memory import format_table
    table = format_table(7e9, [4, 8, 64], shard_group=8).splitlines()
    assert table[0].endswith("sharded within groups of 8 GPUs")
    rows = {int(line.split()[0]): line.split()[1:] for line in table[3:]}
    assert sorted(rows) == [8, 64]  # 8 does not divide 4: no row
    # 2Ψ + 2Ψ + 12Ψ/8 at N = 8 and at N = 64 alike; stage 3: 16Ψ/8
    assert rows[64] == rows[8] == ["112.0G", "38.5G", "26.2G", "14.0G"]
    assert format_table(7e9, [8], shard_group=None) != format_table(7e9, [8], shard_group=4)


def test_memory_table_tool_takes_shard_group(tool, capsys):
    assert tool.main(["--shard-group", "4", "--gpus", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "sharded within groups of 4 GPUs" in out and "49.0G" in out  # 4Ψ + 12Ψ/4 at 7B


def test_printed_table_shows_host_bytes_whenever_there_are_any():
    """CuPy parameters stage MPI through page-locked host buffers even without offload: the
    table then lists host_scratch and the device/host split, so its rows add up to total."""
    fields = dict(parameters=8, gradients=8, master_weights=16, state={"exp_avg": 16},
                  padding=0, comm_scratch=0, psi=4, group_size=1, rank=0,
                  param_dtype="bfloat16")
    plain, staged = MemoryReport(**fields), MemoryReport(**fields, host_scratch=100)
    assert "host_scratch" not in str(plain) and "  host " not in str(plain)
    assert "host_scratch               100" in str(staged)
    assert staged.host_bytes == 100 and staged.device_bytes == 48
    assert "  host                       100" in str(staged)
