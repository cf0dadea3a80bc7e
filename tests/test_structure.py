"""The package's shape holds: no import loop (lazy imports counted), no import from a lower
layer up, every module imports first (into an interpreter holding none of the package's
modules), only ``zero1_mpi.comm`` imports mpi4py (and, tested on 4 ranks in
tests/cases/mpi_calls.py, calls an mpi4py object), parts stay small (no module above 500 lines,
no class above 300), and the engine stays a small composer of parts with no branch on a
feature option. (Every rule is a complete ``Rule``: tests/test_rule_registry.py; the engine's
options in every optimizer's signature: tests/test_options.py.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

import zero1_mpi
from zero1_mpi.config.options import OPTIONS
from zero1_mpi.rules.registry import NAMES


def needs_framework(name):
    """zero1_mpi.torch imports torch, zero1_mpi.transformers transformers too, which only their
    users install: skip them without."""
    if name in ("zero1_mpi.torch", "zero1_mpi.bindings.torch_compat",
                "zero1_mpi.bindings.torch_binding", "zero1_mpi.bindings.torch_units",
                "zero1_mpi.transformers"):
        pytest.importorskip("torch")
    if name == "zero1_mpi.transformers":
        pytest.importorskip("transformers")


pytestmark = pytest.mark.mpi_independent  # (conftest.py)

PACKAGE = Path(zero1_mpi.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports anywhere in it (functions included); a
    ``from X import y`` counts ``X.y`` where that is a module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    if name == "zero1_mpi.rules.registry":  # importlib: the registered rule modules
        found.update(f"zero1_mpi.rules.{rule}" for rule in NAMES)
    return {m for m in found if m in MODULES and m != name}


def test_the_package_has_no_import_loop():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert "zero1_mpi.engine" in graph["zero1_mpi.rules.adam"]  # the walk sees imports
    assert "zero1_mpi.rules.lamb" in graph["zero1_mpi.rules.registry"]
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                loop = stack[stack.index(target):] + [target]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


#: The package's layers, lowest first: a module imports only modules of its own layer or lower
#: ones (a new module must be placed here). Entry points (``__main__``) sit on top. A subpackage's
#: ``__init__`` sits with its lowest module (it is imported before any of them).
LAYERS = (
    ("pure: stdlib, numpy", {
        "flat", "flat.layout", "flat.views", "layout", "memory", "memory.formulas",
        "memory.report", "scaler", "progress", "launcher", "rules", "rules.protocol",
        "rules.options", "comm.watchdog", "bindings", "bindings.schedules",
        "bindings.optax_names", "cli", "cli.plan", "plan", "kernels", "wire", "wire.sizes",
        "gradients", "state", "persistence", "config", "step", "step.records", "moved"}),
    ("arrays and MPI", {
        "kernels.backend", "kernels.numba_shared", "kernels.numba_forms", "kernels.local_sums",
        "kernels.numba_scalars", "kernels.numba_generated", "kernels.cuda_generated",
        "comm",
        "comm.communicator", "comm.capabilities", "comm.agreement", "comm.started",
        "comm.staging", "flat.inputs", "wire.codec",
        "state.encodings", "state.int8_blocks"}),
    ("the engine's parts", {
        "comm.topology", "comm.nccl", "wire.gradient_exchange", "wire.param_gathers",
        "wire.unit_gathers",
        "gradients.stage1", "gradients.stage2", "gradients.source", "state.host",
        "state.masters", "state.placement", "state.sharded", "step.pipeline",
        "persistence.checkpoint", "persistence.consolidated", "persistence.preemption",
        "persistence.on_disk",
        "persistence.manifest", "persistence.publish", "config.options", "config.generated",
        "config.configure", "memory.ledger"}),
    ("the engine", {"engine"}),
    ("the optimizers", {"rules.adam", "rules.lamb", "rules.lion", "rules.sgd",
                        "rules.registry"}),
    ("the package, bindings and tools", {
        "", "bindings.common", "torch", "bindings.torch_compat", "bindings.torch_binding",
        "bindings.torch_units", "jax",
        "bindings.jax_params",
        "cli.memory", "memory.__main__"}),
    ("integrations of the bindings", {"transformers"}),
)


def test_no_module_imports_from_a_layer_above_it():
    layer = {f"zero1_mpi.{name}".rstrip("."): index
             for index, (_, names) in enumerate(LAYERS) for name in names}
    assert set(layer) == set(MODULES), f"place these in LAYERS: {set(MODULES) ^ set(layer)}"
    for name, path in MODULES.items():
        for target in imports_of(name, path):
            assert layer[target] <= layer[name], \
                f"{name} ({LAYERS[layer[name]][0]}) imports {target} ({LAYERS[layer[target]][0]})"


def test_the_engine_composes_parts_and_branches_on_no_feature():
    """``ShardedOptimizer`` at most 250 lines and engine.py at most 400; no ``if`` (or
    conditional expression) in engine.py names a feature option: a feature is a part."""
    source = (PACKAGE / "engine.py").read_text()
    tree = ast.parse(source)
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef)
              and node.name == "ShardedOptimizer"]
    assert cls.end_lineno - cls.lineno + 1 <= 250
    assert len(source.splitlines()) <= 400
    features = {o.name for o in OPTIONS} | {"offloaded", "on_host", "sharded", "mixed"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            named = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)} | \
                    {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            assert not named & features, f"engine.py:{node.lineno} branches on {named & features}"


#: The most lines a module and a class of the package may have: a part above them has
#: more than one job (split it where the jobs meet).
MODULE_LINES, CLASS_LINES = 500, 300


def test_no_module_above_500_lines_and_no_class_above_300():
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


#: Run in one fresh interpreter: each module imported first, into an interpreter that holds none
#: of the package's modules (all of them removed from ``sys.modules`` before each), as a fresh
#: interpreter would import it; prints ``{module: None or its traceback}`` as JSON.
FIRST_IMPORTS = """
import importlib, json, sys, traceback
found = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "zero1_mpi" or m.startswith("zero1_mpi.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
        found[name] = None
    except BaseException:
        found[name] = traceback.format_exc()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def first_imports() -> dict:
    """Each module of the package imported first (``FIRST_IMPORTS``): name -> its traceback,
    or None."""
    result = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, *sorted(MODULES)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports_first(name, first_imports):
    """No import loop hides behind the order in which other code imports the package: each
    module imports when it is the first of the package to be imported."""
    needs_framework(name)
    assert first_imports[name] is None, first_imports[name]


#: The module that imports mpi4py (at its first use): what the MPI library is, and its ``MPI``.
MPI4PY_IMPORTERS = {"zero1_mpi.comm.capabilities"}


def test_only_comm_imports_mpi4py():
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        assert "mpi4py" not in imported or name in MPI4PY_IMPORTERS, name


@pytest.mark.parametrize("n", [4])
def test_only_comm_calls_mpi4py_objects(n, tmp_path):
    """A spy communicator records every method called on it (and on the communicators split
    or duplicated from it) outside ``zero1_mpi.comm``: construction, overlapped steps,
    hierarchical groups, a layout mismatch, checkpoints and exports call none."""
    out = run_mpi(n, "mpi_calls.py", str(tmp_path), timeout=180).stdout
    assert f"OK no mpi4py calls outside zero1_mpi.comm on {n} ranks" in out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_states_its_contract_and_exports(name):
    """A module docstring that says the contract in about ten lines (a subpackage's, its table
    of contents, in about thirty), and an ``__all__`` whose names exist (empty only in a
    subpackage that re-exports nothing)."""
    needs_framework(name)
    module = __import__(name, fromlist=["_"])
    lines = 30 if module.__file__.endswith("__init__.py") else 11  # a table of contents
    assert module.__doc__ and len(module.__doc__.strip().splitlines()) <= lines, name
    exported = getattr(module, "__all__", None)
    assert exported is not None and all(hasattr(module, item) for item in exported), name
    assert exported or module.__file__.endswith("__init__.py"), f"{name} exports nothing"


@pytest.mark.parametrize("name", sorted(name for name, path in MODULES.items()
                                        if path.name == "__init__.py" and name != "zero1_mpi"))
def test_every_subpackage_docstring_is_its_table_of_contents(name):
    """A subpackage's docstring names each of its modules (``layout.py``), so that ``ls`` and
    the docstrings alone say where a new part goes."""
    folder = MODULES[name].parent
    modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    doc = __import__(name, fromlist=["_"]).__doc__
    assert not [m for m in modules if f"``{m}``" not in doc], (name, modules)


def test_every_planted_bug_finds_its_text_once():
    """tools/plant_bugs.py's plants can go stale when the code moves: each text it replaces
    must be in its file exactly once (the tool itself takes minutes: run it after big moves)."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import plant_bugs
    finally:
        sys.path.remove(str(root / "tools"))
    stale = [f"{bug.name}: {path}" for bug in plant_bugs.BUGS for path, old, _ in bug.edits
             if (root / path).read_text().count(old) != 1]
    assert not stale, stale
