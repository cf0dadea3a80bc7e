"""python tools/bench.py --ranks 1,2,4 [--optimizer adam] [--model mlp] [--dtype float32]
[--json F] [--plot F]

Measures, side by side in one run on the same parameters and gradients, one optimizer step of
(a) plain data parallelism: an ``Allreduce`` of the gradients, then the full update on every
    rank (the seed's baseline), with the same fused kernel as (b);
(b) zero1_mpi: ``Reduce_scatter`` (or ``Alltoall`` + fp32 sum), the update on the owned shard,
    ``Allgather``;
(c) ``torch.distributed.optim.ZeroRedundancyOptimizer`` over gloo wrapping the torch reference
    optimizer, after an all-reduce of the gradients (what DDP does), when torch is installed and
    has the optimizer (fp32 only).
For each: the step split into gradient reduction, optimizer math and parameter gathering (median
over ``--steps`` after ``--warmup``, the slowest rank each time), bytes per rank, and ratios; and
the throughput of the kernels alone (ours, NumPy and Numba, and the reference; for 16-bit, torch
doing the same job: grads to fp32, its update, fp32 to 16-bit params) against the in-place
read-write stream bandwidth measured in the same run (``a += b`` over fp32 arrays as large as
the kernel's, bytes counted as for the kernel: the gradient read, the master weights and each
state array read and written; LAMB's two passes move more than that). Each rank uses one thread.

``--optimizer`` picks the update rule (``optimizer_choice``): ``adam`` (the default) is
``ZeroAdamW`` against ``torch.optim.AdamW(fused=True)``; ``sgd`` is ``ZeroSGD`` with momentum
0.9 against ``torch.optim.SGD(momentum=0.9, foreach=True)``; ``lion`` (``ZeroLion``) and
``lamb`` (``ZeroLAMB``) have no torch optimizer: their reference is the rule's NumPy float32
twin at the same thread count, and (c) is skipped.

With ``--ranks`` it launches ``mpiexec -n N`` for each N and prints one markdown table for all;
under ``mpiexec`` without ``--ranks`` it measures that world size. ``--json`` writes all
numbers; ``--plot`` writes a PNG (time split and bytes per rank against N; needs matplotlib).
``--model mlp`` is the 25M-parameter MLP 1024->4096->4096->1024; ``--model flat:16M`` one
flat tensor of that many elements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread per rank, for every library

ROOT = Path(__file__).resolve().parents[1]
try:
    import zero1_mpi  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import run_ranks  # noqa: E402

from zero1_mpi.memory import parse_param_count  # noqa: E402

PHASES = ("reduce", "optimizer", "gather")
LABELS = {"adam": "Adam", "sgd": "SGD", "lion": "Lion", "lamb": "LAMB"}  # --optimizer's choices
STEP = 2  # the step number of the kernels' scalars: past SGD's first step (a copy into the buffer)


def optimizer_choice(name: str) -> dict:
    """What ``--optimizer name`` measures: the zero1_mpi class (``cls``) and its options, which
    are also the rule's group options; the ``rule``; and the reference kernel, ``torch`` =
    (torch.optim class, its extra options, result key), or None: the rule's NumPy twin
    (result key ``zero1_numpy``), run at the same thread count."""
    from zero1_mpi import ZeroAdamW, ZeroLion, ZeroSGD
    from zero1_mpi.rules.adam import Adam
    from zero1_mpi.rules.lion import Lion
    from zero1_mpi.rules.sgd import SGD

    choices = {
        "adam": (ZeroAdamW, Adam(decoupled=True),
                 {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
                 ("AdamW", {"fused": True}, "torch_fused_adamw")),
        "sgd": (ZeroSGD, SGD(momentum_buffer=True),
                {"lr": 1e-4, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                 "nesterov": False}, ("SGD", {"foreach": True}, "torch_sgd_foreach")),
        "lion": (ZeroLion, Lion(),
                 {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 1e-2}, None),
    }
    if name == "lamb":
        try:
            from zero1_mpi import ZeroLAMB
            from zero1_mpi.rules.lamb import Lamb
        except ImportError:
            raise SystemExit("--optimizer lamb: this zero1_mpi has no LAMB "
                             "(zero1_mpi/rules/lamb.py); use adam, sgd or lion") from None
        choices["lamb"] = (ZeroLAMB, Lamb(), {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-6,
                                              "weight_decay": 1e-2}, None)
    cls, rule, options, torch_ref = choices[name]
    return {"cls": cls, "rule": rule, "options": options, "torch": torch_ref}


def rule_update(rule, kind: str, largest: int):
    """The rule's fused update over one range (of one tensor, for a two-phase rule), as
    ``update(grad, master, states, param, scalars)``: one kernel call, or for a rule with
    ``tensor_sums`` (LAMB) its partial sums, the tensor's scalars from them, then ``apply``."""
    kernel = rule.kernel(kind, largest)
    if not getattr(rule, "tensor_sums", 0):
        return lambda grad, master, states, param, s: kernel(grad, master, *states, param, s)

    def two_phase(grad, master, states, param, s):
        sums = kernel.tensor_sums(grad, master, *states, s)
        kernel.apply(master, *states, param, rule.tensor_scalars(s, sums))
    return two_phase


