"""The generated Numba passes (``zero1_mpi.kernels.numba_generated``): each combination the
engine runs, against the NumPy twins bit for bit, and the generated sources' disk cache.

On one process: every rule variant of the registry x masters (fp32, remainder) x state (fp32,
bf16, 8-bit) with bf16 parameters, and fp32 masters with fp16 and fp32 parameters; the initial masters
hold ties (half a bf16 step above an even parameter). On 2 ranks (tests/cases/
generated_kernels.py): the rules x masters x bf16 and 8-bit state x stage 1 and 2, NumPy
against Numba.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import casekit as kit
from zero1_mpi.kernels.backend import BFLOAT16

from mpirun import ROOT, run_mpi

pytest.importorskip("numba")

SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (5000,), "bias": (3,)}


def run(monkeypatch, kernel, variant, options, **engine):
    """Four steps of ``variant`` with ``kernel`` (``ZERO1_MPI_KERNEL``); the parameters and
    the state rows after each."""
    monkeypatch.setenv("ZERO1_MPI_KERNEL", kernel)
    opt = kit.build(
        variant,
        kit.groups_of(kit.with_ties(kit.init_values(SHAPES)), options),
        kit.world,
        options,
        bucket_elements=2048,
        **engine,
    )
    assert opt.kernel == kernel
    seen = []
    for step in range(4):
        kit.hand_over(opt, kit.grads_of(0, step, SHAPES, BFLOAT16))
        opt.step()
        rows = kit.state_rows(opt)
        seen.append(
            (
                {k: np.array(v) for k, v in opt.params.items()},
                {row: np.array(rows[row]) for row in opt.state_rows},
            )
        )
    opt.close()
    return seen


COMBINATIONS = [
    ("bfloat16", "remainder", "float32"),
    ("bfloat16", "remainder", "bfloat16"),
    ("bfloat16", "fp32", "float32"),
    ("bfloat16", "fp32", "bfloat16"),
    ("bfloat16", "remainder", "int8"),
    ("bfloat16", "fp32", "int8"),
    ("float32", "fp32", "int8"),
    ("float16", "fp32", "bfloat16"),
    ("float32", "fp32", "bfloat16"),
]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("param_dtype, masters, state_dtype", COMBINATIONS)
def test_the_generated_pass_is_the_numpy_twin_bit_for_bit(
    monkeypatch, param_dtype, masters, state_dtype
):
    cases = 0
    for entry in kit.registry().values():
        for variant, options in kit.variant_cases(entry):
            engine = {"param_dtype": param_dtype, "state_dtype": state_dtype, "max_grad_norm": 5.0}
            if param_dtype != "float32":
                engine["masters"] = masters
            want = run(monkeypatch, "numpy", variant, options, **engine)
            got = run(monkeypatch, "numba", variant, options, **engine)
            for step, ((params_a, rows_a), (params_b, rows_b)) in enumerate(zip(want, got)):
                where = f"{entry.name} {variant.settings()} step {step}"
                for k in params_a:
                    assert kit.same_bits(params_a[k], params_b[k]), f"{where}: params {k}"
                for row in rows_a:
                    assert kit.same_bits(rows_a[row], rows_b[row]), f"{where}: {row}"
            cases += 1
    assert cases >= 5


@pytest.mark.mpi_independent
def test_a_combination_is_written_once_and_a_changed_source_gets_another(monkeypatch, tmp_path):
    from zero1_mpi.kernels import numba_generated as gen
    from zero1_mpi.kernels.numba_forms import BF16_FORM, REMAINDER_FORM
    from zero1_mpi.kernels.numba_shared import BF16, FP32
    from zero1_mpi.rules.adam import NumbaAdam

    monkeypatch.setenv("ZERO1_MPI_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(gen, "_kernels", {})
    key = (NumbaAdam.element, FP32, BF16, REMAINDER_FORM, (BF16_FORM, BF16_FORM))
    gen.fused_kernel(*key)
    (path,) = tmp_path.glob("zero1_mpi_generated_*.py")
    text, written = path.read_text(), path.stat().st_mtime_ns
    assert "rne_bf16(p)" in text and "round_stochastic(x1, stream_at(seed1, a + i))" in text
    assert "# inlined sources: " in text
    monkeypatch.setattr(gen, "_kernels", {})  # (a new process)
    gen.fused_kernel(*key)
    assert path.stat().st_mtime_ns == written  # kept: Numba's cache of it stays valid
    monkeypatch.setattr(gen, "_kernels", {})
    monkeypatch.setattr(gen, "_INLINED", gen._INLINED + ("zero1_mpi.rules.lion",))
    gen.fused_kernel(*key)  # a changed inlined source: another file
    assert len(list(tmp_path.glob("zero1_mpi_generated_*.py"))) == 2


@pytest.mark.mpi_independent
def test_the_first_generation_on_a_machine_says_so_once(tmp_path):
    """Four processes that start together on a new cache directory (ranks, say): one line,
    from one of them, naming the combination and the directory; a later run: none."""
    code = (
        "from zero1_mpi.kernels import numba_generated as gen\n"
        "from zero1_mpi.kernels.numba_forms import FP32_FORM, INT8_FORM, REMAINDER_FORM\n"
        "from zero1_mpi.kernels.numba_shared import BF16, FP32\n"
        "from zero1_mpi.rules.lion import NumbaLion\n"
        "gen.fused_kernel(NumbaLion.element, FP32, BF16, REMAINDER_FORM, (INT8_FORM,))\n"
        "gen.fused_kernel(NumbaLion.element, FP32, FP32, FP32_FORM, (FP32_FORM,))\n"
    )
    env = {**os.environ, "ZERO1_MPI_KERNEL_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def run_together(n):
        runs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(n)]
        outs = [run.communicate(timeout=120) for run in runs]
        assert all(run.returncode == 0 for run in runs), outs
        return [line for _, err in outs for line in err.splitlines() if "zero1_mpi: " in line]

    lines = run_together(4)
    assert sorted(lines) == sorted([
        "zero1_mpi: compiling the Numba update for lion, bf16 parameters, fp32 gradients, "
        f"bf16 remainder masters, 8-bit state, once on this machine (10 s to a minute; later "
        f"runs load it from {tmp_path})",
        "zero1_mpi: compiling the Numba update for lion, fp32 parameters, fp32 gradients, "
        f"fp32 state, once on this machine (10 s to a minute; later runs load it from "
        f"{tmp_path})"]), lines
    assert run_together(2) == []


@pytest.mark.mpi_independent
def test_the_cache_directory_is_made_and_an_unwritable_one_is_named(monkeypatch, tmp_path):
    from zero1_mpi.kernels import numba_generated as gen

    monkeypatch.setenv("ZERO1_MPI_KERNEL_CACHE", str(tmp_path / "a" / "b"))
    assert gen.cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ZERO1_MPI_KERNEL_CACHE", str(tmp_path / "file" / "under"))
    with pytest.raises(OSError, match="set ZERO1_MPI_KERNEL_CACHE to one"):
        gen.cache_dir()


def test_numpy_and_numba_give_the_same_bits_on_2_ranks():
    """Shards starting inside tensors, stage 1 and 2, bf16 and 8-bit state (under every MPI)."""
    out = run_mpi(2, "generated_kernels.py", timeout=600).stdout
    assert "OK generated_kernels on 2 ranks" in out, out
