"""The CuPy twins' generated one pass (``zero1_mpi.kernels.cuda_generated``), on the CPU: each
combination's CUDA source run by ``cuda_on_cpu`` (the host's C++ compiler, element after
element) against the NumPy twin bit for bit, through the stored forms the engine hands it; and
the CuPy twin unfused (decoding and encoding kernels around the update: the offloaded share's
device side) likewise.

Every elementwise rule variant of the registry x (fp32 parameters; bf16 with fp32 or remainder
masters; fp16 with fp32 masters) x state (fp32, bf16, 8-bit), four steps, on a range of a
quantized tensor piece with a partial last block and one of a small tensor (kept in fp32 by the
8-bit state). The masters start with ties (half a bf16 step above an even parameter) and some
steps make new ones. On a GPU, tests/test_gpu.py runs the same kernels (within NVRTC's
contraction of ``a * b + c``).
"""

import numpy as np
import pytest

import casekit as kit
import cuda_on_cpu
from zero1_mpi.kernels import backend
from zero1_mpi.kernels.numba_forms import master_form
from zero1_mpi.state.encodings import state_for
from zero1_mpi.state.masters import masters_for

pytestmark = [
    pytest.mark.mpi_independent,
    pytest.mark.skipif(cuda_on_cpu.available() is not None, reason=str(cuda_on_cpu.available())),
]

#: ``(start, stop, quantized)``: a tensor piece of 5000 (a partial last block), a small one.
SEGMENTS = [(0, 5000, True), (5000, 5300, False)]
N = SEGMENTS[-1][1]
COMBINATIONS = [  # (param dtype, masters, state dtype)
    (p, m, s)
    for p, m in (("float32", "fp32"), ("bfloat16", "fp32"), ("bfloat16", "remainder"),
                 ("float16", "fp32"))
    for s in ("float32", "bfloat16", "int8")
]  # fmt: skip


@pytest.fixture
def cuda_on_the_cpu(monkeypatch):
    """``backend``'s CuPy is the CPU model (kernels built afresh)."""
    monkeypatch.setattr(backend, "_cupy", lambda: cuda_on_cpu.CpuCupy)
    monkeypatch.setattr(backend, "_ELEMENTWISE", {})


class Twin:
    """One rank's shard of ``N`` elements kept by one twin (``kind``) as the engine keeps it."""

    def __init__(self, kind, rule, param_dtype, masters, state_dtype, init, fused=False):
        self.kind, self.rule, self.fused = kind, rule, fused
        self.kernel = rule.kernel(kind, N)
        dtype = backend.resolve_dtype(param_dtype)
        self.mixed = dtype != np.float32
        self.param = init.astype(dtype)
        self.masters = None
        if self.mixed:
            self.masters = masters_for(masters, N, N, np, kind, False, self.fused)
            self.masters.write(slice(0, N), init, self.param)
        self.stored = [state_for(state_dtype, N, N, np, kind, i, False, SEGMENTS, self.fused)
                       for i in range(len(rule.state_names))]  # fmt: skip

    def step(self, grad, s, step: int) -> None:
        for a, b, _ in SEGMENTS:
            st = slice(a, b)
            param = self.param[st] if self.mixed else None
            if self.fused:
                master = self.masters.form(st) if self.mixed else master_form(self.param[st])
                forms = tuple(kept.form(st, a, step) for kept in self.stored)
                ties = self.kernel.fused(grad[st], master, forms, param, s)
                if self.mixed:
                    self.masters.record_ties(st, ties)
                continue
            master = self.masters.load(st, 0, param) if self.mixed else self.param[st]
            states = [kept.load(st, 0) for kept in self.stored]
            self.kernel(grad[st], master, *states, param, s)
            if self.mixed:
                self.masters.store(st, master, param)
            for kept, values in zip(self.stored, states):
                kept.store(st, values, a, step)

    def arrays(self) -> dict:
        found = {"param": self.param}
        if self.masters is not None:
            found["masters"] = self.masters.held
            found["ties"] = getattr(self.masters, "ties", np.zeros(0, np.int64))
        for i, kept in enumerate(self.stored):
            found[f"state{i}"] = kept.held
            for extra in ("scales", "side"):
                if hasattr(kept, extra):
                    found[f"state{i} {extra}"] = getattr(kept, extra)
        return found


@pytest.mark.parametrize("param_dtype, masters, state_dtype", COMBINATIONS)
def test_the_generated_cuda_pass_is_the_numpy_twin_bit_for_bit(
    cuda_on_the_cpu, param_dtype, masters, state_dtype
):
    init = kit.with_ties({"x": np.random.default_rng(3).standard_normal(N)})["x"]
    init = init.astype(np.float32)
    cases, new_ties = 0, 0
    for entry in kit.registry().values():
        for variant, options in kit.variant_cases(entry):
            if variant.tensor_sums:
                continue  # (a two-phase rule keeps its own kernels)
            checked = variant.check_options(**{**entry.defaults, **options})
            twins = [Twin(kind, variant, param_dtype, masters, state_dtype, init, fused)
                     for kind, fused in (("numpy", False), ("cupy", True), ("cupy", False))]
            grad_dtype = np.float32 if param_dtype == "float32" else backend.resolve_dtype(
                param_dtype)
            for step in range(1, 5):
                rng = np.random.default_rng(step)
                grad = (rng.standard_normal(N) * 2.0**-step).astype(np.float32)
                grad[1::97] = 0.0
                s = variant.scalars(step, checked, 0.5)
                before = twins[0].arrays().get("ties", np.zeros(0)).size
                for twin in twins:
                    twin.step(grad.astype(grad_dtype), s, step)
                want = twins[0].arrays()
                new_ties += want.get("ties", np.zeros(0)).size != before
                for twin in twins[1:]:
                    got = twin.arrays()
                    where = f"{entry.name} {variant.settings()} step {step} fused={twin.fused}"
                    assert want.keys() == got.keys(), where
                    for name in want:
                        assert kit.same_bits(want[name], got[name]), f"{where}: {name}"
            cases += 1
    assert cases >= 5
    if masters == "remainder":  # the ties moved: decoded and encoded, old and new
        assert new_ties > 0


def test_a_gpu_twin_holds_no_decoding_scratch(cuda_on_the_cpu):
    """Fused, the CuPy twin's rows keep no fp32 copy of the masters or the state: the tie
    mask (a bit per element) is all the scratch."""
    from zero1_mpi.rules.adam import Adam

    rule = Adam(True)
    fused = Twin("cupy", rule, "bfloat16", "remainder", "int8", np.zeros(N, np.float32), True)
    plain = Twin("numpy", rule, "bfloat16", "remainder", "int8", np.zeros(N, np.float32))
    assert fused.masters.scratch_bytes == (N + 31) // 32 * 4 + 4
    assert all(kept.scratch_bytes == 0 for kept in fused.stored)
    assert plain.masters.scratch_bytes >= 4 * N and plain.stored[0].scratch_bytes >= 4 * N
