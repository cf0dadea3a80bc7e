"""Bytes each rank allocates, measured with tracemalloc (NumPy's buffers are traced), not derived.

    mpiexec -n N python -m mpi4py tests/cases/memory.py DIR

For every update rule (AdamW, SGD with and without momentum, Lion, and LAMB when this
zero1_mpi has ``ZeroLAMB``; AdamW also with gradient sharding, its shard in the parameters'
dtype or fp32), fp32 and bf16 parameters and two model sizes Ψ, on every rank:
- what the optimizer holds after a step equals ``memory_report().total`` (within the few KB of
  Python objects around the arrays);
- the report names the rule's state arrays, its K (bytes per parameter of the sharded part:
  Adam 12, SGD 8 or 4 without momentum, Lion 8, with fp32 masters; 2 less with bf16's default
  remainder masters, 4 less for fp32 parameters) is the rule's, and summed over ranks each
  state array holds 4 bytes per parameter and the masters theirs: every byte of state in its
  own category once (none reported as padding);
- what it holds grows with Ψ exactly as the formula does (2Ψ + 2Ψ + KΨ/N, or 4Ψ + 4Ψ + KΨ/N
  for fp32; with gradient sharding 2Ψ + (G + K)Ψ/N, G the gradient shard's bytes), up to the
  padding of the last bucket: state that is not sharded (an exp_avg of full length, say)
  grows by Ψ-proportional bytes more and fails;
- the excess over the formula (padding and scratch), and padding + scratch as reported, do not
  grow with Ψ.
And saving and loading a checkpoint, and exporting and importing the consolidated file, never
allocate more than ``LIMIT`` on any rank, for a model whose whole state is several times that
(a save that gathers the state on one rank would exceed it).
"""

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zero1_mpi
from casekit import check
from zero1_mpi import ZeroAdamW, ZeroLion, ZeroSGD
from zero1_mpi.persistence.checkpoint import CHUNK
from zero1_mpi.memory import MASTER_BYTES, STATE_BYTES, stage1_bytes, stage1_fp32_bytes

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SIZES = (300_000, 900_000)      # Ψ: the second adds 600k elements
PYTHON_OBJECTS = 64 * 1024      # views, layout, dicts around the arrays
LIMIT = 4 * CHUNK * 4           # 16 MiB: a few chunk buffers, whatever the model size
DTYPES = ("float32", "bfloat16")
#: (label, optimizer class or None when absent, options, its state arrays, K per dtype above);
#: the expectations are written out here, not taken from the rules.
RULES = (
    ("adamw", ZeroAdamW, {}, ("exp_avg", "exp_avg_sq"), (8, 10)),
    ("adamw, fp32 masters", ZeroAdamW, {"masters": "fp32"}, ("exp_avg", "exp_avg_sq"), (8, 12)),
    # the state in 2 bytes, or in 8-bit blocks (1 + 4/256; the small tensors' in fp32)
    ("adamw, bf16 state", ZeroAdamW, {"state_dtype": "bfloat16"}, ("exp_avg", "exp_avg_sq"),
     (4, 6)),
    ("adamw, int8 state", ZeroAdamW, {"state_dtype": "int8"}, ("exp_avg", "exp_avg_sq"),
     (2 * (1 + 4 / 256), 2 + 2 * (1 + 4 / 256))),
    ("sgd momentum", ZeroSGD, {"momentum": 0.9}, ("momentum_buffer",), (4, 6)),
    ("sgd", ZeroSGD, {}, (), (0, 2)),
    ("lion", ZeroLion, {}, ("exp_avg",), (4, 6)),
    ("lamb", getattr(zero1_mpi, "ZeroLAMB", None), {}, ("exp_avg", "exp_avg_sq"), (8, 10)),
    # gradient sharding (stage 2): the gradient shard in the parameters' dtype, or fp32; buckets
    # small enough that both sizes fill the 2 staging buckets (their scratch is then constant)
    ("adamw stage 2", ZeroAdamW, {"shard_gradients": True, "bucket_elements": 1 << 16},
     ("exp_avg", "exp_avg_sq"), (8, 10)),
    ("adamw stage 2 fp32 shard", ZeroAdamW,
     {"shard_gradients": True, "grad_shard_dtype": "float32", "bucket_elements": 1 << 16},
     ("exp_avg", "exp_avg_sq"), (8, 10)),
    # parameter sharding (stage 3): (P + G + K)Ψ/N, the parameters' shard booked
    ("adamw stage 3", ZeroAdamW, {"shard_params": True, "bucket_elements": 1 << 16},
     ("exp_avg", "exp_avg_sq"), (8, 10)),
    # the 8-bit wire: its residual booked as error_feedback (the gradients' dtype, Ψ values)
    ("adamw int8 wire, error feedback", ZeroAdamW,
     {"reduce_dtype": "int8", "error_feedback": True, "bucket_elements": 1 << 16},
     ("exp_avg", "exp_avg_sq"), (8, 10)),
    # half offloaded (bf16 only: fp32 masters on both sides, K 12), stage 1 and 2
    ("adamw half offloaded", ZeroAdamW, {"offload": "cpu", "offload_fraction": 0.5,
                                         "offload_threads": 1}, ("exp_avg", "exp_avg_sq"),
     (None, 12)),
    ("adamw half offloaded, stage 2", ZeroAdamW,
     {"offload": "cpu", "offload_fraction": 0.5, "offload_threads": 1, "shard_gradients": True,
      "bucket_elements": 1 << 16}, ("exp_avg", "exp_avg_sq"), (None, 12)),
)


