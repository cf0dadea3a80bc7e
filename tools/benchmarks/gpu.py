"""One GPU: the fused CuPy kernels' bandwidth against in-place passes and torch; transfers.

On the GPU, in one run: the effective bandwidth of zero1_mpi's fused CuPy Adam kernel (fp32
parameters; bf16 parameters with fp32 masters, bf16 and fp32 gradients) against the device's
measured in-place read-write bandwidth (the best ``x *= c`` pass over fp32, every byte read
and written once; target >= 90 percent), beside ``torch.optim.AdamW(fused=True)`` on the same
fp32 problem when torch has CUDA (target: zero1's time <= torch's); the other rules' CuPy
kernels on fp32 (SGD with momentum beside ``torch.optim.SGD(foreach=True)``, Lion, and LAMB's
two phases on one tensor, bytes counted as they move them); and the time of moving one
4M-element bucket through the communicator: staged through pinned host memory, directly (only
if MPI is CUDA-aware) and through NCCL. --params is the elements of each array (the parameters
one kernel call updates). Prints markdown tables (--markdown writes them to a file too).
Needs CuPy and a GPU. Example: python tools/bench.py gpu --params 256M --json gpu.json
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from . import common

RANKS, TIMEOUT = False, None
cupy = None  # imported by worker(): the module loads without CuPy (for --help)


def options(parser) -> None:
    common.params(parser, "256M", "elements per array")
    parser.add_argument("--markdown", help="also write the tables to this file")


def worker(args) -> dict:
    """The tables' rows, measured; SystemExit with what is missing without CuPy or a GPU."""
    global cupy
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - ImportError, CUDARuntimeError: both say why
        raise SystemExit(f"tools/bench.py gpu needs CuPy and a GPU: {type(exc).__name__}: "
                         f"{exc} (pip install 'zero1-mpi[cuda12]' on a machine with an NVIDIA "
                         "GPU)") from None
    n = args.params
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    rows = ceiling_rows(n)
    ceiling = max(moved / t for what, moved, t in rows if what.startswith("in-place"))
    rows += kernel_rows(n) + rule_rows(n)
    return {"device": device, "elements": n, "ceiling": ceiling, "rows": rows,
            "comm": comm_rows()}


def seconds(fn, repeat=20):
    """Median device time of ``fn`` (CUDA events on the current stream), after a warm-up."""
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def warm_up(fn, seconds_=1.0):
    """Run ``fn`` for about a second first: an idle GPU's clocks take a while to rise."""
    clock = time.perf_counter
    start = clock()
    while clock() - start < seconds_:
        fn()
        cupy.cuda.get_current_stream().synchronize()


def ceiling_rows(n):
    """(what, bytes moved, seconds) of plain in-place read-write passes over ``n`` fp32: the
    best of them is the ceiling a fused update, which reads and writes its arrays in place,
    is measured against. CuPy's generic ``x *= c`` keeps one load in flight per thread;
    torch's ``mul_`` is vectorised, and a device-to-device copy is the driver's."""
    x = cupy.ones(n, np.float32)
    scale = cupy.ElementwiseKernel("float32 c", "float32 x", "x = x * c", "zero1_bench_scale")
    in_place = lambda: scale(np.float32(1), x)  # noqa: E731
    warm_up(in_place)
    rows = [("in-place x *= c, CuPy ElementwiseKernel", 8 * n, seconds(in_place))]
    y = cupy.empty_like(x)
    rows.append(("device-to-device copy (cudaMemcpy)", 8 * n,
                 seconds(lambda: y.data.copy_from_device(x.data, x.nbytes))))
    del y
    torch = _torch_cuda()
    if torch is not None:
        t = torch.from_dlpack(x)
        rows.append(("in-place x *= c, torch mul_", 8 * n, seconds(lambda: t.mul_(1.0))))
        del t
    return rows


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    # Timed with CuPy's events on CuPy's current stream: torch's must be that one.
    assert torch.cuda.current_stream().cuda_stream == cupy.cuda.get_current_stream().ptr
    return torch


def kernel_rows(n):
    """(what, bytes moved, seconds) for zero1's kernels and torch's fused AdamW."""
    from zero1_mpi.kernels.backend import BFLOAT16
    from zero1_mpi.rules.adam import AdamScalars, CupyAdam

    rows = []
    s = AdamScalars.for_step(1, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                             decoupled=True)
    kernel = CupyAdam()
    m, v = cupy.zeros(n, np.float32), cupy.zeros(n, np.float32)
    master = cupy.ones(n, np.float32)
    for what, grad_dtype, param in (("fp32 params, fp32 grads", np.float32, None),
                                    ("bf16 params + fp32 master, bf16 grads", BFLOAT16,
                                     cupy.ones(n, BFLOAT16)),
                                    ("bf16 params + fp32 master, fp32 grads", np.float32,
                                     cupy.ones(n, BFLOAT16))):
        grad = cupy.full(n, 1e-3, np.float32).astype(grad_dtype)
        # reads grad, master/param, m, v; writes master/param, m, v (and the 16-bit param)
        moved = n * (grad.itemsize + 12 + 12 + (0 if param is None else param.itemsize))
        rows.append((f"zero1 CuPy Adam, {what}", moved,
                     seconds(lambda: kernel(grad, master, m, v, param, s))))
        del grad, param
    del m, v, master
    return rows + torch_rows(n, "torch AdamW(fused=True), fp32 params, fp32 grads", 28, "AdamW",
                             fused=True)


