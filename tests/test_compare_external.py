"""``tools/compare_external.py``: ``ZeroLion`` and ``ZeroLAMB`` beside the other libraries' Lion
and LAMB, the verdicts that docs/update-rules.md quotes. Each comparison is asserted only where
its package is installed (CI installs none of them: lion-pytorch, optax, timm,
pytorch_optimizer); the tool runs once, in a process of its own."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compare_external.py"
LINE = re.compile(r"^(?P<name>Zero\S+ vs .+?)\s+wd=(?P<wd>\S+)\s+bitwise=(?P<bitwise>yes|no)\s+"
                  r"max_rel_err=(?P<err>\S+)\s+(?P<verdict>equal|differs)$")
PAPER = "timm Lamb(always_adapt=True, max_grad_norm=None)"
# (comparison, its package's module, the verdict, bitwise equal): the same for every weight decay.
EXPECTED = [
    ("ZeroLion vs lion_pytorch.Lion fp32", "lion_pytorch", "equal", True),
    ("ZeroLion vs optax.lion f64 (x64)", "optax", "equal", None),
    ("ZeroLAMB vs optax.lamb f64 (x64)", "optax", "equal", None),
    (f"ZeroLAMB vs {PAPER} fp32", "timm", "equal", None),
    (f"ZeroLAMB vs {PAPER} f64", "timm", "equal", None),
    ("ZeroLAMB vs timm Lamb defaults fp32", "timm", "differs", False),
    ("ZeroLAMB vs pytorch_optimizer.Lamb defaults fp32", "pytorch_optimizer", "differs", False),
]
LION_DECAYS, LAMB_DECAYS = {"0", "0.1"}, {"0", "0.01"}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, re.Match]]:
    """The tool's comparisons: name -> weight decay -> its line's match."""
    run = subprocess.run([sys.executable, str(TOOL)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    out: dict[str, dict[str, re.Match]] = {}
    for line in run.stdout.splitlines():
        if m := LINE.match(line):
            out.setdefault(m["name"], {})[m["wd"]] = m
    assert run.stdout.splitlines()[-1].startswith("versions: "), run.stdout
    return out


@pytest.mark.parametrize("name, module, verdict, bitwise", EXPECTED,
                         ids=[e[0].split(" vs ")[1] for e in EXPECTED])
def test_verdict(rows, name, module, verdict, bitwise):
    if not installed(module):
        pytest.skip(f"{module} is not installed")
    decays = LION_DECAYS if name.startswith("ZeroLion") else LAMB_DECAYS
    assert set(rows.get(name, {})) == decays, f"{name}: {sorted(rows.get(name, {}))}"
    for wd, m in rows[name].items():
        assert m["verdict"] == verdict, m.string
        if bitwise is not None:
            assert (m["bitwise"] == "yes") == bitwise, m.string
        if verdict == "equal":
            assert float(m["err"]) <= 1e-6, m.string


def test_optax_lamb_float32(rows):
    """optax in float32 (its default) evaluates LAMB's bias corrections in float32: close, but
    not within the tolerance."""
    if not installed("optax"):
        pytest.skip("optax is not installed")
    for wd, m in rows["ZeroLAMB vs optax.lamb f32"].items():
        assert 1e-6 < float(m["err"]) < 1e-4, m.string


def test_no_other_rows(rows):
    """Every comparison the tool printed is one of those above, or optax's float32 LAMB."""
    assert set(rows) <= {e[0] for e in EXPECTED} | {"ZeroLAMB vs optax.lamb f32"}


def test_require():
    """``--require``: a package that is not importable (here hidden) is an error, exit 2."""
    hide = ("import runpy, sys; sys.modules['pytorch_optimizer'] = None; "
            f"sys.argv = [{str(TOOL)!r}, '--require']; "
            f"runpy.run_path({str(TOOL)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "pytorch_optimizer is not importable" in run.stderr
    assert run.stdout == ""
