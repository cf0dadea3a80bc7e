"""``python -m zero1_mpi.memory`` and the ``zero1-memory`` console script: the reference
chapter's figures, every option's numbers (held to ``MemoryReport``'s formulas), and one-line
errors with exit status 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zero1_mpi.memory import MemoryReport
from zero1_mpi.cli.memory import main
from zero1_mpi.rules.registry import rule_states

from test_memory import SEED_TABLE  # the reference chapter's Out[7]

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

SEED_ROW_64 = "    64      112.0G      29.3G      15.5G       1.8G"  # stage 1: "roughly 29.31 GB"


def run(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def rows(lines: list[str]) -> dict[int, list[float]]:
    """The table's rows: ``{N: [GB per column]}``."""
    found = {}
    for line in lines[3:]:
        if not line.strip():
            break
        n, *cells = line.split()
        found[int(n)] = [float(c.rstrip("G")) for c in cells]
    return found


def cli(*argv: str, program=None) -> subprocess.CompletedProcess:
    command = program or [sys.executable, "-m", "zero1_mpi.memory"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=60,
                          check=False)


def test_7b_on_64_ranks_is_the_chapters_figure(capsys):
    lines = run(capsys, "--params", "7B", "--ranks", "64")
    assert lines[:4] == SEED_TABLE.splitlines()[:3] + [SEED_ROW_64]
    assert lines[4] == ""
    formulas = "\n".join(lines[5:])
    assert "Ψ = 7B parameters" in formulas
    assert "K = 12 bytes per parameter sharded: fp32 master, exp_avg, exp_avg_sq" in formulas
    for stage, formula in (("Baseline", "2Ψ+2Ψ+12Ψ = 16Ψ"), ("Stage 1", "2Ψ+2Ψ+12Ψ/N"),
                           ("Stage 2", "2Ψ+14Ψ/N"), ("Stage 3", "16Ψ/N")):
        assert f"\n  {stage:<10}{formula}   " in formulas, (stage, formulas)


def test_default_is_the_chapters_whole_table(capsys):
    lines = run(capsys)
    assert "\n".join(lines[:10]) == SEED_TABLE


@pytest.mark.parametrize("params, psi", [("7B", 7e9), ("1.5B", 1.5e9), ("350M", 350e6),
                                         ("125000000", 125e6), ("1.3e9", 1.3e9)])
def test_params_are_parsed(capsys, params, psi):
    lines = run(capsys, "--params", params, "--ranks", "4")
    assert rows(lines)[4] == [round(16 * psi / 1e9, 1), round((4 + 3) * psi / 1e9, 1),
                              round((2 + 14 / 4) * psi / 1e9, 1), round(4 * psi / 1e9, 1)]


def test_ranks_take_a_row_each_spaced_or_comma_separated(capsys):
    spaced = run(capsys, "--ranks", "8", "64")
    assert run(capsys, "--ranks", "8,64") == spaced
    assert list(rows(spaced)) == [8, 64]
    assert spaced[3:5] == [SEED_TABLE.splitlines()[5], SEED_ROW_64]


@pytest.mark.parametrize("argv, k", [(["--rule", "adam"], 12), (["--rule", "lamb"], 12),
                                     (["--rule", "sgd"], 8), (["--rule", "lion"], 8),
                                     (["--rule", "sgd", "--momentum", "0"], 4)])