def shapes(psi):
    return {"w": (psi // 1000 - 1, 1000), "b": (1000,), "odd": (psi % 1000 or 1,)}


def held_after_a_step(psi, dtype_name, make=ZeroAdamW, options=None):
    """(bytes the optimizer holds, measured; its memory_report) after one step."""
    init = {k: np.ones(s, np.float32) for k, s in shapes(psi).items()}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    options = {"bucket_elements": 1 << 18, **(options or {})}
    opt = make(init, comm, param_dtype=dtype_name, **options)
    if opt.grad_shard_dtype is None:
        for g in opt.grads.values():
            g[...] = 1e-3
    else:  # stage 2: handed over, then dropped
        for name, shape in list(shapes(psi).items())[::-1]:
            opt.add_grad(name, np.full(shape, 1e-3, opt.param_dtype))
    opt.step()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, opt.memory_report()


def check_report_names_the_state(what, psi, report, names, k):
    """Every byte of state in its own category, once: 4 bytes per parameter per array over
    all ranks, none of them counted as padding; K and the formula are the rule's."""
    check(tuple(report.state) == names,
          f"{what}: memory_report().state names {tuple(report.state)}, expected {names}")
    check(report.bytes_per_param == k,
          f"{what}: memory_report().bytes_per_param={report.bytes_per_param}, expected {k}")
    param = 4 if report.param_dtype == "float32" else 2
    if report.params_sharded:  # stage 3: (P + G + K)Ψ/N, every part sharded
        grad = 4 if report.grad_shard_dtype == "float32" else 2
        expected = (param + grad + k) * psi / size
    elif report.grad_shard_dtype is None:
        formula = (stage1_fp32_bytes if report.param_dtype == "float32" else stage1_bytes)
        expected = formula(psi, size, k)
    else:  # stage 2: 2Ψ + (G + K)Ψ/N, G the gradient shard's bytes per element
        grad = 4 if report.grad_shard_dtype == "float32" else 2
        expected = param * psi + (grad + k) * psi / size
    check(report.formula_bytes == expected,
          f"{what}: formula_bytes={report.formula_bytes}, expected {expected}")
    master = MASTER_BYTES[report.masters] if report.param_dtype != "float32" else 0
    sums = comm.allreduce(np.array([report.master_weights] + [report.state[n] for n in names],
                                   np.int64)).tolist()
    # (every master holds the same value: no tie, or all of them; they are not)
    element = STATE_BYTES[report.state_dtype]
    expected = [master * psi] + [element * psi] * len(names)
    if report.state_dtype == "int8":  # + the small tensors' fp32, the pieces' partial blocks
        small = sum(int(np.prod(s)) for s in shapes(psi).values() if np.prod(s) < 4096)
        over = [got - want for got, want in zip(sums[1:], expected[1:])]
        check(all(3 * small <= o <= 4 * small + 4 * 64 * size for o in over),
              f"{what}: the 8-bit state holds {over} bytes over its formula, {small} small")
        sums[1:] = expected[1:]
    check(sums == expected, f"{what}: over {size} ranks master_weights and {names} hold "
                            f"{sums} bytes, expected {expected} (per parameter: {master} a "
                            f"master, {element} a state element)")


def check_held_memory():
    gc.collect()
    gc.freeze()  # the modules' objects: each gc.collect() below walks only what the cases made
    measured = []
    for what, make, options, names, ks in RULES:
        if make is None:
            continue
        for dtype_name, k in zip(DTYPES, ks):
            if k is None:
                continue
            label = f"{what}, {dtype_name}"
            (small, small_report), (large, large_report) = (
                held_after_a_step(psi, dtype_name, make, options) for psi in SIZES)
            check_memory(label, names, k, (small, small_report), (large, large_report))
            measured.append((label, large_report))
    return measured


def check_memory(what, names, k, small_pair, large_pair):
    (small, small_report), (large, large_report) = small_pair, large_pair
    for psi, (held, report) in zip(SIZES, (small_pair, large_pair)):
        check(abs(held - report.total) <= PYTHON_OBJECTS,
              f"{what}: memory_report().total={report.total}, measured {held}")
        numel = sum(int(np.prod(s)) for s in shapes(psi).values())
        if "error feedback" in what:  # one residual of the full gradient, in its dtype
            itemsize = 4 if report.param_dtype == "float32" else 2
            check(numel * itemsize <= report.error_feedback <= (numel + 64 * size) * itemsize,
                  f"{what}: error_feedback={report.error_feedback} for {numel} gradients")
        else:
            check(report.error_feedback == 0, f"{what}: error_feedback booked without it")
        check(report.psi == numel, f"{what}: memory_report().psi={report.psi}, not {numel}")
        if report.offloaded:  # a share of the state on the host (at a piece's start)
            check(0 < report.offload_fraction < 1 and report.host_state == round(
                report.optimizer_state * report.offload_fraction),
                f"{what}: {report.host_state} of {report.optimizer_state} bytes on the host "
                f"({report.offload_fraction})")
        check_report_names_the_state(what, numel, report, names, k)
    grown = large - small
    formula_grown = (large_report.formula_bytes + large_report.error_feedback
                     - small_report.formula_bytes - small_report.error_feedback)
    padding = 64 * size * 4 * 4  # one bucket's alignment, in every buffer
    check(abs(grown - formula_grown) <= padding + PYTHON_OBJECTS,
          f"{what}: {SIZES[1] - SIZES[0]} more parameters took {grown} bytes more on "
          f"rank {rank}; the formula says {formula_grown:.0f}")
    excess = [held - r.formula_bytes - r.error_feedback for held, r in (small_pair, large_pair)]
    check(excess[1] - excess[0] <= padding + PYTHON_OBJECTS,
          f"{what}: the excess over the formula grew from {excess[0]:.0f} to "
          f"{excess[1]:.0f} bytes")
    extra = [r.padding + r.comm_scratch for r in (small_report, large_report)]
    check(abs(extra[1] - extra[0]) <= padding,
          f"{what}: padding + comm_scratch grew from {extra[0]} to {extra[1]} bytes on rank "
          f"{rank}: Ψ-proportional bytes reported as padding or scratch")


def peak(fn):
    gc.collect()
    tracemalloc.start()
    fn()
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top


def check_checkpoint_peaks(directory: Path):
    psi = 3 * 1024 * 1024  # fp32 state: 36 MiB in all, 12 MiB per rank on 3 ranks
    init = {k: np.ones(s, np.float32) for k, s in shapes(psi).items()}
    opt = ZeroAdamW(init, comm)
    for g in opt.grads.values():
        g[...] = 1e-3
    opt.step()
    check(12 * psi > 2 * LIMIT, "the model is too small to tell a gathering save")
    for what, fn in (("save", lambda: opt.save(directory / "root")),
                     ("load", lambda: opt.load(directory / "root")),
                     ("save_consolidated", lambda: opt.save_consolidated(directory / "all.st")),
                     ("load_consolidated", lambda: opt.load_consolidated(directory / "all.st"))):
        top = peak(fn)
        check(top < LIMIT, f"{what} allocated {top} bytes on rank {rank} (limit {LIMIT})")


if __name__ == "__main__":
    measured = check_held_memory()
    check_checkpoint_peaks(Path(sys.argv[1]))
    reports = comm.gather([r.total for _, r in measured])
    if rank == 0:
        for i, (label, r) in enumerate(measured):
            most = max(totals[i] for totals in reports)
            print(f"{label}: Ψ={r.psi} K={r.bytes_per_param} max held {most} bytes/rank, "
                  f"formula {r.formula_bytes:.0f} ({r.formula_label})")
        if getattr(zero1_mpi, "ZeroLAMB", None) is None:
            print("lamb not measured: this zero1_mpi has no ZeroLAMB")
        print(f"OK measured memory on {size} ranks")
