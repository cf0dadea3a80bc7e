"""The seed's memory formulas and table, MemoryReport, and tools/memory_table.py (--measure too)."""

import importlib.util
import math
import shutil
from pathlib import Path

import pytest

from mpirun import run_mpi
from zero1_mpi.memory import (MemoryReport, baseline_bytes, format_param_count, format_table,
                              parse_param_count, stage1_bytes, stage1_fp32_bytes, stage2_bytes,
                              stage3_bytes)

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


@pytest.mark.parametrize("argv, message", [(["--gpus", "1,x"], "comma-separated integers"),
                                           (["--gpus", "0"], "comma-separated integers"),
                                           (["--params", "lots"], "is not a number")])
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
    fields = dict(parameters=2000, gradients=2000, master_weights=488 * 4, exp_avg=488 * 4,
                  exp_avg_sq=488 * 4, padding=24 * 2 * 2 + 24 * 12, comm_scratch=512 * 4,
                  psi=1000, world_size=2, rank=1, param_dtype="float16")
    fields.update(changes)
    return MemoryReport(**fields)


def test_report_totals_and_formula():
    r = report()
    assert r.optimizer_state == 3 * 488 * 4
    assert r.total == 2 * 1024 * 2 + 3 * 512 * 4 + 512 * 4   # nbytes of every buffer held
    assert r.formula_bytes == r.seed_formula_bytes == stage1_bytes(1000, 2) == 10000
    assert report(param_dtype="bfloat16").formula_bytes == 10000
    fp32 = report(param_dtype="float32", parameters=4000, gradients=4000, master_weights=0)
    assert fp32.formula_bytes == stage1_fp32_bytes(1000, 2) == 12000
    assert fp32.seed_formula_bytes == 10000


def test_report_dict_round_trip_and_text():
    r = report()
    assert MemoryReport(**r.as_dict()) == r
    text = str(r)
    assert "rank 1/2" in text and "float16" in text
    assert "10000" in text and f"{r.total - 10000}" in text and "padding + scratch" in text
    assert "formula" not in str(report(param_dtype="float64"))


@pytest.mark.parametrize("changes, message", [
    (dict(padding=-1), "padding=-1 must be >= 0"),
    (dict(exp_avg=1.5), "exp_avg=1.5 must be an integer"),
    (dict(rank=2), "0 <= rank < world_size"),
    (dict(world_size=0, rank=0), "world_size >= 1"),
    (dict(param_dtype=None), "param_dtype=None must be a dtype name"),
])
def test_report_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        report(**changes)


def test_report_formula_needs_a_known_dtype():
    with pytest.raises(ValueError, match="float64.*known: float16, bfloat16, float32"):
        report(param_dtype="float64").formula_bytes


# -- --measure: real ZeroAdam under mpiexec ----------------------------------------------------

def test_measure_matches_the_formula(tool):
    try:
        from zero1_mpi import ZeroAdam  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"zero1_mpi.ZeroAdam cannot be imported yet ({exc}); "
                    f"this test runs once the optimizer lands")
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not on PATH (pip install mpich)")
    psi = 10_000
    results = tool.measure(psi, [1, 2], "float16", timeout=120)
    for n, reports in results.items():
        assert [r.rank for r in reports] == list(range(n))
        for r in reports:
            assert (r.psi, r.world_size, r.param_dtype) == (psi, n, "float16")
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


# -- measured, not derived ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_allocations_measured_with_tracemalloc_follow_the_formula(tmp_path, n):
    """tests/cases/memory.py: held bytes == memory_report().total, growth with Ψ == the
    formula's, bounded checkpoint peaks on a model whose state exceeds the bound."""
    out = run_mpi(n, "memory.py", str(tmp_path), timeout=240).stdout
    assert f"OK measured memory on {n} ranks" in out
