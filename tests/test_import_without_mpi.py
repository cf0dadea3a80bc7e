"""``import zero1_mpi`` starts no MPI (the first communicator does), and everything that needs
no communicator works where mpi4py finds no MPI library (``MPI4PY_LIBMPI`` pointed at none):
the package and all its modules import, the memory tool runs, the docs' configuration loads;
the first ``Communicator`` raises an ImportError that says what to install."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi_independent  # (conftest.py)


def python(code: str, no_mpi: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if no_mpi:
        env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so"  # mpi4py finds no MPI library
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_import_starts_no_mpi():
    done = python("import sys, zero1_mpi, zero1_mpi.engine, zero1_mpi.rules.registry\n"
                  "assert 'mpi4py.MPI' not in sys.modules, 'MPI was started'\n"
                  "zero1_mpi.Communicator()\n"
                  "assert 'mpi4py.MPI' in sys.modules\nprint('OK')", no_mpi=False)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


@pytest.mark.framework_branch  # (conftest.py)
def test_without_an_mpi_library_what_needs_none_works():
    code = """
import importlib.util, pkgutil, sys, zero1_mpi
from zero1_mpi.cli.memory import main
# modules that need torch: imported last, and only where it is installed (the two public
# bindings not at all: they start MPI); every other module imports neither torch nor
# transformers (JAX's take JAX where it is installed, and import without it)
needs = {"zero1_mpi.torch": None, "zero1_mpi.transformers": None, "zero1_mpi.memory.__main__": None,
         "zero1_mpi.bindings.torch_binding": "torch", "zero1_mpi.bindings.torch_compat": "torch",
         "zero1_mpi.bindings.torch_units": "torch"}
for module in pkgutil.walk_packages(zero1_mpi.__path__, "zero1_mpi."):
    if module.name not in needs:
        __import__(module.name)
frameworks = {"torch", "transformers"} & set(sys.modules)
assert not frameworks, f"a module outside the bindings imported {frameworks}"
for name, framework in needs.items():
    if framework and importlib.util.find_spec(framework):
        __import__(name)
assert main(["--params", "7B", "--ranks", "8"]) == 0
import runpy
runpy.run_path("docs/conf.py")
try:
    zero1_mpi.Communicator()
except ImportError as exc:
    print("RAISED", exc)
"""
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert "Stage 2" in done.stdout and "zero1_mpi with shard_gradients=True" in done.stdout
    assert "RAISED zero1_mpi needs an MPI library" in done.stdout
    assert "pip install 'zero1-mpi[mpich]'" in done.stdout


def test_the_memory_tool_runs_as_a_program_without_mpi():
    done = subprocess.run([sys.executable, "-m", "zero1_mpi.memory", "--params", "1B",
                           "--ranks", "4"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}, timeout=120)
    assert done.returncode == 0 and "Per-GPU memory (GB) for a 1B" in done.stdout, done.stderr
