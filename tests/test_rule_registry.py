"""Adding a rule is one file and one line of the registry (``zero1_mpi.rules.registry``), and
the tools and the tests then cover it: done with the complete example rule of
docs/update-rules.md ("Adding an update rule", signSGD with momentum), as written, in a copy
of the package. In the copy: the memory table and the benchmark know it; its kernels pass
tests/test_rule_kernels.py (Numba twin bitwise the NumPy twin, the NumPy twin against its
float64 reference, chunks, padding, allocations); on 2 ranks it equals its float64 reference
(tests/cases/parity.py) and, bitwise, one process running the engine on the summed gradients;
its checkpoint of 2 ranks loads on one and trains on (tests/cases/checkpoint.py). Every rule
of the registry is a complete ``Rule``.
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
from mpi4py import MPI

from zero1_mpi import ShardedOptimizer
from zero1_mpi.rules import Rule, missing_members
from zero1_mpi.rules.registry import builtin_rules

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]


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
           "OMP_NUM_THREADS": "1", "ZERO1_MPI_KERNEL": "numpy"}
    result = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


#: A case script of the copy on N ranks, as tests/mpirun.py runs one: ``python -m mpi4py``
#: under the package's launcher, the whole job killed on its timeout.
ON_RANKS = ("import sys; from zero1_mpi.launcher import run; "
            "job = run(int(sys.argv[1]), [sys.executable, '-m', 'mpi4py', *sys.argv[2:]], "
            "timeout=240); print(job.stdout); sys.stderr.write(job.stderr); "
            "sys.exit(job.returncode)")


def on_ranks(root: Path, n: int, case: str, *args: str) -> str:
    """``tests/cases/<case>`` of the copy on ``n`` ranks."""
    return in_copy(root, sys.executable, "-c", ON_RANKS, str(n), f"tests/cases/{case}", *args)


def test_adding_the_docs_rule_is_one_file_and_one_registry_line(tmp_path):
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
    kernels = in_copy(root, python, "-m", "pytest", "-c", os.devnull, "-p", "no:cacheprovider",
                      "-q", "--rootdir", str(root), "tests/test_rule_kernels.py", "-k",
                      "sign_momentum", timeout=900)
    # twins x 3 dtypes, the reference, the chunks, the padding; its NumPy twin allocates per
    # call (as the docs say), so the allocation test skips it for each of the 3 dtypes
    assert "6 passed, 3 skipped" in kernels and "failed" not in kernels, kernels
    rule = ("--rule", "sign_momentum")
    parity = on_ranks(root, 2, "parity.py", "rules", "engine-oracle", *rule)
    assert "OK parity: 3 rule cases (0 against one engine) x 10 steps, 3 rule cases against " \
           "one engine x 10 steps on 2 ranks" in parity, parity
    on_ranks(root, 2, "checkpoint.py", "save", str(tmp_path / "N2"), *rule)
    loaded = on_ranks(root, 1, "checkpoint.py", "load", str(tmp_path), *rule)
    assert "OK checkpoints: 4 loads on 1 ranks (sign_momentum)" in loaded, loaded


def test_every_rule_of_the_registry_is_a_complete_rule():
    for entry in builtin_rules().values():
        for rule in entry.variants:
            assert isinstance(rule, Rule) and not missing_members(rule), rule
            assert rule.tensor_sums in (0, 2)


def test_a_rule_missing_members_is_refused_on_every_rank():
    class Incomplete:  # duck-typed, without tensor_sums, settings, variants ...
        name, state_names, options = "incomplete", (), ("lr",)

        def check_options(self, lr):
            return {"lr": lr}

    assert {"tensor_sums", "scalars", "kernel"} <= set(missing_members(Incomplete()))
    with pytest.raises(TypeError, match="lacks .*kernel.*subclass zero1_mpi.rules.Rule"):
        ShardedOptimizer({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, Incomplete(),
                         {"lr": 0.1})
