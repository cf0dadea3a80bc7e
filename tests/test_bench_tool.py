"""tools/bench.py step --optimizer, without MPI: each registered rule's kernels against its
reference on a small shard (a one-process stand-in for the communicator), and the kernel table."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench.py"
REFERENCES = {"adam": "torch_fused_adamw", "sgd": "torch_sgd_foreach", "lion": "zero1_numpy",
              "lamb": "zero1_numpy"}


@pytest.fixture(scope="module")
def bench():
    """tools/bench.py, the command (it puts tools/ on sys.path: ``benchmarks`` imports)."""
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OneRank:
    """What ``kernel_throughput`` uses of an mpi4py communicator, for one process."""

    def Barrier(self):
        pass

    def allreduce(self, value, op=None):
        return value


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(REFERENCES))
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
