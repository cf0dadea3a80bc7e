"""Sphinx configuration: pages in Markdown (MyST), the API reference from the docstrings.

Build (CI's ``tests/test_docs.py`` builds the same way, warnings as errors)::

    python -m pip install ".[docs]"
    python -m sphinx -W --keep-going -b html docs build/docs
"""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

import zero1_mpi  # noqa: E402

project = "zero1_mpi"
copyright = "zero1_mpi authors; MIT license"
release = version = zero1_mpi.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3  # links such as clusters.md#slurm

html_theme = "alabaster"
html_theme_options = {"description": "ZeRO stage 1 over MPI", "fixed_sidebar": True}
html_title = "zero1_mpi"

autodoc_member_order = "bysource"
# Optional packages the adapters and device code import: stand-ins where they are missing, so
# the reference builds without torch, JAX, CuPy or Numba installed.
autodoc_mock_imports = [name for name in ("torch", "jax", "cupy", "cupy_backends", "numba",
                                          "transformers", "accelerate")
                        if importlib.util.find_spec(name) is None]
autodoc_default_options = {"members": True, "show-inheritance": True}
# Google-style docstrings. The engine's docstring has a section "Engine options (keyword-only):"
# that napoleon's section pattern (letters and spaces) cannot match: it is renamed before
# napoleon reads it, and rendered as a parameter list.
napoleon_custom_sections = [("Engine options", "params_style")]


def _engine_options_section(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        if line.strip() == "Engine options (keyword-only):":
            lines[i] = line.replace("Engine options (keyword-only):", "Engine options:")


def setup(app):
    app.connect("autodoc-process-docstring", _engine_options_section, priority=100)