def model_shapes(model: str) -> dict:
    if model == "mlp":
        dims = (1024, 4096, 4096, 1024)
        shapes = {}
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            shapes[f"w{i}"], shapes[f"b{i}"] = (b, a), (b,)
        return shapes
    if model.startswith("flat:"):
        return {"flat": (parse_param_count(model[5:]),)}
    raise SystemExit(f"--model {model!r}: use mlp or flat:<elements>")


# -- the worker: runs on every rank ----------------------------------------------------------

def worker(args) -> dict:
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi.backend import resolve_dtype
    from zero1_mpi.reductions import resolve_cpu_kernel

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    shapes = model_shapes(args.model)
    psi = sum(int(np.prod(s)) for s in shapes.values())
    dtype = resolve_dtype(args.dtype)
    rng = np.random.default_rng(rank)
    grads = {k: (rng.standard_normal(s).astype(np.float32) * 1e-2).astype(dtype)
             for k, s in shapes.items()}
    init = {k: np.random.default_rng(7).standard_normal(s).astype(np.float32) * 0.02
            for k, s in shapes.items()}

    def slowest(seconds):
        return comm.allreduce(seconds, op=MPI.MAX)

    def median_phases(run_step):
        """Median over steps of each phase's time on the slowest rank."""
        samples = {p: [] for p in PHASES}
        for i in range(args.warmup + args.steps):
            comm.Barrier()
            phases = run_step()
            if i >= args.warmup:
                for p in PHASES:
                    samples[p].append(slowest(phases.get(p, 0.0)))
        return {p: statistics.median(v) for p, v in samples.items()}

    choice = optimizer_choice(args.optimizer)
    rule, options = choice["rule"], choice["options"]
    mixed = dtype != np.float32
    state_bytes = 4 * (len(rule.state_names) + int(mixed))  # per element: states (+ master)
    result = {"world_size": size, "psi": psi, "dtype": dtype.name, "model": args.model,
              "kernel": resolve_cpu_kernel(), "optimizer": args.optimizer}

    # (b) zero1_mpi
    opt = choice["cls"](init, comm, **options, param_dtype=dtype.name)

    def zero1_step():
        for k, g in grads.items():
            opt.grads[k][...] = g
        opt.step()
        t = opt.last_step_seconds
        return {"reduce": t["reduce"] + t["agree"], "optimizer": t["update"],
                "gather": t["gather"]}

    result["overlap"] = overlap_experiment(np, comm, MPI, opt, shapes, args)
    report = opt.memory_report()
    owned = opt.layout.owned_real(rank)
    result["zero1"] = {**median_phases(zero1_step),
                       "bytes": comm.allreduce(report.total, op=MPI.MAX),
                       "state_bytes": comm.allreduce(owned * state_bytes, op=MPI.MAX),
                       "formula_bytes": psi * 2 * dtype.itemsize + psi * state_bytes / size}
    opt = None  # free its buffers before the baseline allocates its own

    # (a) plain data parallelism: Allreduce in fp32, the full update on every rank, same kernel.
    flat_grads = np.concatenate([g.reshape(-1) for g in grads.values()])
    summed = np.empty(psi, np.float32)
    master = np.concatenate([v.reshape(-1) for v in init.values()]).astype(np.float32)
    states = [np.zeros(psi, np.float32) for _ in rule.state_names]
    params16 = master.astype(dtype) if dtype != np.float32 else None
    update = rule_update(rule, resolve_cpu_kernel(), psi)
    scalars = rule.scalars(STEP, options, 1.0 / size)
    # A two-phase rule's norms are per tensor: one range per tensor; else the whole buffer.
    bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes.values()]).tolist()
    ranges = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])] \
        if getattr(rule, "tensor_sums", 0) else [slice(0, psi)]

    summed[...] = flat_grads

    def baseline_step():
        t0 = time.perf_counter()
        if dtype != np.float32:
            summed[...] = flat_grads  # 16-bit: widen first (MPI has no bf16 sum)
        # In place on the gradient buffer, as DDP does (the values it leaves do not matter).
        comm.Allreduce(MPI.IN_PLACE, summed, op=MPI.SUM)
        t1 = time.perf_counter()
        for r in ranges:
            update(summed[r], master[r], [x[r] for x in states],
                   None if params16 is None else params16[r], scalars)
        return {"reduce": t1 - t0, "optimizer": time.perf_counter() - t1}

    # params + grads (16-bit or fp32), the states, the fp32 master for 16-bit params, and for
    # 16-bit grads the fp32 buffer they are summed in (fp32 grads are summed in place).
    baseline_bytes = psi * (2 * dtype.itemsize + state_bytes) + (summed.nbytes if mixed else 0)
    result["baseline"] = {**median_phases(baseline_step), "bytes": baseline_bytes,
                          "state_bytes": psi * state_bytes}

    # Kernels alone, on arrays far larger than the caches (as a large model's shard would be).
    result["kernels"] = kernel_throughput(np, comm, MPI, max(psi // size, 1 << 23), dtype, args,
                                          choice)
    if args.torch and dtype == np.float32 and choice["torch"]:
        result["torch_zero"] = torch_zero(comm, MPI, shapes, grads, init, median_phases, choice)
    elif not choice["torch"]:
        result["torch_zero_skipped"] = f"torch has no {LABELS[args.optimizer]} optimizer"
    return result


def overlap_experiment(np, comm, MPI, opt, shapes, args, batch=64) -> dict:
    """How much of the gradient reduction hides behind a backward pass.

    The backward is simulated with the matrix products a real one does (dW = dy^T x for a
    batch of ``batch`` rows, db = sum dy), layer by layer from the last. Once blocking:
    backward, then ``step()``; once overlapped: ``grads_ready`` after each layer, then
    ``step()``. The reduce time left in ``step()`` is compared.
    """
    rng = np.random.default_rng(0)
    inputs = {k: (rng.standard_normal((batch, s[-1])).astype(np.float32),
                  rng.standard_normal((batch, s[0])).astype(np.float32)) for k, s in shapes.items()}

    def backward(overlap):
        for name in reversed(list(shapes)):
            x, dy = inputs[name]
            grad = dy.T @ x if len(shapes[name]) == 2 else dy.sum(axis=0)
            opt.grads[name][...] = grad * 1e-3
            if overlap:
                opt.grads_ready([name])

    out = {}
    for overlap in (False, True):
        backward_s, reduce_s, total_s = [], [], []
        for i in range(args.warmup + args.steps):
            comm.Barrier()
            t0 = time.perf_counter()
            backward(overlap)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= args.warmup:
                backward_s.append(comm.allreduce(t1 - t0, op=MPI.MAX))
                reduce_s.append(comm.allreduce(opt.last_step_seconds["reduce"], op=MPI.MAX))
                total_s.append(comm.allreduce(t2 - t0, op=MPI.MAX))
        out["overlapped" if overlap else "blocking"] = {
            "backward": statistics.median(backward_s), "reduce_in_step": statistics.median(
                reduce_s), "iteration": statistics.median(total_s)}
    blocking, overlapped = out["blocking"]["reduce_in_step"], out["overlapped"]["reduce_in_step"]
    out["hidden_fraction"] = 1 - overlapped / blocking if blocking > 0 else 0.0
    return out


def kernel_throughput(np, comm, MPI, n, dtype, args, choice) -> dict:
    """Elements per second of each kernel of ``choice``'s rule and of its reference (key
    ``reference``) on a shard of ``n`` elements, every rank at once, and the ceiling it is bound
    by, in the same conditions: an in-place read-write stream (``a += b``, read a and b, write
    a) over as many fp32 bytes as the kernel's arrays (gradient, master weights, states)."""
    from zero1_mpi.reductions import resolve_cpu_kernel

    def best(fn, repeat=5):
        fn()
        times = []
        for _ in range(repeat):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return comm.allreduce(min(times), op=MPI.MAX)

    def in_place_stream(a, b):  # read a and b, write a: 12 bytes per element of a
        return 3 * a.nbytes / best(lambda: np.add(a, b, out=a)) / 1e9

    rule, arrays = choice["rule"], 2 + len(choice["rule"].state_names)
    half = arrays * n // 2
    stream_gbs = in_place_stream(np.ones(half, np.float32), np.zeros(half, np.float32))
    mixed = dtype != np.float32
    # The kernel's input: the gradients themselves on one rank; on more, their fp32 sums.
    inputs = {"": np.full(n, 1e-3, np.float32)}
    if mixed:
        inputs = {" (16-bit grads in)": np.full(n, 1e-3, dtype),
                  " (fp32 sums in, N > 1)": inputs[""]}
    master, param = np.ones(n, np.float32), np.ones(n, dtype) if mixed else None
    states = [np.zeros(n, np.float32) for _ in rule.state_names]
    s = rule.scalars(STEP, choice["options"], 1.0)
    # read g, read and write p and each state (+ write the 16-bit p)
    bytes_per_element = 4 + 8 * (arrays - 1) + (2 if mixed else 0)
    reference = choice["torch"][2] if args.torch and choice["torch"] else "zero1_numpy"
    out = {"stream_GBps": stream_gbs, "bytes_per_element": bytes_per_element,
           "reference": reference}
    kernels = ["numpy"] + (["numba"] if resolve_cpu_kernel() == "numba" else [])
    for name in kernels:
        update = rule_update(rule, name, n)
        for label, grad_in in inputs.items():
            rate = n / best(lambda: update(grad_in, master, states, param, s))
            out[f"zero1_{name}{label}"] = {"Gelem_per_s": rate / 1e9,
                                           "GBps": rate * bytes_per_element / 1e9}
    if args.torch and choice["torch"]:
        import torch
        torch.set_num_threads(1)
        torch_class, torch_options, key = choice["torch"]
        p = torch.nn.Parameter(torch.ones(n))
        opt = getattr(torch.optim, torch_class)([p], **choice["options"], **torch_options)
        if mixed:
            tdtype = torch.bfloat16 if dtype.name == "bfloat16" else torch.float16
            g16, p16 = torch.full((n,), 1e-3, dtype=tdtype), torch.ones(n, dtype=tdtype)
            p.grad = torch.empty(n)

            def torch_step():  # the same job: 16-bit grads in, fp32 update, 16-bit params out
                p.grad.copy_(g16)
                opt.step()
                p16.copy_(p.detach())
        else:
            p.grad = torch.full((n,), 1e-3)

            def torch_step():
                opt.step()
        rate = n / best(torch_step)
        out[key] = {"Gelem_per_s": rate / 1e9, "GBps": rate * bytes_per_element / 1e9}
    return out


def torch_zero(comm, MPI, shapes, grads, init, median_phases, choice) -> dict:
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    if not dist.is_initialized():
        port = None
        if comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size())
    params = [torch.nn.Parameter(torch.tensor(init[k])) for k in shapes]
    tgrads = [torch.tensor(grads[k]) for k in shapes]
    torch_class, torch_options, _ = choice["torch"]
    zero = ZeroRedundancyOptimizer(params, optimizer_class=getattr(torch.optim, torch_class),
                                   **choice["options"], **torch_options)
    local = {"seconds": 0.0}
    inner_step = zero.optim.step

    def timed_inner_step(*a, **k):
        t = time.perf_counter()
        out = inner_step(*a, **k)
        local["seconds"] = time.perf_counter() - t
        return out
    zero.optim.step = timed_inner_step
    world = comm.Get_size()

    def step():
        for p, g in zip(params, tgrads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        for p in params:  # DDP's gradient averaging
            dist.all_reduce(p.grad)
            p.grad /= world
        t1 = time.perf_counter()
        zero.step()
        total = time.perf_counter() - t1
        return {"reduce": t1 - t0, "optimizer": local["seconds"],
                "gather": total - local["seconds"]}

    phases = median_phases(step)
    zero.step()
    state = sum(t.numel() * t.element_size() for st in zero.optim.state.values()
                for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    psi = sum(p.numel() for p in params)
    return {**phases, "bytes": comm.allreduce(8 * psi + state, op=MPI.MAX),
            "state_bytes": comm.allreduce(state, op=MPI.MAX),
            "state_bytes_min": comm.allreduce(state, op=MPI.MIN)}


# -- reporting -------------------------------------------------------------------------------

def total(r: dict) -> float:
    return sum(r[p] for p in PHASES if p in r)


def table(results: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| N | implementation | reduce ms | optimizer ms | gather ms | total ms | "
             "bytes/rank | optimizer state/rank |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    rule = LABELS[results[0].get("optimizer", "adam")]
    for r in results:
        for key, label in (("baseline", f"(a) DP: Allreduce + full {rule}"),
                           ("zero1", "(b) zero1_mpi"),
                           ("torch_zero", "(c) torch ZeroRedundancyOptimizer")):
            if key == "torch_zero" and "torch_zero_skipped" in r:
                lines.append(f"| {r['world_size']} | {label}: skipped, "
                             f"{r['torch_zero_skipped']} | - | - | - | - | - | - |")
            if key in r:
                x = r[key]
                lines.append(f"| {r['world_size']} | {label} | {x['reduce'] * 1e3:.1f} | "
                             f"{x['optimizer'] * 1e3:.1f} | {x.get('gather', 0) * 1e3:.1f} | "
                             f"{total(x) * 1e3:.1f} | {x['bytes'] / mib:.0f} MiB | "
                             f"{x['state_bytes'] / mib:.0f} MiB |")
    lines += ["", "| N | (b)/(a) total | (b)/(c) total | (b) RS+AG / (a) Allreduce | "
              "(b) optimizer vs N=1 |", "|---:|---:|---:|---:|---:|"]
    first = results[0]["zero1"]["optimizer"] if results[0]["world_size"] == 1 else None
    for r in results:
        z, a = r["zero1"], r["baseline"]
        vs_c = f"{total(z) / total(r['torch_zero']):.2f}x" if "torch_zero" in r else "-"
        comm_ratio = "-" if r["world_size"] == 1 else \
            f"{(z['reduce'] + z['gather']) / a['reduce']:.2f}x"
        vs_1 = f"{z['optimizer'] / first:.2f}x" if first else "-"
        lines.append(f"| {r['world_size']} | {total(z) / total(a):.2f}x | {vs_c} | "
                     f"{comm_ratio} | {vs_1} |")
    reference = results[0]["kernels"].get("reference", "torch_fused_adamw")
    lines += ["", f"| N | kernel | G elements/s per rank | GB/s | of in-place stream | "
              f"vs {reference} |", "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        k = r["kernels"]
        for name in [key for key in k if key.startswith(("zero1", "torch"))]:
            if name in k:
                ref = reference_rate(k, name)
                vs = f"{k[name]['Gelem_per_s'] / ref:.2f}x" if ref else "-"
                lines.append(f"| {r['world_size']} | {name} | {k[name]['Gelem_per_s']:.2f} | "
                             f"{k[name]['GBps']:.1f} | {k[name]['GBps'] / k['stream_GBps']:.0%} | "
                             f"{vs} |")
    lines += ["", "| N | backward ms | reduce left in step(), blocking | ... overlapped with "
              "grads_ready() | hidden | iteration ms blocking / overlapped |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        o = r.get("overlap")
        if o and r["world_size"] > 1:
            b, v = o["blocking"], o["overlapped"]
            lines.append(f"| {r['world_size']} | {b['backward'] * 1e3:.1f} | "
                         f"{b['reduce_in_step'] * 1e3:.1f} | {v['reduce_in_step'] * 1e3:.1f} | "
                         f"{o['hidden_fraction']:.0%} | {b['iteration'] * 1e3:.1f} / "
                         f"{v['iteration'] * 1e3:.1f} |")
    return "\n".join(lines)


def reference_rate(kernels: dict, name: str) -> float | None:
    """The reference's elements/s for the row ``name``: torch's one row, or the NumPy twin's
    row with the same input (16-bit gradients in, or fp32 sums)."""
    reference = kernels.get("reference", "torch_fused_adamw")
    if reference == "zero1_numpy" and " " in name:
        reference += name[name.index(" "):]
    return kernels.get(reference, {}).get("Gelem_per_s")


def plot(results: list[dict], file: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = [k for k in ("baseline", "zero1", "torch_zero") if k in results[0]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [j + i * width for j in range(len(results))]
        bottom = [0.0] * len(results)
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange", "tab:green")):
            heights = [r[key].get(phase, 0) * 1e3 for r in results]
            left.bar(xs, heights, width, bottom=bottom, color=color,
                     label=phase if i == 0 else None, edgecolor="black", linewidth=0.3)
            bottom = [b + h for b, h in zip(bottom, heights)]
        right.plot([r["world_size"] for r in results],
                   [r[key]["bytes"] / 2 ** 20 for r in results], marker="o", label=key)
    left.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(results))],
                    [f"N={r['world_size']}" for r in results])
    left.set_ylabel("ms per step (bars: " + ", ".join(keys) + ")")
    left.legend()
    right.set_xlabel("ranks N")
    right.set_xticks([r["world_size"] for r in results])
    right.set_ylabel("MiB per rank")
    right.legend()
    fig.suptitle(f"{results[0]['model']} ({results[0]['psi'] / 1e6:.1f}M params, "
                 f"{results[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", help="launch mpiexec for each N (e.g. 1,2,4)")
    parser.add_argument("--optimizer", default="adam", choices=list(LABELS),
                        help="the update rule measured, against its reference (default adam)")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    parser.add_argument("--mpiexec", help="MPI launcher, flags allowed "
                        "(default: $ZERO1_MPIEXEC, else mpiexec)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
        args.torch = True
    except ImportError:
        args.torch = False

    optimizer_choice(args.optimizer)  # an unavailable one fails here, before any launch
    if args.ranks:
        results = []
        for n in (int(x) for x in args.ranks.split(",")):
            forwarded = ["--worker", "--optimizer", args.optimizer, "--model", args.model,
                         "--dtype", args.dtype,
                         "--steps", str(args.steps), "--warmup", str(args.warmup)]
            results.append(run_ranks(n, str(Path(__file__).resolve()), forwarded,
                                     args.mpiexec, args.timeout))
            print(f"N={n} done", file=sys.stderr, flush=True)
    else:
        result = worker(args)
        if args.worker:
            if result["world_size"] and _rank() == 0:
                print(json.dumps(result), flush=True)
            return 0
        if _rank() != 0:
            return 0
        results = [result]
    r0 = results[0]
    print(f"{r0['model']}: {r0['psi'] / 1e6:.1f}M {r0['dtype']} parameters, "
          f"{LABELS[args.optimizer]}, CPU kernel {r0['kernel']}, one thread per rank, median of "
          f"{args.steps} steps\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and not plot(results, args.plot):
        print("(no plot: matplotlib is not installed)")
    return 0


def _rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


if __name__ == "__main__":
    sys.exit(main())