def rule_rows(n):
    """(what, bytes moved, seconds) for the other rules' CuPy kernels on fp32, beside
    ``torch.optim.SGD(momentum=0.9, foreach=True)``."""
    from zero1_mpi.rules.lamb import CupyLamb, Lamb
    from zero1_mpi.rules.lion import CupyLion, Lion
    from zero1_mpi.rules.sgd import SGD, CupySGD

    grad, master = cupy.full(n, 1e-3, np.float32), cupy.ones(n, np.float32)
    m, v = cupy.zeros(n, np.float32), cupy.zeros(n, np.float32)
    sgd = SGD.scalars(2, {"lr": 1e-4, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                          "nesterov": False}, 1.0)
    lion = Lion.scalars(2, {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 1e-2}, 1.0)
    lamb = Lamb.scalars(2, {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-6,
                            "weight_decay": 1e-2}, 1.0)
    lamb_kernel = CupyLamb()

    def lamb_step():  # both phases, with the sums brought to the host as the engine does
        sums = lamb_kernel.tensor_sums(grad, master, m, v, lamb).get()
        lamb_kernel.apply(master, m, v, None, Lamb.tensor_scalars(lamb, sums))

    # SGD, Lion: grad in, param and one state read and written (20 bytes); LAMB: moments (20),
    # the u^2 and p^2 reductions (12 + 4), the update (8 + 8): 52 bytes.
    rows = [("zero1 CuPy SGD (momentum), fp32", 20 * n,
             seconds(lambda: CupySGD(True)(grad, master, m, None, sgd))),
            ("zero1 CuPy Lion, fp32", 20 * n,
             seconds(lambda: CupyLion()(grad, master, m, None, lion))),
            ("zero1 CuPy LAMB, both phases, fp32", 52 * n, seconds(lamb_step))]
    del grad, master, m, v
    return rows + torch_rows(n, "torch SGD(momentum, foreach=True), fp32", 20, "SGD",
                             momentum=0.9, foreach=True)


def torch_rows(n, what: str, bytes_per_element: int, optimizer: str, **options) -> list:
    """[(what, bytes moved, seconds)] of ``torch.optim.<optimizer>(lr=1e-4, **options)`` over
    ``n`` fp32 on the GPU, or [] where torch has no CUDA."""
    torch = _torch_cuda()
    if torch is None:
        return []
    p = torch.nn.Parameter(torch.ones(n, device="cuda"))
    p.grad = torch.full((n,), 1e-3, device="cuda")
    opt = getattr(torch.optim, optimizer)([p], lr=1e-4, **options)
    opt.step()  # its state exists from here on: allocated before timing
    row = (what, bytes_per_element * n, seconds(opt.step))
    del p, opt
    torch.cuda.empty_cache()
    return [row]


def comm_rows():
    """(how, alltoall seconds, allgather seconds) for one 4M-element fp32 bucket on 1 rank."""
    from mpi4py import MPI

    from zero1_mpi import Communicator

    bucket = cupy.ones(1 << 22, np.float32)
    recv = cupy.empty_like(bucket)
    comms = [("staged through pinned host memory", Communicator(MPI.COMM_SELF,
                                                                cuda_aware=False))]
    if Communicator(MPI.COMM_SELF).cuda_aware:
        comms.append(("direct (CUDA-aware MPI)", Communicator(MPI.COMM_SELF, cuda_aware=True)))
    try:
        from zero1_mpi.comm.nccl import NcclCommunicator
        comms.append(("NCCL", NcclCommunicator(MPI.COMM_SELF)))
    except Exception as exc:  # noqa: BLE001 - a missing or broken NCCL is reported, not fatal
        print(f"(NCCL not measured: {type(exc).__name__}: {exc})")
    return [(how, seconds(lambda: comm.alltoall(bucket, recv)),
             seconds(lambda: comm.allgather_inplace(bucket))) for how, comm in comms]


def report(args, results: list[dict]) -> dict:
    found = results[0]
    n, ceiling, rows, comm = (found[k] for k in ("elements", "ceiling", "rows", "comm"))
    torch_rows = {key: next((r for r in rows if r[0].startswith(f"torch {name}")), None)
                  for key, name in (("Adam", "AdamW"), ("SGD", "SGD"))}
    lines = [f"{found['device']}, {n:,} elements per array; 'of in-place': of the best "
             f"in-place read-write pass ({ceiling / 1e9:.0f} GB/s)", "",
             common.row("what", "ms", "GB/s", "of in-place",
                        "time vs torch's (fused AdamW, SGD foreach)"), common.rule("lrrrr")]
    for what, moved, t in rows:
        ref = next((r for key, r in torch_rows.items() if r and key in what), None)
        lines.append(common.row(what, f"{t * 1e3:.3f}", f"{moved / t / 1e9:.0f}",
                                f"{moved / t / ceiling:.0%}", f"{t / ref[2]:.2f}x" if ref else ""))
    lines += ["", common.row("one 4M-element fp32 bucket, 1 rank", "alltoall ms",
                             "allgather ms"), common.rule("lrr")]
    lines += [common.row(how, f"{a2a * 1e3:.3f}", f"{gather * 1e3:.3f}") for how, a2a, gather
              in comm]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return {"device": found["device"], "elements": n,
            "kernels": [{"what": w, "bytes": b, "seconds": t, "gb_per_s": b / t / 1e9,
                         "of_in_place": b / t / ceiling} for w, b, t in rows],
            "bucket_4M_fp32": [{"how": h, "alltoall_s": a, "allgather_s": g}
                               for h, a, g in comm]}
