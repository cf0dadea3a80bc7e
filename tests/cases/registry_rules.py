"""Every rule of the registry (``zero1_mpi.rules.registry``), each variant, on the engine: N ranks
against one process (rank 0 alone, ``COMM_SELF``) fed the averaged gradients, in fp32 and bf16,
with clipping and tensors straddling shards and buckets; then a checkpoint saved on N ranks loads
on one and holds the same state. Gradients are multiples of 1/64 small enough that every sum
over ranks is exact (N a power of two), so only a two-phase rule's norms (summed in another
order) may differ.

    mpiexec -n N python -m mpi4py tests/cases/registry_rules.py DIR [RULE]
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from reference import max_ulp_diff
from zero1_mpi import ShardedOptimizer
from zero1_mpi.rules.registry import builtin_rules

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (9, 13), "b": (13,), "s": (), "v": (70,)}
STEPS = 4


def init():
    return {k: (np.random.default_rng([5, len(k)]).integers(-64, 64, s) / 64).astype(np.float32)
            for k, s in SHAPES.items()}


def grads(r, step):  # sums of 4 stay exact in bf16
    rng = np.random.default_rng([11, step, r])
    return {k: (rng.integers(-16, 16, s) / 64).astype(np.float32) for k, s in SHAPES.items()}


def build(rule, options, dtype_name, on):
    return ShardedOptimizer(init(), on, rule, options, param_dtype=dtype_name,
                            max_grad_norm=4.0, bucket_elements=64)


def close(a, b, two_phase: bool, what: str) -> None:
    """Bitwise for an elementwise rule; within float32 rounding for a two-phase one."""
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    if not two_phase:
        check(np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: differs")
    elif a.dtype == np.float32:
        err = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3), initial=0))
        check(err <= 1e-5, f"{what}: off by {err}")
    else:
        check(max_ulp_diff(a, b) <= 1, f"{what}: {max_ulp_diff(a, b)} ulps off")


def run(name, entry, index, rule, dtype_name, directory):
    options = rule.check_options(**entry.defaults)
    many = build(rule, options, dtype_name, comm)
    alone = build(rule, options, dtype_name, MPI.COMM_SELF) if rank == 0 else None
    for step in range(1, STEPS + 1):
        for k, g in grads(rank, step).items():
            many.grads[k][...] = g
        many.step()
        if alone is not None:
            every = [grads(r, step) for r in range(size)]
            for k in SHAPES:
                alone.grads[k][...] = np.mean([e[k] for e in every], axis=0)
            alone.step()
    label = f"{name} {rule.settings()} {dtype_name}"
    saved = many.save(directory / f"{name}-{index}-{dtype_name}")
    if alone is None:
        return
    two_phase = bool(rule.tensor_sums)
    for k in SHAPES:
        close(many.params[k], alone.params[k], two_phase, f"{label} {k!r}")
    loaded = build(rule, options, dtype_name, MPI.COMM_SELF)
    loaded.load(saved)  # the N ranks' checkpoint on one: the one process's state
    check(loaded.step_count == STEPS, f"{label}: step {loaded.step_count} after loading")
    for lo, hi, st in loaded.layout.owned(0):
        ours, theirs = loaded.shard_state(lo, hi, st), alone.shard_state(lo, hi, st)
        for row in loaded.state_rows:
            close(ours[row], theirs[row], two_phase, f"{label} loaded {row!r}")
    for k in SHAPES:
        close(loaded.params[k], many.params[k], False, f"{label} {k!r} after loading")


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    only = sys.argv[2] if len(sys.argv) > 2 else None
    names = []
    for name, entry in builtin_rules().items():
        if only and name != only:
            continue
        for index, rule in enumerate(entry.variants):
            for dtype_name in ("float32", "bfloat16"):
                run(name, entry, index, rule, dtype_name, directory)
        names.append(name)
    comm.Barrier()
    if rank == 0:
        print(f"OK registry rules on {size} ranks: {', '.join(names)}")
