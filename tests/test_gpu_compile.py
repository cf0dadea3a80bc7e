"""Every CuPy kernel of the package compiles, on a machine with no GPU: tools/gpu_compile_check.py.

The tool drives the package's CuPy code on stand-in arrays, has CuPy generate each kernel's
source, and compiles it with NVRTC for compute_80 and compute_90. It needs CuPy >= 14, NVRTC and
the CUDA headers (wheels, no driver: ``pip install ".[cuda12]"``); where one is missing these
tests skip with the tool's reason, unless ``ZERO1_REQUIRE_GPU_COMPILE=1`` (set where CI installs
them), where they fail. Also: a missing CUDA header at run time names the extra to install.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_compile_check.py"
REQUIRED = os.environ.get("ZERO1_REQUIRE_GPU_COMPILE") == "1"

#: Each kernel the package builds, and how many sources it compiles to: one per type
#: combination the engine launches it with (16-bit parameters P: fp16, bf16; gradients G: the
#: parameter dtype, or fp32 once summed in fp32); the sum of squares also compiles CuPy's two
#: CUB passes per dtype. A kernel added to the package must be added here.
EXPECTED = {
    "zero1_adam_fp32": 1, "zero1_adam_mixed": 4,                    # G x P
    "zero1_sgd_fp32": 1, "zero1_sgd_mixed": 4,
    "zero1_sgd_fp32_momentum": 1, "zero1_sgd_mixed_momentum": 4,
    "zero1_lion_fp32": 1, "zero1_lion_mixed": 4,
    "zero1_lamb_moments": 3, "zero1_lamb_u_sq": 1,                  # G: fp32, fp16, bf16
    "zero1_lamb_fp32": 1, "zero1_lamb_mixed": 2,                    # P
    "zero1_sum_of_squares": 9,                                      # (generic, CUB 1, 2) x 3
    "zero1_int8_scales": 3, "zero1_int8_quantize": 3,               # the 8-bit wire: X
    "zero1_int8_scales_feedback": 3, "zero1_int8_quantize_feedback": 3,
    "zero1_int8_decode_sum": 1, "zero1_int8_decode_add": 3,
    "zero1_remainder_decode": 1, "zero1_remainder_encode": 1,       # bf16 masters' remainders
    "zero1_state_bf16_widen": 1, "zero1_state_bf16_round": 1,       # state_dtype="bfloat16"
    "zero1_state_int8_decode": 1, "zero1_state_int8_scales": 1,     # state_dtype="int8"
    "zero1_state_int8_quantize": 1,
}
#: The one pass over the other stored forms (kernels/cuda_generated.py): bf16 and 8-bit state
#: beside fp32 parameters (G = fp32) and fp32 masters (G x P), and bf16's remainder masters
#: with each state (G: bf16, fp32); SGD without momentum keeps no state.
for _base in ("zero1_adam_{}", "zero1_lion_{}", "zero1_sgd_{}_momentum"):
    for _masters, _count in (("fp32", 1), ("mixed", 4), ("remainder", 2)):
        for _state in ("_bf16state", "_int8state"):
            EXPECTED[_base.format(_masters) + _state] = _count
    EXPECTED[_base.format("remainder")] = 2
EXPECTED["zero1_sgd_remainder"] = 2
LINE = re.compile(r"^(ok  |FAIL) (zero1_\w+)")


def run_tool(*args: str, timeout: float) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("cupy") is None and not REQUIRED:
        pytest.skip("CuPy is not installed (pip install '.[cuda12]')")
    result = subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode == 2:  # CuPy, NVRTC or the headers missing: the tool says which
        reason = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "rc 2"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    return result


def kernel_lines(output: str, status: str) -> Counter:
    return Counter(m.group(2) for m in map(LINE.match, output.splitlines())
                   if m and m.group(1).strip() == status)


def test_every_kernel_compiles_for_sm80_and_sm90():
    result = run_tool(timeout=900)
    out = result.stdout
    total = sum(EXPECTED.values())
    assert result.returncode == 0, out
    assert out.strip().splitlines()[-1] == f"{total} kernels compiled, 0 failed", out
    assert "FAIL" not in out, out
    assert kernel_lines(out, "ok") == Counter(EXPECTED), out
    assert all("compute_80,90" in line for line in out.splitlines() if LINE.match(line))


def test_a_typo_in_a_kernel_body_fails_and_names_the_kernel():
    result = run_tool("--break", "zero1_lion_mixed", "--only", "zero1_lion", timeout=300)
    out = result.stdout
    lion = {k: v for k, v in EXPECTED.items() if k.startswith("zero1_lion")}
    assert result.returncode == 1, out
    assert kernel_lines(out, "FAIL") == Counter({"zero1_lion_mixed": 4}), out
    del lion["zero1_lion_mixed"]  # (the kernels of the other stored forms are others)
    assert kernel_lines(out, "ok") == Counter(lion), out
    assert 'identifier "zero1_planted_compile_error" is undefined' in out, out
    assert out.strip().splitlines()[-1] == f"{sum(lion.values())} kernels compiled, 4 failed", out


def test_a_typo_in_a_reduction_fails_in_each_kernel_that_holds_it():
    # The map expression is in the generic kernel and CUB's first pass, not in the second.
    result = run_tool("--break", "zero1_sum_of_squares", "--only",
                      "zero1_sum_of_squares(T=bfloat16)", timeout=300)
    out = result.stdout
    assert result.returncode == 1, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2 and "CUB pass1" in fails[1], out
    assert out.strip().splitlines()[-1] == "1 kernels compiled, 2 failed", out


def test_a_missing_cuda_header_names_the_extra():
    """NVRTC's own message for a missing header (as it prints it with no include path)
    becomes an ImportError naming the extra; other compile errors pass through unchanged."""
    from zero1_mpi.kernels.backend import ExplainedKernel, missing_header_error
    log = ('k.cu(1): catastrophic error: could not open source file "cuda_fp16.h" (no '
           'directories in search list)\n  #include <cuda_fp16.h>')
    error = missing_header_error(RuntimeError(log))
    assert isinstance(error, ImportError)
    assert "cuda_fp16.h" in str(error) and "zero1-mpi[cuda12]" in str(error)
    assert missing_header_error(RuntimeError('error: identifier "neg_lrr" is undefined')) is None

    def compile_fails(message):
        def kernel(*args):
            raise RuntimeError(message)
        return ExplainedKernel(kernel)

    with pytest.raises(ImportError, match="cuda_bf16.h"):
        compile_fails('could not open source file "cuda_bf16.h"')(1, 2)
    with pytest.raises(RuntimeError, match="neg_lrr"):
        compile_fails('identifier "neg_lrr" is undefined')(1, 2)


def test_another_cupy_version_fails_and_says_what_to_update():
    """The tool models CuPy internals of one version (``CUPY_MODELLED``, pinned in .ci/run)."""
    run_tool("--only", "zero1_lion_fp32", timeout=300)  # skips where the tool cannot run
    code = ("import sys; sys.path.insert(0, 'tools'); import gpu_compile_check as tool; "
            "tool.CUPY_MODELLED = (13, 0); sys.exit(tool.main(['--only', 'zero1_lion_fp32']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert result.returncode == 1, result.stdout
    assert "models the private code generation of CuPy 13.0" in result.stdout
    assert "set CUPY_MODELLED, and pin that version in .ci/run" in result.stdout


def test_a_registered_rule_is_compiled_too(tmp_path):
    """The rule of docs/update-rules.md added as one file and one registry line (in a copy of
    the package): the tool finds, builds and compiles its kernels beside everyone else's."""
    run_tool("--only", "zero1_lion_fp32", timeout=300)  # skips where the tool cannot run
    from test_rule_registry import copy_with_readme_rule
    root = copy_with_readme_rule(tmp_path)
    result = subprocess.run([sys.executable, "tools/gpu_compile_check.py"], cwd=root,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=900, env={**os.environ, "PYTHONPATH": str(root)})
    out = result.stdout
    expected = Counter(EXPECTED) + Counter({"zero1_sign_momentum_fp32": 1,
                                            "zero1_sign_momentum_mixed": 4})
    assert result.returncode == 0, out
    assert kernel_lines(out, "ok") == expected, out
    assert "zero1_mpi/rules/sign_momentum.py" in out