def test_rules_bring_their_bytes_per_parameter(capsys, argv, k):
    lines = run(capsys, *argv, "--ranks", "1", "64")
    table = rows(lines)
    assert table[1] == [(4 + k) * 7.0] * 4  # every stage is the baseline on one rank
    assert table[64][1] == round(28 + k * 7 / 64, 1)
    assert f"K = {k} bytes per parameter sharded" in lines[6]
    if argv[1] != "adam":
        assert f"K = {k} (stage 1: 2Ψ+2Ψ+{k}Ψ/N)" in lines[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("offload", [False, True, 0.25])
@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
def test_stage_1_columns_are_memory_reports_formulas(capsys, dtype, offload, rule):
    """Stage 1 (and offloaded, whole or a quarter, its device and host columns) equal what
    ``MemoryReport`` holds an optimizer rank to, for each dtype and rule."""
    n, psi = 64, 7 * 10**9
    fraction = [] if offload is True else ["--offload-fraction", str(offload)]
    lines = run(capsys, "--rule", rule, "--param-dtype", dtype, "--ranks", str(n),
                *(["--offload", "cpu", *fraction] if offload else []))
    report = MemoryReport(parameters=0, gradients=0, master_weights=0,
                          state={name: 0 for name in rule_states(rule)}, padding=0,
                          comm_scratch=0, psi=psi, group_size=n, rank=0, param_dtype=dtype,
                          rule=rule, offloaded=bool(offload), offload_fraction=float(offload),
                          masters="remainder" if dtype == "bfloat16" and not offload else "fp32")
    row = rows(lines)[n]
    assert row[1] == round(report.formula_bytes / 1e9, 1), lines
    if offload:
        assert row[4:] == [round(report.device_formula_bytes / 1e9, 1),
                           round(report.host_formula_bytes / 1e9, 1)], lines
        assert "S1 device" in lines[1] and "stage 1 state offloaded to the host" in lines[0]
        host = report.host_formula_bytes * n / psi
        assert f"host {host:g}Ψ/N" in "\n".join(lines)
    else:
        assert len(row) == 4 and report.formula_label in "\n".join(lines)


def test_float32_and_bfloat16_numbers(capsys):
    assert rows(run(capsys, "--param-dtype", "float16", "--ranks", "64"))[64] == \
        rows(SEED_TABLE.splitlines())[64]
    # bf16: 2-byte remainder masters (the engine's default), K = 10: 14Ψ; 2Ψ+2Ψ+10Ψ/64;
    # 2Ψ+12Ψ/64; 14Ψ/64; offloaded, fp32 masters on the host: the seed's numbers
    assert rows(run(capsys, "--param-dtype", "bfloat16", "--ranks", "64"))[64] == \
        [98.0, 29.1, 15.3, 1.5]
    assert rows(run(capsys, "--param-dtype", "bfloat16", "--offload", "cpu", "--ranks", "64")
                )[64][:4] == rows(SEED_TABLE.splitlines())[64]
    # 4Ψ+4Ψ+8Ψ/64 = 56.875 GB; stage 2 4Ψ+12Ψ/64; stage 3 16Ψ/64
    assert rows(run(capsys, "--param-dtype", "float32", "--ranks", "64"))[64] == \
        [112.0, 56.9, 29.3, 1.8]
    # offloaded: device 4Ψ+4Ψ = 56 GB, host (8 + its fp32 master 4)Ψ/64 = 1.3125 GB
    assert rows(run(capsys, "--param-dtype", "float32", "--offload", "cpu", "--ranks", "64"))[64] \
        == [112.0, 57.3, 29.3, 1.8, 56.0, 1.3]


def test_shard_group_size_divides_the_state_by_the_group(capsys):
    lines = run(capsys, "--ranks", "8", "64", "--shard-group-size", "8")
    assert lines[0].endswith("sharded within groups of 8 GPUs")
    assert rows(lines) == {8: [112.0, 38.5, 26.2, 14.0], 64: [112.0, 38.5, 26.2, 14.0]}
    assert "2Ψ+2Ψ+12Ψ/G" in "\n".join(lines) and "G = 8 ranks" in "\n".join(lines)
    # The default rank counts keep only the multiples of the group.
    assert list(rows(run(capsys, "--shard-group-size", "16"))) == [16, 32, 64, 128]


@pytest.mark.parametrize("stage", [1, 2])
def test_modes_give_a_column_per_way_of_keeping_the_state(capsys, stage):
    """7B, 4 to 128 ranks, Adam on bf16 parameters: K = 12 (fp32 masters and moments), 10
    (remainder masters), 6 (and bf16 moments), 4 + 8/256 (and 8-bit moments), each column the
    stage's formula with its K, as ``MemoryReport`` holds a run to it."""
    lines = run(capsys, "--modes", "--stage", str(stage), "--ranks", "4,8,16,32,64,128")
    assert lines[0].startswith(f"Per-GPU memory (GB) of ZeRO stage {stage} for a 7B")
    assert lines[1].split() == ["GPUs", "fp32", "(12)", "remainder", "(10)", "+bf16", "state",
                                "(6)", "+int8", "state", "(4.03)"]
    table = rows(lines)
    assert list(table) == [4, 8, 16, 32, 64, 128]
    for n, cells in table.items():
        for k, cell in zip((12, 10, 6, 4 + 8 / 256), cells):
            want = (2 + 2 + k / n) * 7 if stage == 1 else (2 + (2 + k) / n) * 7
            assert cell == round(want, 1), (n, k, cell, want)
    if stage == 1:
        assert table[4][0] == 49.0 and table[64][0] == 29.3  # the seed's Stage 1 column


@pytest.mark.parametrize("argv, message", [
    (["--params", "7X"], "argument --params: parameter count '7X' is not a number"),
    (["--params", "-1"], "argument --params: parameter count '-1' must be a whole number"),
    (["--ranks", "0"], "argument --ranks: '0' is not a rank count >= 1"),
    (["--ranks", "8", "x"], "argument --ranks: 'x' is not a rank count >= 1"),
    (["--rule", "adagrad"], "argument --rule: invalid choice: 'adagrad'"),
    (["--momentum", "0"], "--momentum is SGD's: pass --rule sgd (not adam)"),
    (["--param-dtype", "float64"], "argument --param-dtype: invalid choice: 'float64'"),
    (["--offload", "nvme"], "argument --offload: invalid choice: 'nvme'"),
    (["--shard-group-size", "0"], "argument --shard-group-size: '0' must be a group size"),
    (["--ranks", "8", "12", "--shard-group-size", "8"],
     "--shard-group-size 8 does not divide --ranks 12: pass multiples of 8"),
    (["--modes", "--offload", "cpu"], "--modes takes bf16 parameters, no --offload"),
    (["--offload-fraction", "0.5"], "--offload-fraction is the share --offload cpu moves"),
    (["--offload", "cpu", "--offload-fraction", "1.5"],
     "argument --offload-fraction: '1.5' must be a share from 0 to 1"),
    (["--offload", "cpu", "--offload-fraction", "nan"],
     "argument --offload-fraction: 'nan' must be a share from 0 to 1"),
])
def test_bad_input_is_one_error_line_and_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1].split(": error: ", 1)[1].startswith(message), err


