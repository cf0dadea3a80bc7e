"""The registry of rules (``zero1_mpi.rules.registry``) drives the tests and the tools.

For every registered rule and variant: its Numba twin gives its NumPy twin's bits on every dtype
(several chunks, one- or two-phase), and on the engine N ranks equal one process fed the
averaged gradients, with a checkpoint of N ranks loaded on one (tests/cases/registry_rules.py).
And adding the example rule of docs/update-rules.md takes one new file and one registry line:
done in a copy of the package, the memory table, the benchmark and these tests pick it up.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpirun import run_mpi
from zero1_mpi.backend import PARAM_DTYPES
from zero1_mpi.rules.registry import builtin_rules

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [(name, index) for name, entry in builtin_rules().items()
            for index in range(len(entry.variants))]


def run_twin(kernel, rule, options, param_dtype, grad_dtype, n, steps=3):
    """``(master, *states, param)`` after ``steps`` updates of one range by ``kernel``."""
    master = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    states = [np.zeros(n, np.float32) for _ in rule.state_names]
    param = None if param_dtype == np.float32 else master.astype(param_dtype)
    for step in range(1, steps + 1):
        grad = np.random.default_rng(step).standard_normal(n).astype(grad_dtype)
        s = rule.scalars(step, options, 0.5)
        if rule.tensor_sums:
            sums = kernel.tensor_sums(grad, master, *states, s)
            kernel.apply(master, *states, param, rule.tensor_scalars(s, sums))
        else:
            kernel(grad, master, *states, param, s)
    return [master, *states] + ([] if param is None else [param])


@pytest.mark.parametrize("param_dtype", list(PARAM_DTYPES))
@pytest.mark.parametrize("name, index", VARIANTS)
def test_every_rules_numba_twin_is_bitwise_its_numpy_twin(name, index, param_dtype):
    pytest.importorskip("numba")
    entry = builtin_rules()[name]
    rule = entry.variants[index]
    options = rule.check_options(**entry.defaults)
    n = 70_001  # chunks of every twin, and a remainder
    dtype = PARAM_DTYPES[param_dtype]
    for grad_dtype in dict.fromkeys((dtype, np.dtype(np.float32))):
        ours = run_twin(rule.kernel("numpy", n), rule, options, dtype, grad_dtype, n)
        theirs = run_twin(rule.kernel("numba", n), rule, options, dtype, grad_dtype, n)
        assert not np.array_equal(ours[0], np.random.default_rng(0).standard_normal(n)
                                  .astype(np.float32))  # the update moved the parameters
        for a, b in zip(ours, theirs):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, grad_dtype)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rule_on_n_ranks_equals_one_process(tmp_path, n):
    out = run_mpi(n, "registry_rules.py", str(tmp_path), timeout=300).stdout
    assert f"OK registry rules on {n} ranks: {', '.join(builtin_rules())}" in out


def readme_rule() -> tuple[str, str]:
    """The example of docs/update-rules.md: the rule file, and the registry line."""
    section = (ROOT / "docs" / "update-rules.md").read_text().split("## Adding an update rule",
                                                                    1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = re.search(r"```\n(NAMES = .*?)\n```", section, re.S).group(1)
    return code, line


def copy_with_readme_rule(tmp_path: Path) -> Path:
    """A copy of the package, tools and tests with the docs' rule added as the docs say:
    ``zero1_mpi/rules/sign_momentum.py`` and its registry line; returns the copy's root."""
    root = tmp_path / "copy"
    for part in ("zero1_mpi", "tools", "tests"):
        shutil.copytree(ROOT / part, root / part)  # with Numba's cache: same files, same stamps
    code, line = readme_rule()
    (root / "zero1_mpi" / "rules" / "sign_momentum.py").write_text(code)
    registry = root / "zero1_mpi" / "rules" / "registry.py"
    before = registry.read_text().splitlines()
    after = [line if text.startswith("NAMES = ") else text for text in before]
    registry.write_text("\n".join(after) + "\n")
    assert sum(a != b for a, b in zip(before, after)) == 1 and len(before) == len(after)
    return root


def in_copy(root: Path, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_adding_the_readme_rule_is_one_file_and_one_registry_line(tmp_path):
    root = copy_with_readme_rule(tmp_path)
    python = sys.executable
    names = in_copy(root, python, "-c", "import zero1_mpi.rules.registry as r; "
                    "print(r.__file__, list(r.builtin_rules()))")
    assert names.startswith(str(root)) and "'sign_momentum'" in names
    table = in_copy(root, python, "tools/memory_table.py", "--optimizer", "sign_momentum")
    assert "ZeroSignMomentum, K = 8 (stage 1: 2Ψ+2Ψ+8Ψ/N)" in table
    bench = in_copy(root, python, "tools/bench.py", "step", "--optimizer", "sign_momentum",
                    "--model", "flat:64K", "--steps", "1", "--warmup", "0", "--ranks", "1")
    assert "full SignMomentum |" in bench and "| 1 | zero1_numpy |" in bench
    assert "skipped, torch has no SignMomentum optimizer" in bench
    # The tests that iterate the registry, run in the copy, cover the new rule.
    tests = in_copy(root, python, "-m", "pytest", "-c", os.devnull, "-p", "no:cacheprovider",
                    "-q", "--rootdir", str(root), "tests/test_registry.py", "-k",
                    "sign_momentum or on_n_ranks", timeout=900)
    assert "6 passed" in tests and "failed" not in tests, tests  # 3 dtypes' twins, 3 sizes
