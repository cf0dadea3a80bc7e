"""Hierarchical sharding (``shard_group_size=K``): the state sharded over groups of K
consecutive ranks and replicated across the N / K groups.

    mpiexec -n N python -m mpi4py tests/cases/hierarchical.py save DIR K [--rule NAME ...]
    mpiexec -n M python -m mpi4py tests/cases/hierarchical.py load DIR [--rule NAME ...]

``save``: every rule of the registry (each variant) in fp32 and bf16: N ranks against one
process running the rule on the averaged gradients (its float64 reference, the parity bound)
and against flat sharding (K = N), with tensors that straddle shards and buckets, the
reductions started from ``grads_ready`` in backward's order, clipping and a loss scale; each
rank holds the rule's state for 1/K of the parameters (``memory_report``); the groups' and the
replicas' communicators keep the explicit settings of the optimizer's ``Communicator``
(``persistent``, ``cuda_aware``, ``device_started``, ``stage_host``); bad values (K not
dividing N, K = 1, K differing between ranks) raise on every rank. Then, per rule, a checkpoint
and a consolidated export saved under K load under flat sharding on the same ranks (the export
of the loaded state is byte for byte the saved one). ``load`` (another world size, flat and,
where it divides M, K = 2) loads every saved checkpoint and checks the same.
"""

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np

import casekit as kit
from casekit import check, rank, size, world
from zero1_mpi import CollectiveError, Communicator, ZeroAdamW
from zero1_mpi.kernels.backend import resolve_dtype

SHAPES = {"scalar": (), "w": (17, 9), "empty": (0, 4), "v": (5,), "long": (700,)}
STEPS = 6


RULES = sys.argv[sys.argv.index("--rule") + 1:] if "--rule" in sys.argv else None


def cases():
    return [(f"{name}-{index}", variant, options)
            for name, entry in kit.registry(RULES).items()
            for index, (variant, options) in enumerate(kit.variant_cases(entry))]


def make(variant, options, dtype_name, k):
    return kit.build(variant, kit.init_values(SHAPES), world, options, param_dtype=dtype_name,
                     bucket_elements=1, max_grad_norm=20.0, loss_scale=4.0,
                     shard_group_size=k)


def grads_of(r, step):
    return kit.grads_of(r, step, SHAPES, seed=11, scale=1.0 + r)


def train(opt, steps):
    """Each tensor's gradient declared ready as it is written, last first (as a backward pass
    would): reductions, and the sums across the groups, start before ``step()``."""
    dtype = resolve_dtype(opt.param_dtype.name)
    for step in steps:
        for k, g in reversed(grads_of(rank, step).items()):
            opt.grads[k][...] = (g * opt.loss_scale).astype(dtype)
            opt.grads_ready(k)
        opt.step()


