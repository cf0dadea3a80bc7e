"""One optimizer step: plain data parallelism, zero1_mpi, torch's ZeroRedundancyOptimizer.

Measures, side by side in one run on the same parameters and gradients, one optimizer step of
(a) plain data parallelism: an ``Allreduce`` of the gradients, then the full update on every
    rank (the seed's baseline), with the same fused kernel as (b);
(b) zero1_mpi: ``Reduce_scatter`` (or ``Alltoall`` + fp32 sum), the update on the owned shard,
    ``Allgather``;
(c) ``torch.distributed.optim.ZeroRedundancyOptimizer`` over gloo wrapping the torch reference
    optimizer, after an all-reduce of the gradients (what DDP does), when torch is installed and
    has the optimizer (fp32 only).
For each: the step split into gradient reduction, optimizer math and parameter gathering (median
over --steps after --warmup, the slowest rank each time), bytes per rank, and ratios; the
overlap of the reduction with a simulated backward (``grads_ready``); and the throughput of the
kernels alone (ours, NumPy and Numba, and the reference; for 16-bit, torch doing the same job:
grads to fp32, its update, fp32 to 16-bit params) against the in-place read-write stream
bandwidth measured in the same run (``a += b`` over fp32 arrays as large as the kernel's, bytes
counted as for the kernel: the gradient read, the master weights and each state array read and
written; LAMB's two passes move more than that).

--optimizer picks any rule of ``zero1_mpi.rules.registry`` (``KNOWN``): adam (the default) is
AdamW against ``torch.optim.AdamW(fused=True)``; sgd is SGD with momentum 0.9 against
``torch.optim.SGD(momentum=0.9, foreach=True)``; the others (Lion, LAMB) have no torch
optimizer: their reference is the rule's NumPy float32 twin at the same thread count, and (c)
is skipped. --model mlp is the 25M-parameter MLP 1024->4096->4096->1024; flat:16M one flat
tensor of that many elements. --plot writes a PNG (time split and bytes per rank against N;
needs matplotlib). Example: python tools/bench.py step --ranks 1,2,4 --json step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np

from zero1_mpi.rules.registry import builtin_rules

from . import common
from .step_report import report, rule_label  # noqa: F401 (report: the benchmark's)

RANKS, TIMEOUT = None, 1200
STEP = 2  # the step number of the kernels' scalars: past SGD's first step (a copy into the buffer)
#: What the benchmark sets beside lr=1e-4 and the rule's defaults, and torch's reference
#: (torch.optim class, its extra options, result key), for the rules torch has.
KNOWN = {
    "adam": ({"weight_decay": 1e-2}, ("AdamW", {"fused": True}, "torch_fused_adamw")),
    "sgd": ({"momentum": 0.9}, ("SGD", {"foreach": True}, "torch_sgd_foreach")),
    "lion": ({"weight_decay": 1e-2}, None),
}


def options(parser) -> None:
    parser.add_argument("--optimizer", default="adam", choices=list(builtin_rules()),
                        help="the update rule measured, against its reference (default adam)")
    parser.add_argument("--model", type=model, default="mlp",
                        help="mlp (25M) or flat:<elements>")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    common.steps(parser, 10, warmup=3)
    parser.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")


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
        return {"flat": (common.count(model[5:]),)}
    raise argparse.ArgumentTypeError(f"{model!r}: use mlp or flat:<elements>")


def model(text: str) -> str:
    """An argparse type: ``--model`` checked (``model_shapes``)."""
    model_shapes(text)
    return text


# -- the worker: runs on every rank ------------------------------------------------------------

def worker(args) -> dict:
    from mpi4py import MPI

    from zero1_mpi import ShardedOptimizer
    from zero1_mpi.kernels.backend import resolve_dtype
    from zero1_mpi.kernels.local_sums import resolve_cpu_kernel

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

    def median_phases(run_step):
        return common.median_phases(comm, run_step, args.steps, args.warmup)

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

    result["overlap"] = overlap_experiment(comm, opt, shapes, args)
    report_ = opt.memory_report()
    result["zero1"] = {**median_phases(zero1_step),
                       "bytes": common.slowest(comm, report_.total),
                       # (the masters and state as kept: bf16's remainder masters take 2 bytes)
                       "state_bytes": common.slowest(comm, report_.optimizer_state),
                       "formula_bytes": psi * 2 * dtype.itemsize
                       + psi * report_.bytes_per_param / size}
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
        return {"reduce": t1 - t0, "optimizer": time.perf_counter() - t1, "gather": 0.0}

    # params + grads (16-bit or fp32), the states, the fp32 master for 16-bit params, and for
    # 16-bit grads the fp32 buffer they are summed in (fp32 grads are summed in place).
    baseline_bytes = psi * (2 * dtype.itemsize + state_bytes) + (summed.nbytes if mixed else 0)
    result["baseline"] = {**median_phases(baseline_step), "bytes": baseline_bytes,
                          "state_bytes": psi * state_bytes}

    # Kernels alone, on arrays far larger than the caches (as a large model's shard would be).
    with_torch = importlib.util.find_spec("torch") is not None
    result["kernels"] = kernel_throughput(comm, max(psi // size, 1 << 23), dtype, choice,
                                          with_torch)
    if with_torch and dtype == np.float32 and choice["torch"]:
        from .step_torch import torch_zero
        result["torch_zero"] = torch_zero(comm, shapes, grads, init, median_phases, choice)
    elif not choice["torch"]:
        result["torch_zero_skipped"] = f"torch has no {rule_label(args.optimizer)} optimizer"
    return result


def overlap_experiment(comm, opt, shapes, args, batch=64) -> dict:
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
        def iteration():
            t0 = time.perf_counter()
            backward(overlap)
            t1 = time.perf_counter()
            opt.step()
            return {"backward": t1 - t0, "reduce_in_step": opt.last_step_seconds["reduce"],
                    "iteration": time.perf_counter() - t0}
        out["overlapped" if overlap else "blocking"] = common.median_phases(
            comm, iteration, args.steps, args.warmup)
    blocking, overlapped = out["blocking"]["reduce_in_step"], out["overlapped"]["reduce_in_step"]
    out["hidden_fraction"] = 1 - overlapped / blocking if blocking > 0 else 0.0
    return out


def kernel_throughput(comm, n, dtype, choice, with_torch: bool) -> dict:
    """Elements per second of each kernel of ``choice``'s rule and of its reference (key
    ``reference``: torch's where ``with_torch`` and torch has the rule) on a shard of ``n``
    elements, every rank at once, and the ceiling it is bound by, in the same conditions: an
    in-place read-write stream (``a += b``, read a and b, write a) over as many fp32 bytes as
    the kernel's arrays (gradient, master weights, states)."""
    from zero1_mpi.kernels.local_sums import resolve_cpu_kernel

    def best(fn, repeat=5):
        fn()
        times = []
        for _ in range(repeat):
            comm.Barrier()
            times.append(common.clock(fn))
        return common.slowest(comm, min(times))

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
    reference = choice["torch"][2] if with_torch and choice["torch"] else "zero1_numpy"
    out = {"stream_GBps": stream_gbs, "bytes_per_element": bytes_per_element,
           "reference": reference}
    kernels = ["numpy"] + (["numba"] if resolve_cpu_kernel() == "numba" else [])
    for name in kernels:
        update = rule_update(rule, name, n)
        for label, grad_in in inputs.items():
            rate = n / best(lambda: update(grad_in, master, states, param, s))
            out[f"zero1_{name}{label}"] = {"Gelem_per_s": rate / 1e9,
                                           "GBps": rate * bytes_per_element / 1e9}
    if with_torch and choice["torch"]:
        from .step_torch import torch_kernel
        _, _, key = choice["torch"]
        rate = n / best(torch_kernel(n, dtype, choice))
        out[key] = {"Gelem_per_s": rate / 1e9, "GBps": rate * bytes_per_element / 1e9}
    return out
