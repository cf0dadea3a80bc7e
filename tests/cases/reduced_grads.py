"""``opt.reduced_grads()`` on N ranks: the step's gradients as the update takes them, the same
on every rank, against a float64 oracle computed here (every rank's own gradients, gathered
with mpi4py and averaged, clipped by the global norm), in the layouts that change where a shard
lives: one and several buckets, stage 1 and 2, shard groups of 2, fp16 with a loss scale and
the 8-bit wire; then the step that follows uses the same clip (its ``clip_coef``).
"""

import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroSGD

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (37, 5), "b": (5,), "v": (300,)}
CASES = [
    {},
    {"bucket_elements": 64},
    {"shard_gradients": True, "bucket_elements": 128},
    {"shard_group_size": 2},
    {"param_dtype": "float16", "loss_scale": 8.0},
    {"reduce_dtype": "int8", "bucket_elements": 256},
]


def check(cond, message):
    if not cond:
        raise AssertionError(f"rank {rank}: {message}")


def own_grads(seed):
    g = np.random.default_rng(100 * seed + rank)
    return {n: (g.standard_normal(s) * (1 + rank)).astype(np.float32) for n, s in SHAPES.items()}


def run(case, index):
    options = {"max_grad_norm": 1.0, **case}
    params = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    opt = ZeroSGD(params, lr=1.0, **options)
    own = own_grads(index)
    for name, grad in own.items():
        if opt.shard_gradients:
            opt.add_grad(name, grad * opt.loss_scale)
        else:
            opt.grads[name][...] = grad * opt.loss_scale
    gathered = comm.allgather({n: g.astype(np.float64) for n, g in own.items()})
    mean = {n: sum(g[n] for g in gathered) / size for n in SHAPES}
    norm = np.sqrt(sum(float((g * g).sum()) for g in mean.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))
    check(clip < 0.5, f"{case}: the oracle must clip, or clipping is not tested")
    got = opt.reduced_grads()
    check(sorted(got) == sorted(SHAPES), f"{case}: names {sorted(got)}")
    tolerance = 2e-2 if "int8" in str(case) or "float16" in str(case) else 1e-6
    for name, g in got.items():
        check(g.dtype == np.float32 and g.shape == SHAPES[name], f"{case}: {name} {g.shape}")
        error = float(np.abs(g - clip * mean[name]).max() / np.abs(clip * mean[name]).max())
        check(error <= tolerance, f"{case}: {name} is {error} from the clipped mean")
        others = comm.allgather(g)
        check(all(np.array_equal(o, g) for o in others), f"{case}: {name} differs by rank")
    info = opt.step()
    check(abs(info.clip_coef - clip) <= 1e-3 * clip, f"{case}: clip_coef {info.clip_coef}")
    opt.close()


def main():
    for index, case in enumerate(CASES):
        if case.get("shard_group_size", 1) <= size and size % case.get("shard_group_size", 1) == 0:
            run(case, index)
    if rank == 0:
        print(f"OK reduced_grads on {size} ranks: {len(CASES)} layouts")


main()
