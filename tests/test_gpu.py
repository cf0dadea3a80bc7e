"""GPU checks: each rule's CuPy kernel against its NumPy twin, CuPy buffers through the
communicator, the multi-rank parity case (every rule of the registry) on CuPy arrays, state
offload on CuPy arrays (parity and the device/host split of the memory), the torch binding on
CUDA (DLPack views of the CuPy buffers), gradient sharding on CuPy buffers, and NCCL refusing
two ranks on one GPU with a clear error.

Skipped where CuPy or a GPU is missing, unless ZERO1_REQUIRE_GPU=1 (``tools/gpu_check.sh``
sets it), which turns a skip into a failure.
"""

import os
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from casekit import host_kernel_scratch, shard_arrays
from mpirun import run_mpi
from reference import max_rel_err, max_ulp_diff
from zero1_mpi import Communicator, ZeroAdamW
from zero1_mpi.kernels.backend import PARAM_DTYPES
from zero1_mpi.rules.adam import AdamScalars, CupyAdam, NumpyAdam


def _cupy_or_reason():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device"
        return cupy, None
    except Exception as exc:  # ImportError, or CUDA driver errors on GPU-less machines
        return None, f"CuPy unusable: {type(exc).__name__}: {exc}"


cupy, REASON = _cupy_or_reason()
if cupy is None:
    if os.environ.get("ZERO1_REQUIRE_GPU") == "1":
        raise RuntimeError(f"ZERO1_REQUIRE_GPU=1 but {REASON}")
    pytestmark = pytest.mark.skip(reason=REASON)