def check_parity(variant, options, dtype_name, k):
    dtype = resolve_dtype(dtype_name)
    opt, flat = make(variant, options, dtype_name, k), make(variant, options, dtype_name, None)
    ref = kit.oracle(variant, options, kit.init_values(SHAPES), max_grad_norm=20.0)
    if isinstance(ref, kit.EngineOracle):
        ref = None  # a rule without a float64 reference: held to flat sharding only
    check((opt.shard_group_size, opt.shard_rank, opt.replicas) == (k, rank % k, size // k),
          f"K={k}: shard_group_size/shard_rank/replicas")
    where = f"{variant.settings()} {dtype_name} K={k}"
    for step in range(1, STEPS + 1):
        train(opt, [step])
        train(flat, [step])
        if ref is not None:
            ref.step({n: np.mean([grads_of(r, step)[n].astype(dtype).astype(np.float64)
                                  for r in range(size)], axis=0) for n in SHAPES})
            kit.close_to(opt.params, ref.params, dtype, f"{where} step {step}")
            kit.close_to(flat.params, ref.params, dtype, f"{where} (flat) step {step}")
        else:
            for n in SHAPES:
                kit.near(opt.params[n], flat.params[n], not variant.tensor_sums,
                         f"{where} step {step}: {n!r} against flat sharding")
    report = opt.memory_report()
    owned = opt.layout.owned_real(opt.shard_rank)
    check(report.state == {s: 4 * owned for s in opt.rule.state_names},
          f"{where}: state bytes {report.state}")
    total = world.allreduce(sum(report.state.values()))
    check(total == (size // k) * 4 * len(opt.rule.state_names) * opt.layout.numel,
          f"{where}: the ranks hold {total} bytes of state, not N/K replicas of it")


def check_sub_communicators_keep_the_settings(k):
    """The groups' and the replicas' communicators (``Communicator.split``) keep the explicit
    settings of the one the optimizer was given, each the opposite of its default here."""
    default = Communicator(world)
    settings = {"persistent": not default.persistent, "cuda_aware": not default.cuda_aware,
                "device_started": not default.device_started, "stage_host": True}
    default.free()
    given = Communicator(world, **settings)
    opt = ZeroAdamW(kit.init_values(SHAPES), given, shard_group_size=k)
    for which in ("shard_comm", "replica_comm"):
        sub = getattr(opt, which)
        got = {name: getattr(sub, name) for name in settings}
        check(got == settings, f"K={k}: opt.{which} has {got}, its parent {settings}")
    opt.close()
    given.free()


def check_the_ledger_counts_every_communicator(k):
    """With the host's buffers staged (``stage_host``) every communicator holds staging
    buffers, the groups' and the replicas' too: what the optimizer holds after a step, measured
    with tracemalloc, is ``memory_report().total`` (within the Python objects around the
    arrays), and its ``comm_scratch`` is the difference from the arrays it names."""
    given = Communicator(world, stage_host=True)
    init = {"w": np.ones((300, 1000), np.float32), "b": np.ones(1000, np.float32)}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    opt = ZeroAdamW(init, given, shard_group_size=k, param_dtype="bfloat16")
    for g in opt.grads.values():
        g[...] = 1e-3
    opt.step()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    report = opt.memory_report()
    check(abs(held - report.total) <= 64 * 1024,
          f"K={k}, staged: the optimizer holds {held} bytes, memory_report().total is "
          f"{report.total} (comm_scratch {report.comm_scratch})")
    opt.close()
    given.free()


def expect_error(kind, words, **kwargs):
    kit.raises(kind, words, lambda: ZeroAdamW(kit.init_values(SHAPES), world,
                                              bucket_elements=1, **kwargs))


def check_bad_values():
    expect_error(ValueError, [f"shard_group_size={size + 1}", f"the {size} ranks"],
                 shard_group_size=size + 1)
    expect_error(ValueError, ["shard_group_size=1", "use 2 or more"], shard_group_size=1)
    expect_error(ValueError, ["shard_group_size='two'"], shard_group_size="two")
    expect_error(CollectiveError, ["shard_group_size", "every rank"],
                 shard_group_size=2 if rank == 0 else None)


def save(directory: Path, k: int):
    for label, variant, options in cases():
        for dtype_name in ("float32", "bfloat16"):
            check_parity(variant, options, dtype_name, k)
    check_sub_communicators_keep_the_settings(k)
    check_the_ledger_counts_every_communicator(k)
    check_bad_values()
    for label, variant, options in cases():
        opt = make(variant, options, "bfloat16", k)
        train(opt, range(1, STEPS + 1))
        opt.save(directory / label)
        opt.save_consolidated(directory / f"{label}.safetensors")
        check_load(label, variant, options, directory, None)
    if rank == 0:
        print(f"OK hierarchical sharding on {size} ranks: K = {k}, rules "
              f"{', '.join(kit.registry(RULES))}, fp32 and bf16")


def check_load(label, variant, options, directory: Path, k):
    """Load ``label``'s checkpoint under shard_group_size=k; its export must be the saved one."""
    opt = make(variant, options, "bfloat16", k)
    opt.load(directory / label)
    mine = directory / f"{label}-loaded-{size}-{k}.safetensors"
    opt.save_consolidated(mine)
    if rank == 0:
        same = mine.read_bytes() == (directory / f"{label}.safetensors").read_bytes()
        check(same, f"{label}: the state loaded on {size} ranks with K={k} differs from the saved")
    world.Barrier()


def load(directory: Path):
    for k in [None] + ([2] if size % 2 == 0 and size > 2 else []):
        for label, variant, options in cases():
            check_load(label, variant, options, directory, k)
    if rank == 0:
        print(f"OK hierarchical checkpoints loaded on {size} ranks")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        load(Path(sys.argv[2]))
