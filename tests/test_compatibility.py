"""What users' code and files rely on keeps working when the package moves inside: the public
import paths, ``python -m`` programs and console scripts of 0.1.0, and a checkpoint that 0.1.0
wrote (tests/data/checkpoint-0.1.0, tests/cases/kept_checkpoint.py) loading bit for bit."""

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import SIBLING, run_mpi

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "tests" / "data" / "checkpoint-0.1.0"

#: 0.1.0's public paths: ``module: names`` that user code imports from it.
PUBLIC = {
    "zero1_mpi": ["ZeroAdam", "ZeroAdamW", "ZeroSGD", "ZeroLion", "ZeroLAMB", "ShardedOptimizer",
                  "StepInfo", "Rule", "LossScaler", "decay_groups", "MemoryReport",
                  "Communicator", "CollectiveError", "CheckpointError", "Layout", "build_layout"],
    "zero1_mpi.comm": ["Communicator", "CollectiveError"],
    "zero1_mpi.layout": ["Layout", "Bucket", "TensorSlot", "build_layout", "DEFAULT_ALIGN",
                         "DEFAULT_BUCKET_ELEMENTS", "check_bucket_elements"],
    "zero1_mpi.memory": ["MemoryReport", "stage_bytes", "stage1_bytes", "stage2_bytes",
                         "stage3_bytes", "baseline_bytes", "format_table", "parse_param_count"],
    "zero1_mpi.plan": ["plan", "compare", "packed_bytes", "parse_rate", "parse_seconds", "main"],
    "zero1_mpi.launcher": ["launch_command", "run", "LauncherError", "LaunchTimeout"],
    "zero1_mpi.progress": ["Progress"],
    "zero1_mpi.rules": ["Rule", "Kernel", "TwoPhaseKernel", "missing_members"],
    "zero1_mpi.rules.registry": ["NAMES", "get", "builtin_rules", "rule_bytes_per_param"],
}
FRAMEWORKS = {"zero1_mpi.torch": ("torch", ["ZeroOptimizer", "as_array", "as_tensor"]),
              "zero1_mpi.jax": ("jax", ["ZeroOptimizer", "leaf_names"])}


@pytest.mark.mpi_independent
@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_paths_import(module):
    imported = importlib.import_module(module)
    assert not [name for name in PUBLIC[module] if not hasattr(imported, name)]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("module", sorted(FRAMEWORKS))
def test_binding_paths_import(module):
    framework, names = FRAMEWORKS[module]
    pytest.importorskip(framework)
    imported = importlib.import_module(module)
    assert not [name for name in names if not hasattr(imported, name)]


@pytest.mark.mpi_independent
def test_old_paths_are_the_new_objects():
    """A re-export is the object itself, not a copy: ``isinstance`` and patches agree."""
    from zero1_mpi import comm, layout, plan
    from zero1_mpi.cli import plan as cli_plan
    from zero1_mpi.comm import communicator
    from zero1_mpi.flat import layout as flat_layout
    assert layout.build_layout is flat_layout.build_layout and layout.Layout is flat_layout.Layout
    assert plan.plan is cli_plan.plan and plan.main is cli_plan.main
    assert comm.Communicator is communicator.Communicator


@pytest.mark.mpi_independent
@pytest.mark.parametrize("program", ["zero1_mpi.memory", "zero1_mpi.plan"])
def test_python_m_programs_run(program):
    done = subprocess.run([sys.executable, "-m", program, "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0 and "--params" in done.stdout, done.stderr


@pytest.mark.mpi_independent
@pytest.mark.parametrize("script", ["zero1-memory", "zero1-plan"])
def test_console_scripts_point_at_programs(script):
    """The installed entry points (pyproject.toml's ``[project.scripts]``) load a ``main``."""
    try:
        found = [e for e in importlib.metadata.entry_points(group="console_scripts")
                 if e.name == script]
    except Exception as exc:  # noqa: BLE001 - any metadata problem: say it
        pytest.fail(f"entry points unreadable: {exc}")
    if not found:
        pytest.skip(f"{script} is not installed (pip install . installs it)")
    assert callable(found[0].load())


@pytest.mark.parametrize("n", [2, SIBLING(1), SIBLING(3)])
def test_a_checkpoint_of_0_1_0_loads_bit_for_bit(n, tmp_path):
    """On 2 ranks (where it was saved) the re-export is byte for byte the one 0.1.0 wrote and
    the next step bitwise 0.1.0's; on 1 and 3, the parameters, masters and fp32 tensors."""
    out = run_mpi(n, "kept_checkpoint.py", "check", str(KEPT), str(tmp_path), timeout=180).stdout
    assert f"OK the kept checkpoint loads bit for bit on {n} ranks" in out, out
