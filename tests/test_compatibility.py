"""What users' code and files rely on keeps working when the package moves inside: the public
import paths, ``python -m`` programs and console scripts of 0.1.0, and a checkpoint that 0.1.0
wrote (tests/data/checkpoint-0.1.0, tests/cases/kept_checkpoint.py) loading bit for bit."""

import importlib
import importlib.metadata
import re
import subprocess
import sys
import warnings
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


#: The module paths of 0.1.0's API reference (its docs/api.md), written out here rather than
#: read from zero1_mpi.moved, so that a path the mapping forgets fails.
API_0_1_0 = [
    "backend", "binding", "buckets", "checkpoint", "comm", "configure", "engine", "exchange",
    "export", "gathers", "grad_shards", "gradients", "jax", "jax_params", "kernels_numba",
    "launcher", "layout", "ledger", "masters", "memory", "memory_tool", "nccl", "offload",
    "options", "params", "persistence", "plan", "preemption", "progress", "reductions", "rule",
    "rules", "rules.adam", "rules.lamb", "rules.lion", "rules.options", "rules.registry",
    "rules.sgd", "scaler", "schedules", "spellings", "state", "state_dtypes", "step",
    "topology", "torch", "torch_compat", "transformers", "views", "watchdog", "wire",
]
#: A name each moved module held in 0.1.0, and where it is now.
OLD_NAMES = {
    "zero1_mpi.checkpoint.CheckpointError": "zero1_mpi.persistence.manifest",
    "zero1_mpi.options.Values": "zero1_mpi.config.options",
    "zero1_mpi.export.save_consolidated": "zero1_mpi.persistence.consolidated",
    "zero1_mpi.masters.RemainderMasters": "zero1_mpi.state.masters",
    "zero1_mpi.state_dtypes.Int8State": "zero1_mpi.state.int8_blocks",
    "zero1_mpi.wire.NumbaCodec": "zero1_mpi.wire.codec",
    "zero1_mpi.state.ShardedState": "zero1_mpi.state.sharded",
    "zero1_mpi.step.StepPipeline": "zero1_mpi.step.pipeline",
    "zero1_mpi.params.decay_groups": "zero1_mpi.flat.inputs",
}


def _fresh_import(module: str, moved: bool):
    """``module`` imported, anew where it is a ``moved`` one (an alias: its objects are the new
    modules'; a real module imported twice would make second copies of its classes), and the
    warnings the import gave."""
    if moved:
        sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        imported = importlib.import_module(module)
    return imported, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("module", API_0_1_0)
def test_every_module_path_of_0_1_0_imports(module):
    framework = {"torch": "torch", "torch_compat": "torch", "transformers": "transformers"}
    if module in framework:
        pytest.importorskip(framework[module])
    from zero1_mpi.moved import MOVED
    path = f"zero1_mpi.{module}"
    moved = path in MOVED and not MOVED[path][0].startswith(path + ".")
    imported, warned = _fresh_import(path, moved)
    assert len(warned) == moved, [str(w.message) for w in warned]
    if moved:  # the message names the new homes, and the module holds their public names
        homes = MOVED[path]
        assert all(home in str(warned[0].message) for home in homes)
        assert "0.2.0" in str(warned[0].message)
        for home in map(importlib.import_module, homes):
            for name in getattr(home, "__all__", []):
                assert getattr(imported, name) is getattr(home, name) or any(
                    name in vars(importlib.import_module(h)) for h in homes[:homes.index(
                        home.__name__)]), name


@pytest.mark.mpi_independent
@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_a_name_from_an_old_path_is_the_new_object_with_a_warning(old):
    module, name = old.rsplit(".", 1)
    importlib.import_module("zero1_mpi")
    if not hasattr(sys.modules.get(module), "__path__"):
        sys.modules.pop(module, None)  # a moved module: imported anew, to warn again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(OLD_NAMES[old]), name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1 and OLD_NAMES[old] in messages[0], messages


@pytest.mark.mpi_independent
def test_the_warning_points_at_the_line_that_imports():
    sys.modules.pop("zero1_mpi.export", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import zero1_mpi.export  # noqa: F401
        from zero1_mpi.step import StepPipeline  # noqa: F401
    found = [(w.filename, w.lineno) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(found) >= 2 and {f for f, _ in found} == {__file__}, found


@pytest.mark.mpi_independent
def test_an_unknown_name_of_an_old_package_path_is_an_attribute_error():
    import zero1_mpi.state
    with pytest.raises(ImportError, match="nothing_of_0_1_0"):
        from zero1_mpi.state import nothing_of_0_1_0  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("zero1_mpi.never_a_module")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from zero1_mpi.state import masters  # a submodule: no warning
    assert masters.__name__ == "zero1_mpi.state.masters"


@pytest.mark.mpi_independent
@pytest.mark.framework_branch  # (conftest.py)
def test_the_docs_and_changelog_cite_only_paths_that_import_without_a_warning():
    """Every ``zero1_mpi.x.y`` the README, docs/ and CHANGELOG cite is a module or a module's
    attribute of today's layout (no old path, no DeprecationWarning), but in the paragraphs
    that say they are about 0.1.0's paths."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for page in pages:
        text = "\n\n".join(p for p in re.split(r"\n\s*\n|\n(?=- )", page.read_text())
                           if "0.1.0's" not in p)
        for cited in sorted(set(re.findall(r"`(zero1_mpi(?:\.[A-Za-z_]\w*)+)", text))):
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                if not _resolves(cited):
                    bad.append(f"{page.name}: {cited}")
    assert not bad, bad


def _resolves(path: str) -> bool:
    from zero1_mpi.moved import MOVED
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MOVED and not MOVED[module][0].startswith(module + "."):
            return False  # 0.1.0's path of a moved module
        try:
            value = importlib.import_module(module)
        except ImportError as exc:
            if exc.name and not exc.name.startswith("zero1_mpi"):
                return True  # a binding whose framework is not installed here: CI has it
            continue
        except DeprecationWarning:  # below a moved module
            return False
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except (AttributeError, DeprecationWarning):
            return False
        return True
    return False