def test_python_dash_m_prints_the_table_without_warnings():
    """``zero1_mpi.memory`` is a package: runpy's "found in sys.modules" RuntimeWarning, which a
    module the package's ``__init__`` imports would give, cannot happen."""
    result = cli("--params", "7B", "--ranks", "64")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.splitlines()[3] == SEED_ROW_64
    bad = cli("--params", "7X")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines()[-1] == (
        "python -m zero1_mpi.memory: error: argument --params: parameter count '7X' is not a "
        "number; write e.g. 7B, 125M, 10k, 1.3e9 or 10000")
    assert bad.stderr.startswith("usage: python -m zero1_mpi.memory ")


def console_script():
    """The installed ``zero1-memory``: beside this interpreter first, else on PATH."""
    beside = Path(sys.executable).parent / "zero1-memory"
    return str(beside) if beside.exists() else shutil.which("zero1-memory")


@pytest.mark.skipif(console_script() is None,
                    reason="zero1-memory is not installed (pip install -e . installs it)")
def test_console_script_is_the_same_program():
    script = console_script()
    result = cli("--params", "7B", "--ranks", "64", program=[script])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == cli("--params", "7B", "--ranks", "64").stdout
    bad = cli("--ranks", "0", program=[script])
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == (
        "zero1-memory: error: argument --ranks: '0' is not a rank count >= 1; write e.g. 64, "
        "8 64 or 8,64")