@pytest.mark.parametrize("dtype_name", list(PARAM_DTYPES))
@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_cupy_kernel_matches_numpy_twin(dtype_name, decoupled, weight_decay):
    dtype = PARAM_DTYPES[dtype_name]
    n = 100_003
    rng = np.random.default_rng(1)
    host = {"master": rng.standard_normal(n).astype(np.float32),
            "m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32)}
    host["param"] = host["master"].astype(dtype) if dtype != np.float32 else None
    dev = {k: None if a is None else cupy.asarray(a) for k, a in host.items()}
    for step in range(1, 11):
        grad = rng.standard_normal(n).astype(dtype)
        s = AdamScalars.for_step(step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=weight_decay, decoupled=decoupled,
                                 grad_scale=0.5)
        NumpyAdam()(grad, host["master"], host["m"], host["v"], host["param"], s)
        CupyAdam()(cupy.asarray(grad), dev["master"], dev["m"], dev["v"], dev["param"], s)
    assert max_rel_err(dev["master"].get(), host["master"]) <= 1e-6
    assert max_rel_err(dev["v"].get(), host["v"]) <= 1e-5
    if dtype != np.float32:
        assert max_ulp_diff(dev["param"].get(), host["param"]) <= 1


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_cupy_buffers_through_the_communicator(cuda_aware):
    if cuda_aware and not Communicator(MPI.COMM_SELF).cuda_aware:
        pytest.skip("this MPI is not CUDA-aware (set ZERO1_MPI_CUDA_AWARE=1 if it is)")
    comm = Communicator(MPI.COMM_SELF, cuda_aware=cuda_aware)
    for dtype in PARAM_DTYPES.values():
        buf = cupy.arange(1, 13, dtype=np.float32).astype(dtype)
        recv = cupy.zeros_like(buf)
        comm.alltoall(buf, recv)  # staged: recv only changes if the copy back works
        assert bool((recv == buf).all())
        comm.allgather_inplace(buf)
        comm.bcast(buf)
        assert bool((buf == cupy.arange(1, 13, dtype=np.float32).astype(dtype)).all())
    assert (comm.routes.staging_bytes > 0) is (not cuda_aware)


def test_optimizer_on_cupy_arrays_keeps_views_on_the_gpu():
    params = {"w": cupy.ones((3, 5), np.float32), "b": cupy.zeros(5, np.float32)}
    opt = ZeroAdamW(params, MPI.COMM_SELF, lr=0.1, param_dtype="bfloat16")
    assert opt.backend == "cupy" and isinstance(opt.params["w"], cupy.ndarray)
    opt.grads["w"][...] = 1
    opt.step()
    assert cupy.shares_memory(opt.params["w"], shard_arrays(opt)["params"])
    assert abs(float(opt.params["w"][0, 0]) - (1 - 0.1 * 0.01 - 0.1)) < 1e-2


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("via", ["mpi", "nccl"])
def test_parity_on_cupy_arrays(n, via):
    if via == "nccl" and cupy.cuda.runtime.getDeviceCount() < n:
        pytest.skip(f"NCCL needs a GPU per rank: {n} ranks, fewer GPUs")
    """Every rule of the registry, the layouts and the training features (tests/cases/
    parity.py) with the parameters on the GPU, through MPI or NCCL."""
    out = run_mpi(n, "parity.py", "--backend", "cupy", *(["--nccl"] if via == "nccl" else []),
                  timeout=600).stdout
    assert f"on {n} ranks (cupy{' via NCCL' if via == 'nccl' else ''}, kernel cupy)" in out


@pytest.mark.parametrize("masters, per_param", [("fp32", 16), ("remainder", 14)])
def test_device_memory_is_measured_and_follows_the_formula(masters, per_param):
    """What the optimizer takes from CuPy's memory pool equals memory_report().device_bytes
    (all but the page-locked staging buffers of an MPI that is not CUDA-aware), and grows
    with Ψ as the formula does (N = 1: 2Ψ + 2Ψ + 12Ψ, 16 bytes per bf16 parameter with fp32
    masters; 14 with the 2-byte remainders) plus the scratch the report lists (the one pass
    reads the remainders as they are: only their new ties' mask, a bit per element)."""
    pool = cupy.get_default_memory_pool()
    measured = []
    for psi in (1_000_000, 3_000_000):
        params = {"w": cupy.ones(psi, np.float32)}
        cupy.cuda.Device().synchronize()
        before = pool.used_bytes()
        opt = ZeroAdamW(params, MPI.COMM_SELF, param_dtype="bfloat16", masters=masters)
        opt.grads["w"][...] = 1e-3
        opt.step()
        cupy.cuda.Device().synchronize()
        measured.append((pool.used_bytes() - before, opt.memory_report()))
        del opt, params
    slack = 64 * 1024  # the pool rounds each allocation up to 512 bytes; a few small arrays
    for held, report in measured:
        assert abs(held - report.device_bytes) <= slack, (held, report.device_bytes)
    (held0, report0), (held1, report1) = measured
    assert report1.formula_bytes - report0.formula_bytes == per_param * 2_000_000
    scratch = report1.comm_scratch - report0.comm_scratch
    assert abs(held1 - held0 - per_param * 2_000_000 - scratch) <= slack, (held1 - held0, scratch)


@pytest.mark.parametrize("masters", ["fp32", "remainder"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_the_one_pass_on_the_gpu_is_the_numpy_twin_within_contraction(masters, state_dtype):
    """Each stored form's generated kernel (kernels/cuda_generated.py), through the engine on
    CuPy arrays, against the NumPy twin on the host: the same bits but where NVRTC contracts
    a * b + c (each bf16 parameter within 2 steps after 4 updates)."""
    from zero1_mpi import ZeroAdamW as Opt

    rng = np.random.default_rng(4)
    init = {"w": rng.standard_normal((64, 300)).astype(np.float32), "b": np.zeros(300, np.float32)}
    grads = [{k: (rng.standard_normal(v.shape) * 1e-2).astype(np.float32) for k, v in init.items()}
             for _ in range(4)]
    seen = []
    for xp in (np, cupy):
        opt = Opt({k: xp.asarray(v) for k, v in init.items()}, MPI.COMM_SELF, lr=1e-2,
                  param_dtype="bfloat16", masters=masters, state_dtype=state_dtype)
        assert xp is np or opt.kernel == "cupy"
        for g in grads:
            for k, v in g.items():
                opt.grads[k][...] = xp.asarray(v).astype(opt.grads[k].dtype)
            opt.step()
        seen.append({k: np.asarray(v.get() if xp is cupy else v).astype(np.float32)
                     for k, v in opt.params.items()})
        opt.close()
    for k in init:
        assert max_ulp_diff(seen[1][k].astype(PARAM_DTYPES["bfloat16"]),
                            seen[0][k].astype(PARAM_DTYPES["bfloat16"])) <= 2, k


@pytest.mark.parametrize("dtype_name", list(PARAM_DTYPES))
@pytest.mark.parametrize("options", [
    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True},
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.01, "nesterov": False}])
def test_cupy_sgd_kernel_matches_numpy_twin(dtype_name, options):
    from zero1_mpi.rules.sgd import SGD, CupySGD, NumpySGD
    dtype = PARAM_DTYPES[dtype_name]
    n, has_buffer = 100_003, options["momentum"] != 0
    rng = np.random.default_rng(2)
    host = {"master": rng.standard_normal(n).astype(np.float32), "buf": np.zeros(n, np.float32)}
    host["param"] = host["master"].astype(dtype) if dtype != np.float32 else None
    dev = {k: None if a is None else cupy.asarray(a) for k, a in host.items()}
    for step in range(1, 11):
        grad = rng.standard_normal(n).astype(dtype)
        s = SGD.scalars(step, {"lr": 1e-2, **options}, 0.5)
        for kernel, arrays, g in ((NumpySGD(has_buffer), host, grad),
                                  (CupySGD(has_buffer), dev, cupy.asarray(grad))):
            states = (arrays["buf"],) if has_buffer else ()
            kernel(g, arrays["master"], *states, arrays["param"], s)
    assert max_rel_err(dev["master"].get(), host["master"]) <= 1e-6
    if dtype != np.float32:
        assert max_ulp_diff(dev["param"].get(), host["param"]) <= 1


@pytest.mark.parametrize("dtype_name", list(PARAM_DTYPES))
def test_cupy_lion_kernel_matches_numpy_twin(dtype_name):
    from zero1_mpi.rules.lion import CupyLion, Lion, NumpyLion
    dtype = PARAM_DTYPES[dtype_name]
    n = 100_003
    rng = np.random.default_rng(3)
    host = {"master": rng.standard_normal(n).astype(np.float32), "m": np.zeros(n, np.float32)}
    host["param"] = host["master"].astype(dtype) if dtype != np.float32 else None
    dev = {k: None if a is None else cupy.asarray(a) for k, a in host.items()}
    options = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    for step in range(1, 11):
        grad = rng.standard_normal(n).astype(dtype)
        s = Lion.scalars(step, options, 0.5)
        NumpyLion()(grad, host["master"], host["m"], host["param"], s)
        CupyLion()(cupy.asarray(grad), dev["master"], dev["m"], dev["param"], s)
    assert max_rel_err(dev["master"].get(), host["master"]) <= 1e-6
    assert max_rel_err(dev["m"].get(), host["m"]) <= 1e-6
    if dtype != np.float32:
        assert max_ulp_diff(dev["param"].get(), host["param"]) <= 1


@pytest.mark.parametrize("dtype_name", list(PARAM_DTYPES))
def test_cupy_lamb_kernel_matches_numpy_twin(dtype_name):
    """Both phases: the per-piece sums (u^2 by the reduction that recomputes u) and the
    update, on two pieces of different sizes, against the NumPy twin."""
    from zero1_mpi.rules.lamb import CupyLamb, Lamb, NumpyLamb
    dtype = PARAM_DTYPES[dtype_name]
    rng = np.random.default_rng(4)
    sizes = (100_003, 77)
    host = [{"master": rng.standard_normal(n).astype(np.float32),
             "m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32)} for n in sizes]
    for piece in host:
        piece["param"] = piece["master"].astype(dtype) if dtype != np.float32 else None
    dev = [{k: None if a is None else cupy.asarray(a) for k, a in piece.items()}
           for piece in host]
    options = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
    for step in range(1, 11):
        s = Lamb.scalars(step, options, 0.5)
        for h, d, n in zip(host, dev, sizes):
            grad = rng.standard_normal(n).astype(dtype)
            want = NumpyLamb().tensor_sums(grad, h["master"], h["m"], h["v"], s)
            got = CupyLamb().tensor_sums(cupy.asarray(grad), d["master"], d["m"], d["v"], s)
            np.testing.assert_allclose(got.get(), want, rtol=1e-5)
            NumpyLamb().apply(h["master"], h["m"], h["v"], h["param"],
                              Lamb.tensor_scalars(s, want))
            CupyLamb().apply(d["master"], d["m"], d["v"], d["param"],
                             Lamb.tensor_scalars(s, want))
    for h, d in zip(host, dev):
        assert max_rel_err(d["master"].get(), h["master"]) <= 1e-6
        assert max_rel_err(d["v"].get(), h["v"]) <= 1e-6
        if dtype != np.float32:
            assert max_ulp_diff(d["param"].get(), h["param"]) <= 1


@pytest.mark.parametrize("n", [1, 2])
def test_offload_parity_on_cupy_arrays(tmp_path, n):
    """offload='cpu' against the optimizer without it on CuPy parameters: every rule and
    dtype, checkpoints and exports across the two (2 ranks share the devices)."""
    out = run_mpi(n, "offload.py", str(tmp_path), "--backend", "cupy", timeout=300,
                  env={"ZERO1_MPI_KERNEL": "auto"}).stdout
    assert f"OK offload: 18 cases x 5 steps on {n} ranks" in out and "(cupy," in out


def test_offloaded_memory_is_split_between_device_and_host():
    """CuPy's pool sees the report's device bytes (2 + 2 bytes per bf16 parameter, and the
    scratch); tracemalloc sees its host bytes (12 per parameter for Adam, and the slots)."""
    psi = 4_000_000
    warm = ZeroAdamW({"w": cupy.ones(10, np.float32)}, MPI.COMM_SELF, param_dtype="bfloat16",
                     offload="cpu")  # imports and compiles the host kernel outside the count
    warm.step()
    params = {"w": cupy.ones(psi, np.float32)}
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    tracemalloc.start()
    try:
        host_before = tracemalloc.get_traced_memory()[0]
        opt = ZeroAdamW(params, MPI.COMM_SELF, param_dtype="bfloat16", offload="cpu")
        opt.grads["w"][...] = 1e-3
        opt.step()
        cupy.cuda.Device().synchronize()
        host = tracemalloc.get_traced_memory()[0] - host_before
    finally:
        tracemalloc.stop()
    device = pool.used_bytes() - before
    report = opt.memory_report()
    assert report.device_formula_bytes == 4 * psi and report.host_formula_bytes == 12 * psi
    assert abs(device - report.device_bytes) <= 64 * 1024, (device, report.device_bytes)
    # Page-locked buffers (the copies' and MPI's staging) come from CuPy's pinned pool, which
    # tracemalloc does not see: all the host scratch but the host kernel's.
    pinned = report.host_scratch - host_kernel_scratch(opt)
    assert abs(host + pinned - report.host_bytes) <= 256 * 1024, (host, pinned, report)


def test_nccl_refuses_two_ranks_on_one_gpu_on_every_rank():
    pytest.importorskip("cupy.cuda.nccl")
    out = run_mpi(2, "nccl_shared_gpu.py", timeout=120).stdout
    assert "OK nccl shared gpu: 2 ranks refused" in out


def test_torch_binding_on_cuda_views_cupy_buffers_and_steps_as_on_the_cpu():
    """zero1_mpi.torch on a CUDA model: parameters and .grad are DLPack views of the CuPy
    buffers, and a step on given gradients lands where the same step on the CPU does."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from zero1_mpi.torch import ZeroOptimizer

    def bound(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(device)
        return model, ZeroOptimizer(model, "adamw", MPI.COMM_SELF, lr=1e-2, max_grad_norm=1.0)

    (gpu, gpu_opt), (cpu, cpu_opt) = bound("cuda"), bound("cpu")
    for name, p in gpu.named_parameters():
        assert p.data_ptr() == gpu_opt.sharded.params[name].data.ptr
        assert p.grad.data_ptr() == gpu_opt.sharded.grads[name].data.ptr
    for step in range(3):
        for p, q in zip(gpu.parameters(), cpu.parameters()):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad.copy_(g.cuda())
            q.grad.copy_(g)
        gpu_opt.step()
        cpu_opt.step()
    for p, q in zip(gpu.parameters(), cpu.parameters()):
        assert max_rel_err(p.detach().cpu().numpy(), q.detach().numpy()) <= 1e-6


@pytest.mark.parametrize("n", [1, 2])
def test_gradient_sharding_on_cupy_arrays(tmp_path, n):
    """shard_gradients=True with CuPy buffers: the stage-2 case (every rule and dtype against
    stage 1 and the float64 reference, checkpoints across the stages) on the GPU."""
    out = run_mpi(n, "stage2.py", str(tmp_path), "--backend", "cupy", timeout=600).stdout
    assert f"OK stage 2 on {n} ranks (cupy): 72 rule/dtype cases" in out, out


@pytest.mark.parametrize("codec", ["remainder", "bfloat16", "int8"])
def test_cupy_state_codecs_equal_their_numpy_twins(codec):
    """The remainder masters, the bf16 state's stochastic rounding and the 8-bit state on the
    GPU: the same bits as the NumPy twins (integer operations, and fp32 ones rounded once)."""
    from zero1_mpi.kernels.backend import BFLOAT16
    from zero1_mpi.state.masters import RemainderMasters
    from zero1_mpi.state.encodings import Bf16State
    from zero1_mpi.state.int8_blocks import Int8State
    n = 300_000
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 1e3], n)).astype(np.float32)
    x[5:300:7] = (x[5:300:7].view(np.uint32) & 0xFFFE0000 | 0x8000).view(np.float32)  # ties
    got = {}
    for xp, kind in ((np, "numpy"), (cupy, "cupy")):
        values = xp.asarray(x)
        if codec == "remainder":
            kept, param = RemainderMasters(n, n, xp, kind), xp.zeros(n, BFLOAT16)
            kept.write(slice(0, n), values, param)
            got[kind] = (kept.held, kept.ties, kept.read(slice(0, n), param))
        elif codec == "bfloat16":
            kept = Bf16State(n, n, xp, kind, 1)
            kept.store(slice(0, n), values, 12_345, 7)
            got[kind] = (kept.held, kept.read(slice(0, n)))
        else:
            kept = Int8State(n, [(0, 1000, True), (1000, n, True)], n, xp, kind)
            kept.store(slice(0, 1000), values[:1000], 0, 1)
            kept.store(slice(1000, n), values[1000:], 1000, 1)
            got[kind] = (kept.held, kept.scales, kept.read(slice(0, n)))
    for a, b in zip(got["numpy"], got["cupy"]):
        assert np.array_equal(np.asarray(a), cupy.asnumpy(b) if hasattr(b, "get") else b,
                              equal_nan=True), codec


@pytest.mark.parametrize("options", [{"masters": "remainder"}, {"state_dtype": "bfloat16"},
                                     {"state_dtype": "int8"}])
def test_state_modes_on_cupy_arrays_follow_the_host(options):
    """An optimizer in each mode on CuPy parameters against the same on NumPy ones: remainder
    masters give fp32 masters' bits on the GPU; the others stay close to the host run (the
    kernels may contract differently)."""
    rng = np.random.default_rng(1)
    init = {"w": rng.standard_normal((70, 100)).astype(np.float32), "b": np.zeros(100, np.float32)}
    runs = {}
    for name, xp, engine in (("host", np, options), ("gpu", cupy, options),
                             ("gpu fp32", cupy, {"masters": "fp32"})):
        opt = ZeroAdamW({k: xp.asarray(v) for k, v in init.items()}, MPI.COMM_SELF, lr=1e-2,
                        param_dtype="bfloat16", **engine)
        for step in range(5):
            g = np.random.default_rng(step)
            for k, v in init.items():
                opt.grads[k][...] = xp.asarray(g.standard_normal(v.shape).astype(np.float32))
            opt.step()
        runs[name] = {k: np.asarray(cupy.asnumpy(p) if xp is cupy else p, np.float32)
                      for k, p in opt.params.items()}
    for k in init:
        if options.get("masters") == "remainder":
            assert np.array_equal(runs["gpu"][k], runs["gpu fp32"][k]), k
        assert np.allclose(runs["gpu"][k], runs["host"][k], rtol=2**-6, atol=1e-3), k



def wire_codec_results(xp, kind: str, dtype, feedback: bool) -> list:
    """The 8-bit wire codec of ``kind`` on arrays of ``xp``: three rows packed (with residuals
    where ``feedback``), their sum decoded, the last decoded onto the first; a row that ends
    inside a block, a block of zeros (scale 0)."""
    from zero1_mpi.wire import codec as wire
    n = 3 * 100_000 + 77
    rows = [(np.random.default_rng(i).standard_normal(n) * scale).astype(dtype)
            for i, scale in enumerate((1e-3, 1.0, 30.0))]
    rows[1][wire.BLOCK : 2 * wire.BLOCK] = 0
    residuals = [xp.asarray((np.random.default_rng(10 + i).standard_normal(n) * 1e-3)
                            .astype(dtype)) for i in range(3)] if feedback else [None] * 3
    codec = wire.codec_for(kind, n)
    packed = xp.zeros((3, wire.packed_bytes(n)), np.uint8)
    for row, out, residual in zip(rows, packed, residuals):
        codec.encode(xp.asarray(row), out, residual)
    total = xp.zeros(n, np.float32)
    codec.decode_sum(packed, n, total)
    target = xp.asarray(rows[0])
    codec.decode_add(packed[2], target)
    return [packed, total, target] + (residuals if feedback else [])


@pytest.mark.parametrize("dtype_name", list(PARAM_DTYPES))
@pytest.mark.parametrize("feedback", [False, True])
def test_cupy_wire_codec_equals_its_numpy_twin(dtype_name, feedback):
    """The 8-bit wire's CuPy codec (tools/mutate.py found no test of it on a GPU): its packed
    rows, residuals and decoded sums are the NumPy twin's bits."""
    dtype = PARAM_DTYPES[dtype_name]
    host = wire_codec_results(np, "numpy", dtype, feedback)
    device = wire_codec_results(cupy, "cupy", dtype, feedback)
    for a, b in zip(host, device):
        assert np.array_equal(a.view(np.uint8), cupy.asnumpy(b).view(np.uint8)), dtype_name
