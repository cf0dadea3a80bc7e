"""Session set-up shared by the tests, and the ``mpi_independent`` marker.

A test marked ``mpi_independent`` cannot depend on which MPI runs it: one process, an
example's numerics that the multi-rank cases already check under every MPI, or a world size
(moment, phase) whose MPI calls a sibling parametrization makes (``mpirun.SIBLING``). CI runs
the suite once per MPI and these in its first pass only: ``ZERO1_SKIP_MPI_INDEPENDENT=1``
skips them.

Where ``ZERO1_FRAMEWORK_SKIPS=FILE`` is set, the session writes to FILE (one node id a line)
every test and test module it skipped for a missing framework (torch, JAX, flax, optax,
transformers, accelerate, Sphinx, tqdm), and the tests marked ``framework_branch`` (they pass
without them and check more with them): CI runs the README's test command without them first,
as a new user would, then these again with the frameworks installed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = """
import numpy as np
from zero1_mpi.kernels.backend import PARAM_DTYPES
from zero1_mpi.kernels.local_sums import NumbaReductions
from zero1_mpi.rules.registry import builtin_rules
from zero1_mpi.wire.codec import NumbaCodec
from zero1_mpi.wire.sizes import packed_bytes
reductions, codec = NumbaReductions(), NumbaCodec(64)
for dtype in PARAM_DTYPES.values():
    for entry in builtin_rules().values():
        for rule in entry.variants:
            s = rule.scalars(1, rule.check_options(**entry.defaults), 1.0)
            kernel = rule.kernel("numba", 64)
            state = [np.zeros(64, np.float32) for _ in range(1 + len(rule.state_names))]
            param = None if dtype == np.float32 else np.ones(64, dtype)
            if rule.tensor_sums:
                kernel.tensor_sums(np.ones(64, dtype), *state, s)
                kernel.apply(*state, param, rule.tensor_scalars(s, [1.0] * rule.tensor_sums))
            else:
                kernel(np.ones(64, dtype), *state, param, s)
    reductions.sum_of_squares(np.ones(64, dtype))
    reductions.sum_blocks(np.ones((2, 64), dtype), np.zeros(64, np.float32))
    packed = np.zeros(packed_bytes(64), np.uint8)
    codec.encode(np.ones(64, dtype), packed)
    codec.encode(np.ones(64, dtype), packed, np.zeros(64, dtype))
    codec.decode_sum(packed[None], 64, np.zeros(64, np.float32))
    codec.decode_add(packed, np.ones(64, dtype))
"""


@pytest.fixture(scope="session", autouse=True)
def warm_numba_cache():
    """Compile the Numba kernels (every registered rule's, the reductions, the 8-bit codec) once, before any
    multi-rank case runs: they are cached on disk (``cache=True``), so every rank then loads
    them instead of all ranks compiling at once under their cases' timeouts (a fresh clone
    starts with a cold cache). In a process of its own: where Numba is missing or fails, the
    cases run as they would have anyway."""
    subprocess.run([sys.executable, "-c", WARM_UP], cwd=ROOT, capture_output=True, timeout=300)


#: The packages whose absence a test may skip for (matched in the skip's reason); tqdm comes
#: with transformers.
FRAMEWORKS = ("torch", "jax", "flax", "optax", "transformers", "accelerate", "sphinx", "myst",
              "tqdm")
_FRAMEWORK_SKIPS: list[str] = []


def _note_framework_skip(report) -> None:
    reason = str(report.longrepr).lower()
    if report.skipped and any(name in reason for name in FRAMEWORKS):
        _FRAMEWORK_SKIPS.append(report.nodeid)


def pytest_collectreport(report):
    _note_framework_skip(report)


def pytest_runtest_logreport(report):
    if report.when == "setup" or report.when == "call":
        _note_framework_skip(report)


def pytest_sessionfinish(session):
    path = os.environ.get("ZERO1_FRAMEWORK_SKIPS")
    if path:
        ids = dict.fromkeys(_FRAMEWORK_SKIPS)
        Path(path).write_text("".join(f"{nodeid}\n" for nodeid in ids))


def pytest_configure(config):
    config.addinivalue_line("markers", "framework_branch: passes without torch, JAX, "
                            "transformers or Sphinx but checks more with them: CI runs it "
                            "again once they are installed (ZERO1_FRAMEWORK_SKIPS)")
    config.addinivalue_line("markers", "mpi_independent: the same under every MPI; CI runs it "
                            "in its first pass only (ZERO1_SKIP_MPI_INDEPENDENT=1 skips it)")


def pytest_collection_modifyitems(config, items):
    # a test that passes without the frameworks but takes another branch with them: again
    _FRAMEWORK_SKIPS.extend(i.nodeid for i in items if i.get_closest_marker("framework_branch"))
    if os.environ.get("ZERO1_SKIP_MPI_INDEPENDENT") != "1":
        return
    skip = pytest.mark.skip(reason="MPI-independent: run in another MPI's pass "
                                   "(ZERO1_SKIP_MPI_INDEPENDENT=1)")
    for item in items:
        if item.get_closest_marker("mpi_independent"):
            item.add_marker(skip)
