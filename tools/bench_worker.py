"""The per-rank half of ``tools/bench.py``: measures one world size and prints one JSON line.

``mpiexec -n N python -m mpi4py tools/bench_worker.py [--optimizer adam] [--model mlp] [--dtype
float32] [--steps 10] [--warmup 3]``, as ``bench.py --ranks`` launches it; ``bench.py`` without
``--ranks`` calls ``worker(args)`` in-process. On every rank: (a) plain data parallelism with the
same kernel, (b) zero1_mpi, (c) torch's ``ZeroRedundancyOptimizer`` where torch has the rule
(fp32), the overlap experiment and the kernels' throughput; rank 0 prints the result.
The rules are the registry's (``zero1_mpi.rules.registry``): each runs with lr 1e-4, its
defaults and the options in ``KNOWN``, against torch's optimizer where ``KNOWN`` names one and
its own NumPy twin otherwise.
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

from zero1_mpi.memory import parse_param_count  # noqa: E402
from zero1_mpi.rules.registry import builtin_rules  # noqa: E402

PHASES = ("reduce", "optimizer", "gather")
STEP = 2  # the step number of the kernels' scalars: past SGD's first step (a copy into the buffer)
#: What the benchmark sets beside lr=1e-4 and the rule's defaults, and torch's reference
#: (torch.optim class, its extra options, result key), for the rules torch has.
KNOWN = {
    "adam": ({"weight_decay": 1e-2}, ("AdamW", {"fused": True}, "torch_fused_adamw")),
    "sgd": ({"momentum": 0.9}, ("SGD", {"foreach": True}, "torch_sgd_foreach")),
    "lion": ({"weight_decay": 1e-2}, None),
}


def optimizer_choice(name: str) -> dict:
    """What ``--optimizer name`` measures: the ``rule`` (the registry's first variant), its
    group ``options``, and the reference kernel, ``torch`` = (torch.optim class, its extra
    options, result key), or None: the rule's NumPy twin (result key ``zero1_numpy``), run
    at the same thread count."""
    entry = builtin_rules()[name]
    extra, torch_ref = KNOWN.get(name, ({}, None))
    options = entry.rule.variants()[0].check_options(**{**entry.defaults, "lr": 1e-4, **extra})
    return {"rule": entry.rule.variants()[0], "options": options, "torch": torch_ref}


def rule_update(rule, kind: str, largest: int):
    """The rule's fused update over one range (of one tensor, for a two-phase rule), as
    ``update(grad, master, states, param, scalars)``: one kernel call, or for a rule with
    ``tensor_sums`` (LAMB) its partial sums, the tensor's scalars from them, then ``apply``."""
    kernel = rule.kernel(kind, largest)
    if not rule.tensor_sums:
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

    from zero1_mpi import ShardedOptimizer
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
    opt = ShardedOptimizer(init, comm, rule, options, param_dtype=dtype.name)

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
        if rule.tensor_sums else [slice(0, psi)]

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
        result["torch_zero_skipped"] = f"torch has no {rule_label(args.optimizer)} optimizer"
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


def rule_label(name: str) -> str:
    """``Adam``, ``SGD``, ``Lion``, ``LAMB``: the rule ``name``'s optimizer, for tables."""
    return builtin_rules()[name].optimizer.__name__.removeprefix("Zero")


def main(argv=None) -> int:
    """Measure on this job's ranks; rank 0 prints the result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adam", choices=list(builtin_rules()))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    args.torch = has_torch()
    result = worker(args)
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(result), flush=True)
    return 0


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
