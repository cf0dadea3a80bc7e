"""The documentation (docs/ and the README): the Sphinx site builds with warnings as errors, the
code blocks run as written, and the tool outputs they quote are the tools' output today.

Every fenced ``python`` block says on its first line what it is: ``# run: mpiexec -n N`` (run
under ``mpiexec -n N python -m mpi4py``, tests/mpirun.py), ``# run`` (one plain process), ``# fragment:
...`` (a piece that a runnable block of the same page, or a script of the repository named after
the colon, completes) or ``# file: ...`` (a file that the test named after the colon installs
and runs); a fragment or file must compile. Each run starts in an empty
directory (its first line is replaced by a ``chdir`` there, so line numbers hold), with the
NumPy kernels and one thread per rank, and must exit 0 without a traceback; the blocks check
themselves with asserts. A block importing an optional package (torch, JAX, ...) skips where
it is missing (JAX: fails instead where ``ZERO1_REQUIRE_JAX=1``). A quoted block whose first
line is ``$ python -m zero1_mpi...``, ``$ python tools/memory_table.py ...`` or ``$ zero1-plan
...`` must equal what that command prints now. The build skips where Sphinx or MyST-Parser is
missing, and fails instead where ``ZERO1_REQUIRE_DOCS=1`` (CI).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
RUN_LINE = re.compile(r"# run(?:: mpiexec -n ([1-4]))?(?:\s+\(.*\))?")  # (a remark)
FRAGMENT_LINE = re.compile(r"# (fragment|file): \S.*")
QUOTED = re.compile(r"^```(?:text)?\n\$ (.*?)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: Commands whose quoted output a page may show: deterministic tools of this repository.
QUOTABLE = re.compile(r"(python -m zero1_mpi[.\w]*|python tools/memory_table\.py|zero1-plan)\b")
#: The pages: the README and docs/.
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
#: Packages a block may import that the package itself does not need.
OPTIONAL = ("torch", "jax", "flax", "optax", "safetensors", "cupy")
#: The pages that hold runnable blocks (so that a mark cannot vanish unnoticed).
RUNNABLE_PAGES = {"README", "getting-started", "numpy-cupy", "pytorch", "jax", "checkpoints",
                  "memory", "clusters"}


def python_blocks(runnable: bool) -> list:
    """``(page, first line, code)`` of every ``python`` block whose first line starts with
    ``# run`` (``runnable``), or of every other one."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            code = match.group(1)
            if bool(re.match(r"# run\b", code)) == runnable:
                line = text.count("\n", 0, match.start()) + 2
                found.append(pytest.param(page.stem, line, code, id=f"{page.stem}:{line}"))
    return found


def quoted_outputs() -> list:
    """``(page, line, command, output)`` of every quoted output of a ``QUOTABLE`` command."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in QUOTED.finditer(text):
            command, output = match.group(1), match.group(2)
            if QUOTABLE.match(command):
                line = text.count("\n", 0, match.start()) + 2
                found.append(pytest.param(page.stem, line, command, output,
                                          id=f"{page.stem}:{line}"))
    return found


BLOCKS = python_blocks(runnable=True)
#: The pages and blocks are the same under every MPI: CI runs them in its first (MPICH) pass.
pytestmark = pytest.mark.mpi_independent


def test_site_builds_without_warnings(tmp_path):
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("ZERO1_REQUIRE_DOCS") == "1":
            pytest.fail(f"ZERO1_REQUIRE_DOCS=1 but {', '.join(missing)} does not import: "
                        "pip install '.[docs]'")
        pytest.skip(f"{', '.join(missing)} not installed (pip install '.[docs]')")
    out = tmp_path / "html"
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                             "html", str(DOCS), str(out)], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    api = (out / "api.html").read_text()
    for name in ("zero1_mpi.ZeroAdam", "zero1_mpi.ShardedOptimizer.step",
                 "module-zero1_mpi.torch", "zero1_mpi.jax.ZeroOptimizer"):  # from docstrings
        assert f'id="{name}"' in api, name
    assert (out / "update-rules.html").read_text().count('class="math') >= 4


def test_the_runnable_blocks_are_where_they_belong():
    assert {param.values[0] for param in BLOCKS} >= RUNNABLE_PAGES


@pytest.mark.parametrize("page, line, code", python_blocks(runnable=False))
def test_every_other_block_is_a_fragment_of_a_runnable_one(page, line, code):
    first = code.partition("\n")[0].rstrip()
    mark = FRAGMENT_LINE.fullmatch(first)
    assert mark, (
        f"{page}.md:{line}: a python block that neither runs ('# run' or '# run: mpiexec -n N')"
        " nor says what completes it ('# fragment: ...') or which test installs it as a file "
        "('# file: ...')")
    compile(code, f"{page}.md:{line}", "exec")
    named = [path for path in re.findall(r"[\w./-]+\.py", first) if (ROOT / path).is_file()]
    if mark.group(1) == "file":
        assert any(path.startswith("tests/") for path in named), \
            f"{page}.md:{line}: '# file:' names no test of this repository that installs it"
    else:
        assert named or page in {param.values[0] for param in BLOCKS}, (
            f"{page}.md:{line}: a fragment on a page with no runnable block, naming no "
            "script of this repository that completes it")


@pytest.mark.parametrize("page, line, command, output", quoted_outputs())
def test_quoted_outputs_are_what_the_tools_print(page, line, command, output):
    argv = command.split()
    if argv[0] == "zero1-plan":
        argv = ["python", "-m", "zero1_mpi.plan"] + argv[1:]
    argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip() == output.rstrip(), (
        f"{page}.md:{line}: the quoted output of {command!r} is stale; it prints now:\n"
        f"{done.stdout}")


def test_the_quoted_outputs_are_found():
    assert len(quoted_outputs()) >= 4


#: This machine's own directories (found here, not written down): the checkout's parent, the
#: home directory and the temporary one.
MACHINE_PLACES = sorted({str(DOCS.parent.parent) + os.sep, str(Path.home()) + os.sep,
                         tempfile.gettempdir() + os.sep} - {os.sep})


def test_pages_name_no_local_paths():
    for page in sorted(DOCS.iterdir()):
        if page.suffix in (".md", ".py"):
            text = page.read_text()
            local = [place for place in MACHINE_PLACES if place in text]
            assert not local, f"{page.name} names paths of one machine: {local}"


@pytest.mark.parametrize("page, line, code", BLOCKS)
def test_block_runs(tmp_path, page, line, code):
    first, _, rest = code.partition("\n")
    mark = RUN_LINE.fullmatch(first.rstrip())
    assert mark, (f"{page}.md:{line}: {first!r} is not a run line: '# run' or "
                  "'# run: mpiexec -n N' (N in 1..4)")
    imported = set(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.MULTILINE))
    for module in sorted(imported.intersection(OPTIONAL)):
        if importlib.util.find_spec(module) is None:
            if module in ("jax", "flax") and os.environ.get("ZERO1_REQUIRE_JAX") == "1":
                pytest.fail(f"ZERO1_REQUIRE_JAX=1 but {module} does not import")
            pytest.skip(f"docs/{page}.md:{line} needs {module}")
    script, work = tmp_path / f"{page}_{line}.py", tmp_path / "work"
    work.mkdir()
    script.write_text(f"import os, sys; os.chdir(sys.argv[1])  {first}\n{rest}")
    if mark.group(1):
        run_mpi(int(mark.group(1)), str(script), str(work), timeout=180)
        return
    env = {**os.environ, "ZERO1_MPI_KERNEL": "numpy", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script), str(work)], check=False, cwd=work,
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        f"docs/{page}.md:{line} failed\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
