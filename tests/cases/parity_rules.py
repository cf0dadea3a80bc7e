"""N ranks == one process, for the rules beside Adam: ZeroSGD against a float64
torch.optim.SGD, ZeroLion against a float64 Lion, on averaged gradients, for awkward shapes,
every dtype, each rule's options, param groups, clipping and a fixed loss scale. Also: a
checkpoint saved here loads and trains on bitwise, and an Adam checkpoint is refused. Run on
any number of ranks; ``cupy`` puts the parameters on the GPU (picked by node-local rank).

    mpiexec -n N python -m mpi4py tests/cases/parity_rules.py sgd|lion|lamb DIR [cupy]
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from reference import ReferenceLAMB, ReferenceLion, ReferenceSGD, close_to_reference
from zero1_mpi import CheckpointError, ZeroAdam, ZeroLAMB, ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype, to_numpy, xp_for

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS = 12
SHAPES = {"scalar": (), "empty": (0, 3), "one": (1,), "vec": (7,), "mat": (5, 13),
          "long": (700,)}
RULES = {  # optimizer, reference, option sets, learning rate
    "sgd": (ZeroSGD, ReferenceSGD, [{"momentum": 0.0, "weight_decay": 0.0},
                                    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
                                    {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05}],
            0.05),
    "lion": (ZeroLion, ReferenceLion, [{"weight_decay": 0.0},
                                       {"betas": (0.8, 0.95), "weight_decay": 0.1}], 1e-3),
    "lamb": (ZeroLAMB, ReferenceLAMB, [{"weight_decay": 0.0},
                                       {"betas": (0.8, 0.95), "eps": 1e-4, "weight_decay": 0.1}],
             1e-2),
}
RULE = sys.argv[1]
BACKEND = sys.argv[3] if len(sys.argv) > 3 else "numpy"
xp = xp_for(BACKEND)
OPTIMIZER, REFERENCE, OPTIONS, LR = RULES[RULE]


def init_of(r):
    return {k: xp.asarray(np.random.default_rng([5, r, len(k)]).standard_normal(s)
                          .astype(np.float32)) for k, s in SHAPES.items()}


def grads_of(r, step, dtype):
    rng = np.random.default_rng([13, step, r])
    return {k: (rng.standard_normal(s).astype(np.float32) * 2.0 ** r).astype(dtype)
            for k, s in SHAPES.items()}


def make(dtype_name, options, groups):
    params = init_of(rank)
    if groups:  # the vectors and scalars in a second group, without weight decay
        flat = [k for k in SHAPES if len(SHAPES[k]) < 2]
        params = [{"params": {k: v for k, v in params.items() if k not in flat}},
                  {"params": {k: params[k] for k in flat}, "weight_decay": 0.0, "lr": LR / 2}]
    return OPTIMIZER(params, comm, lr=LR, param_dtype=dtype_name, bucket_elements=1,
                     max_grad_norm=5.0, loss_scale=8.0, **options)


def reference(options, groups):
    ref_groups = None
    if groups:
        flat = [k for k in SHAPES if len(SHAPES[k]) < 2]
        ref_groups = [{"names": [k for k in SHAPES if k not in flat]},
                      {"names": flat, "weight_decay": 0.0, "lr": LR / 2}]
    init = {k: to_numpy(v) for k, v in init_of(0).items()}
    return REFERENCE(init, lr=LR, groups=ref_groups, max_grad_norm=5.0, **options)


def train(opt, steps, dtype):
    for step in steps:
        for k, g in grads_of(rank, step, dtype).items():
            opt.grads[k][...] = xp.asarray((g.astype(np.float32) * opt.loss_scale)
                                           .astype(dtype))
        opt.step()


def check_case(dtype_name, options, groups):
    dtype = resolve_dtype(dtype_name)
    opt, ref = make(dtype_name, options, groups), reference(options, groups)
    for step in range(1, STEPS + 1):
        train(opt, [step], dtype)
        every = [grads_of(r, step, dtype) for r in range(size)]
        ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
                  for k in SHAPES})
        for k in SHAPES:
            ok, err = close_to_reference(to_numpy(opt.params[k]), ref.params[k], dtype)
            check(ok, f"{RULE} {dtype_name}/{options}/groups={groups}: step {step}, {k!r} off by "
                      f"{err} on rank {rank} of {size}")
    return opt.kernel


def check_checkpoints(directory: Path):
    options = OPTIONS[1]
    opt = make("bfloat16", options, False)
    train(opt, range(1, 5), resolve_dtype("bfloat16"))
    opt.save(directory / RULE)
    train(opt, range(5, 9), resolve_dtype("bfloat16"))
    other = make("bfloat16", options, False)
    other.load(directory / RULE)
    train(other, range(5, 9), resolve_dtype("bfloat16"))
    for k in SHAPES:
        check(np.array_equal(to_numpy(other.params[k]).view(np.uint16),
                             to_numpy(opt.params[k]).view(np.uint16)),
              f"{k!r}: training on after a load differs from the uninterrupted run")
    adam = ZeroAdam(init_of(rank), comm, param_dtype="bfloat16", bucket_elements=1)
    adam.save(directory / "adam")
    try:
        other.load(directory / "adam")
    except CheckpointError as exc:
        check("'adam' rule" in str(exc) and f"'{RULE}'" in str(exc), str(exc))
    else:
        raise AssertionError(f"an Adam checkpoint loaded into the {RULE} optimizer")


def main(directory: Path):
    if BACKEND == "cupy":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        xp.cuda.Device(local % xp.cuda.runtime.getDeviceCount()).use()
    cases, kernels = 0, set()
    for dtype_name in ("float32", "float16", "bfloat16"):
        for options in OPTIONS:
            for groups in (False, True):
                kernels.add(check_case(dtype_name, options, groups))
                cases += 1
    check_checkpoints(directory)
    if rank == 0:
        print(f"OK {RULE} parity: {cases} cases x {STEPS} steps on {size} ranks "
              f"({BACKEND}, kernel {'+'.join(sorted(kernels))})")


if __name__ == "__main__":
    main(Path(sys.argv[2]))
