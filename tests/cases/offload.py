"""offload='cpu' == the optimizer without it: every built-in rule (the registry's), every dtype,
param groups, clipping and a loss scale, compared after every step (bitwise on NumPy
parameters: the same host kernel runs either way; on CuPy ones, within the kernels' rounding).
Checkpoints and consolidated exports load across offloaded and non-offloaded optimizers and
train on bitwise; the memory report splits device and host bytes by their formulas.

    mpiexec -n N python -m mpi4py tests/cases/offload.py DIR [numpy|cupy] [SHARD_GROUP_SIZE]
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from zero1_mpi import ZeroAdam, ZeroAdamW, ZeroLAMB, ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype, to_numpy, xp_for
from zero1_mpi.rules import registry

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
DIRECTORY = Path(sys.argv[1])
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "numpy"
GROUP = int(sys.argv[3]) if len(sys.argv) > 3 else None
xp = xp_for(BACKEND)
SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (700,), "wide": (3, 333)}
STEPS = 5
CONFIGS = [  # name, optimizer, options: every rule of the registry, each kernel variant
    ("adamw", ZeroAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    ("adam", ZeroAdam, {"lr": 1e-2, "weight_decay": 0.01}),
    ("sgd", ZeroSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd-plain", ZeroSGD, {"lr": 0.05}),
    ("lion", ZeroLion, {"lr": 1e-3, "weight_decay": 0.1}),
    ("lamb", ZeroLAMB, {"lr": 1e-2, "weight_decay": 0.01}),
]


def make(optimizer, options, dtype, offload, groups=True):
    params = {k: xp.asarray(np.random.default_rng([5, len(k)]).standard_normal(s)
                            .astype(np.float32)) for k, s in SHAPES.items()}
    if groups:  # vectors in a second group with their own options
        flat = [k for k in SHAPES if len(SHAPES[k]) < 2]
        params = [{"params": {k: v for k, v in params.items() if k not in flat}},
                  {"params": {k: params[k] for k in flat}, "lr": options["lr"] / 2}]
    return optimizer(params, comm, param_dtype=dtype, bucket_elements=500, max_grad_norm=5.0,
                     loss_scale=8.0, shard_group_size=GROUP, offload=offload,
                     offload_threads=2 if offload else None, **options)


def train(opt, steps, dtype):
    for step in steps:
        rng = np.random.default_rng([13, step, rank])
        for k, s in SHAPES.items():
            g = rng.standard_normal(s).astype(np.float32) * 2.0 ** rank * opt.loss_scale
            opt.grads[k][...] = xp.asarray(g.astype(resolve_dtype(dtype)))
        opt.step()


def state_of(opt) -> list:
    rows = []
    for lo, hi, state in opt.layout.owned(opt.shard_rank):
        views = opt.shard_state(lo, hi, state)
        rows += [to_numpy(views[row]).reshape(-1).copy() for row in opt.state_rows]
    return rows + [to_numpy(opt.params[k]).reshape(-1).copy() for k in SHAPES]


def same(a, b, dtype, what):
    if BACKEND == "numpy":
        check(all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b)),
              f"{what}: offloaded and not offloaded differ on rank {rank} of {size}")
    else:  # the CuPy kernel and the host kernel may round differently (contractions)
        for x, y in zip(a, b):
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            tol = 1e-5 if x.dtype == np.float32 else 2.0 ** -7
            check(np.allclose(x64, y64, rtol=tol, atol=tol * 1e-2),
                  f"{what}: off by {np.max(np.abs(x64 - y64))} on rank {rank} of {size}")


def check_parity(name, optimizer, options, dtype):
    plain, off = make(optimizer, options, dtype, None), make(optimizer, options, dtype, "cpu")
    check(off.offload == "cpu" and plain.offload is None, "offload attribute")
    for step in range(1, STEPS + 1):
        train(plain, [step], dtype)
        train(off, [step], dtype)
        same(state_of(plain), state_of(off), dtype, f"{name} {dtype} step {step}")
    return plain, off


def check_memory(plain, off, dtype):
    ours, theirs = off.memory_report(), plain.memory_report()
    check(ours.offloaded and not theirs.offloaded, "offloaded flag")
    check(ours.device_bytes + ours.host_bytes == ours.total, "device + host != total")
    check(ours.parameters + ours.gradients == ours.device_formula_bytes,
          f"device {ours.parameters + ours.gradients} != {ours.device_formula_bytes}")
    group = comm.Split(rank // off.shard_group_size, rank)
    held = group.allreduce(ours.optimizer_state)
    check(held == ours.bytes_per_param * ours.psi,
          f"the group's host state {held} != K Psi = {ours.bytes_per_param} * {ours.psi}")
    check(abs(ours.host_formula_bytes - held / off.shard_group_size) < 1e-6 * held + 1,
          "host formula is not K Psi / N")
    extra = 4 * ours.psi if dtype == "float32" else 0  # fp32 offload keeps its own master
    check(group.allreduce(ours.optimizer_state - theirs.optimizer_state) == extra,
          "offloading changed the sharded state's size")
    check(theirs.host_bytes == 0 and theirs.device_bytes == theirs.total, "non-offloaded split")
    group.Free()


def check_loads_across(name, optimizer, options, dtype):
    """Save on one side, load on the other, train on: the same bits as not stopping."""
    for saver, loader in (("cpu", None), (None, "cpu")):
        first = make(optimizer, options, dtype, saver, groups=False)
        train(first, range(1, 4), dtype)
        where = DIRECTORY / f"{name}-{dtype}-{saver}"
        first.save(where)
        if name == "adamw":
            first.save_consolidated(DIRECTORY / f"{name}-{dtype}-{saver}.safetensors")
        train(first, range(4, 7), dtype)
        second = make(optimizer, options, dtype, loader, groups=False)
        second.load(where)
        train(second, range(4, 7), dtype)
        same(state_of(first), state_of(second), dtype,
             f"{name} {dtype}: saved with offload={saver!r}, loaded with {loader!r}")
        if name == "adamw":
            third = make(optimizer, options, dtype, loader, groups=False)
            third.load_consolidated(DIRECTORY / f"{name}-{dtype}-{saver}.safetensors")
            train(third, range(4, 7), dtype)
            same(state_of(first), state_of(third), dtype,
                 f"{name} {dtype}: exported with offload={saver!r}, loaded with {loader!r}")


def main():
    if BACKEND == "cupy":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        xp.cuda.Device(local % xp.cuda.runtime.getDeviceCount()).use()
    covered = {opt.__name__ for _, opt, _ in CONFIGS}
    missing = [n for n in registry.NAMES if registry.get(n).optimizer.__name__ not in covered]
    check(not missing, f"tests/cases/offload.py has no config for the rules {missing}")
    cases = 0
    for name, optimizer, options in CONFIGS:
        for dtype in ("float32", "float16", "bfloat16"):
            plain, off = check_parity(name, optimizer, options, dtype)
            check_memory(plain, off, dtype)
            if dtype != "float16":
                check_loads_across(name, optimizer, options, dtype)
            cases += 1
    if rank == 0:
        print(f"OK offload: {cases} cases x {STEPS} steps on {size} ranks, shard groups of "
              f"{plain.shard_group_size} ({BACKEND}, host kernel {off.kernel}, "
              f"{off.offload_threads} threads)")


if __name__ == "__main__":
    main()
