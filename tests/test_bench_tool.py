"""tools/bench.py: the command lists its benchmarks and each documents its options; the gpu
benchmark says what it lacks on a machine without CuPy or a GPU; ``step --optimizer``, without
MPI: each registered rule's kernels against its reference on a small shard (a one-process
stand-in for the communicator), and the kernel table; ``state``: each mode's K as measured
equals its formula."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench.py"
NAMES = ("step", "stage2", "stage3", "checkpoint", "comm", "offload", "watchdog", "node", "gpu", "quant", "wire",
         "state")
REFERENCES = {"adam": "torch_fused_adamw", "sgd": "torch_sgd_foreach", "lion": "zero1_numpy",
              "lamb": "zero1_numpy"}


@pytest.fixture(scope="module")
def bench():
    """tools/bench.py, the command (it puts tools/ on sys.path: ``benchmarks`` imports)."""
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_the_benchmarks_and_each_documents_its_options(bench, capsys):
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    listed = out.split("positional arguments:")[1].split("options:")[0]
    assert re.findall(r"^    (\S+)", listed, re.M) == list(NAMES), out  # with their help
    for name in NAMES:
        with pytest.raises(SystemExit) as exit_:
            bench.main([name, "--help"])
        assert exit_.value.code == 0, name
        text = capsys.readouterr().out
        assert text.startswith(f"usage: tools/bench.py {name} ") and "--json" in text, text
    page = (ROOT / "docs" / "performance.md").read_text()
    listed = page.split("The benchmarks are one command", 1)[1].split("(`--help` on", 1)[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(NAMES), \
        "docs/performance.md lists other benchmarks than tools/bench.py has"


def test_gpu_without_cupy_or_a_gpu_says_so_in_one_line():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount():
            pytest.skip("a GPU is here: tools/gpu_check.sh runs the gpu benchmark")
    except Exception:  # noqa: BLE001 - no CuPy, or no driver: what this test is about
        pass
    result = subprocess.run([sys.executable, str(BENCH), "gpu", "--params", "1M"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and result.stdout == "", result
    assert result.stderr.startswith("tools/bench.py gpu needs CuPy and a GPU: "), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


class OneRank:
    """What ``kernel_throughput`` uses of an mpi4py communicator, for one process."""

    def Barrier(self):
        pass

    def allreduce(self, value, op=None):
        return value


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.framework_branch  # (conftest.py)
def test_kernels_against_their_reference(bench, name, dtype):
    from benchmarks import step, step_report
    choice = step.optimizer_choice(name)
    has_torch = importlib.util.find_spec("torch") is not None
    out = step.kernel_throughput(OneRank(), 1 << 12, np.dtype(dtype), choice, has_torch)
    reference = REFERENCES[name] if has_torch or name in ("lion", "lamb") else "zero1_numpy"
    assert out["reference"] == reference
    rows = [k for k in out if k.startswith(("zero1", "torch"))]
    assert all(step_report.reference_rate(out, row) for row in rows)  # each row has its reference
    assert out["bytes_per_element"] == 12 + 8 * len(choice["rule"].state_names) \
        + (2 if dtype != "float32" else 0)
    assert rows and all(out[row]["Gelem_per_s"] > 0 for row in rows)

    result = {"world_size": 1, "optimizer": name, "kernels": out,
              "zero1": {"reduce": 1.0, "optimizer": 1.0, "gather": 1.0, "bytes": 1,
                        "state_bytes": 1},
              "baseline": {"reduce": 1.0, "optimizer": 1.0, "bytes": 1, "state_bytes": 1}}
    if choice["torch"] is None:
        result["torch_zero_skipped"] = f"torch has no {step_report.rule_label(name)} optimizer"
    text = step_report.table([result])
    assert f"vs {reference} |" in text and f"full {step_report.rule_label(name)} |" in text
    assert "x |" in text.split(f"vs {reference} |")[1]  # the ratios are there, not "-"
    assert ("skipped, torch has no" in text) == (choice["torch"] is None)


def test_two_phase_update_is_the_engines_lamb(bench):
    """One range through ``rule_update`` equals the rule's own two phases by hand."""
    from benchmarks import step
    choice = step.optimizer_choice("lamb")
    rule = choice["rule"]
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(300).astype(np.float32)
    master = rng.standard_normal(300).astype(np.float32)
    s = rule.scalars(1, choice["options"], 1.0)
    mine, theirs = master.copy(), master.copy()
    states_mine = [np.zeros(300, np.float32) for _ in rule.state_names]
    states_theirs = [np.zeros(300, np.float32) for _ in rule.state_names]
    step.rule_update(rule, "numpy", 300)(grad, mine, states_mine, None, s)
    kernel = rule.kernel("numpy", 300)
    sums = kernel.tensor_sums(grad, theirs, *states_theirs, s)
    kernel.apply(theirs, *states_theirs, None, rule.tensor_scalars(s, sums))
    assert np.array_equal(mine, theirs) and not np.array_equal(mine, master)


def test_state_modes_measure_their_bytes_per_parameter(tmp_path):
    import json
    out = tmp_path / "state.json"
    subprocess.run([sys.executable, str(BENCH), "state", "--params", "200K", "--steps", "2",
                    "--kernels", "numpy", "--json", str(out)], capture_output=True, text=True,
                   timeout=300, check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["k_formula"], r["moved_bytes"]) for r in rows] == [
        ("fp32 masters", 12, 28), ("remainder masters", 10, 26), ("fp32 + bf16 state", 8, 20),
        ("remainder + bf16 state", 6, 18),
        ("remainder + int8 state", 2 + 2 * (1 + 4 / 256), 10 + 2 * (2 + 8 / 256)),
        ("fp32 + int8 state", 4 + 2 * (1 + 4 / 256), 12 + 2 * (2 + 8 / 256))]
    for r in rows:  # the sharded bytes of one rank: K per parameter, a few ties at most, and
        # the 8-bit state's last partial blocks
        assert r["k_formula"] <= r["k"] < r["k_formula"] + 0.01 and r["step_ms"] > 0
        assert r["update_GBps"] > 0 and r["stream_GBps"] > 0
    assert rows[0]["ratio"] == 1.0
