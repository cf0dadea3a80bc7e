"""Hierarchical sharding (``shard_group_size=K``): the state sharded over groups of K
consecutive ranks and replicated across the N / K groups.

    mpiexec -n N python -m mpi4py tests/cases/hierarchical.py save DIR   (N = 4 or 6)
    mpiexec -n M python -m mpi4py tests/cases/hierarchical.py load DIR

``save``, for every K that divides N (1 < K < N) and every rule (Adam, SGD with momentum, Lion,
LAMB) in fp32 and bf16: N ranks against one process running the rule on the averaged gradients
(float64 reference, the parity bound) and against flat sharding (K = N), with tensors that
straddle shards and buckets, clipping and a loss scale; each rank holds the rule's state for
1/K of the parameters (``memory_report``); bad values (K not dividing N, K = 1, K differing
between ranks) raise on every rank. Then, per rule,
a checkpoint and a consolidated export saved under the largest K load under flat sharding on
the same ranks (the export of the loaded state is byte for byte the saved one). ``load``
(another world size, flat or K = 2) loads every saved checkpoint and checks the same.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from reference import (ReferenceAdam, ReferenceLAMB, ReferenceLion, ReferenceSGD,
                       close_to_reference)
from zero1_mpi import CollectiveError, ZeroAdamW, ZeroLAMB, ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"scalar": (), "w": (17, 9), "empty": (0, 4), "v": (5,), "long": (700,)}
STEPS = 6
RULES = {  # optimizer, reference, options (the reference's spelling where it differs)
    "adam": (ZeroAdamW, ReferenceAdam, {"lr": 1e-2, "weight_decay": 0.1},
             {"decoupled": True}),
    "sgd": (ZeroSGD, ReferenceSGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1,
                                    "weight_decay": 0.01}, {}),
    "lion": (ZeroLion, ReferenceLion, {"lr": 1e-3, "weight_decay": 0.1}, {}),
    "lamb": (ZeroLAMB, ReferenceLAMB, {"lr": 1e-2, "weight_decay": 0.01}, {}),
}


def init_values():
    return {k: np.random.default_rng([4, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def grads_of(r, step):
    rng = np.random.default_rng([11, step, r])
    return {k: rng.standard_normal(s).astype(np.float32) * (1 + r) for k, s in SHAPES.items()}


def make(rule, dtype_name, k):
    cls, _, options, _ = RULES[rule]
    return cls(init_values(), comm, param_dtype=dtype_name, bucket_elements=1,
               max_grad_norm=20.0, loss_scale=4.0, shard_group_size=k, **options)


def train(opt, steps):
    """Each tensor's gradient declared ready as it is written, last first (as a backward pass
    would): reductions, and the sums across the groups, start before ``step()``."""
    dtype = resolve_dtype(opt.param_dtype.name)
    for step in steps:
        for k, g in reversed(grads_of(rank, step).items()):
            opt.grads[k][...] = (g * opt.loss_scale).astype(dtype)
            opt.grads_ready(k)
        opt.step()


def check_parity(rule, dtype_name, k):
    dtype = resolve_dtype(dtype_name)
    _, reference, options, extra = RULES[rule]
    opt, flat = make(rule, dtype_name, k), make(rule, dtype_name, None)
    ref = reference(init_values(), max_grad_norm=20.0, **options, **extra)
    check((opt.shard_group_size, opt.shard_rank, opt.replicas) == (k, rank % k, size // k),
          f"K={k}: shard_group_size/shard_rank/replicas on rank {rank}")
    for step in range(1, STEPS + 1):
        train(opt, [step])
        train(flat, [step])
        every = [grads_of(r, step) for r in range(size)]
        ref.step({k_: np.mean([e[k_].astype(dtype).astype(np.float64) for e in every], axis=0)
                  for k_ in SHAPES})
        for name in SHAPES:
            for what, got in (("K", opt.params[name]), ("flat", flat.params[name])):
                ok, err = close_to_reference(got, ref.params[name], dtype)
                check(ok, f"{rule} {dtype_name} K={k} ({what}): step {step}, {name!r} off by "
                          f"{err} on rank {rank} of {size}")
    report = opt.memory_report()
    owned = opt.layout.owned_real(opt.shard_rank)
    check(report.state == {s: 4 * owned for s in opt.rule.state_names},
          f"{rule} K={k}: state bytes {report.state} on rank {rank}")
    total = comm.allreduce(sum(report.state.values()))
    check(total == (size // k) * 4 * len(opt.rule.state_names) * opt.layout.numel,
          f"{rule} K={k}: the ranks hold {total} bytes of state, not N/K replicas of it")


def expect_error(kind, words, **kwargs):
    try:
        ZeroAdamW(init_values(), comm, bucket_elements=1, **kwargs)
    except kind as exc:
        check(all(w in str(exc) for w in words), f"rank {rank}: {exc}")
    else:
        raise AssertionError(f"rank {rank}: {kwargs} was accepted")


def check_bad_values():
    expect_error(ValueError, [f"shard_group_size={size + 1}", f"the {size} ranks"],
                 shard_group_size=size + 1)
    expect_error(ValueError, ["shard_group_size=1", "use 2 or more"], shard_group_size=1)
    expect_error(ValueError, ["shard_group_size='two'"], shard_group_size="two")
    expect_error(CollectiveError, ["shard_group_size", "every rank"],
                 shard_group_size=2 if rank == 0 else None)


def save(directory: Path):
    groups = [k for k in range(2, size) if size % k == 0]
    for k in groups:
        for rule in RULES:
            for dtype_name in ("float32", "bfloat16"):
                check_parity(rule, dtype_name, k)
    check_bad_values()
    k = groups[-1]
    for rule in RULES:
        opt = make(rule, "bfloat16", k)
        train(opt, range(1, STEPS + 1))
        opt.save(directory / rule)
        opt.save_consolidated(directory / f"{rule}.safetensors")
        check_load(rule, directory, None)
    if rank == 0:
        print(f"OK hierarchical sharding on {size} ranks: K = {groups}, rules "
              f"{', '.join(RULES)}, fp32 and bf16")


def check_load(rule, directory: Path, k):
    """Load ``rule``'s checkpoint under shard_group_size=k; its export must be the saved one."""
    opt = make(rule, "bfloat16", k)
    opt.load(directory / rule)
    mine = directory / f"{rule}-loaded-{size}-{k}.safetensors"
    opt.save_consolidated(mine)
    if rank == 0:
        same = mine.read_bytes() == (directory / f"{rule}.safetensors").read_bytes()
        check(same, f"{rule}: the state loaded on {size} ranks with K={k} differs from the saved")
    comm.Barrier()


def load(directory: Path):
    for k in [None] + ([2] if size % 2 == 0 and size > 2 else []):
        for rule in RULES:
            check_load(rule, directory, k)
    if rank == 0:
        print(f"OK hierarchical checkpoints loaded on {size} ranks")


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
