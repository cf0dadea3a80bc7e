"""What checkpoints and exports hold, checked against what it must be, not against itself.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint_content.py DIR

- The consolidated export's master weights, exp_avg and exp_avg_sq equal the float64
  reference's parameters and moments (fp32 and bf16 parameters), read back with safetensors.
- Dynamic loss scaling after an overflow (a skipped step, the scale backed off and grown again)
  and param-group options changed between steps (lr, betas, eps, weight_decay) survive
  ``save``/``load`` and ``save_consolidated``/``load_consolidated`` into an optimizer built
  with other options: the loaded scaler state, options and step equal the saved ones, and
  training on gives, bit for bit, the run that was never interrupted.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI
from safetensors.numpy import load_file

from expect import check
from reference import ReferenceAdam, max_rel_err
from zero1_mpi import LossScaler, ZeroAdam, ZeroAdamW
from zero1_mpi.backend import resolve_dtype

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (33, 7), "b": (7,), "long": (1500,)}
STEPS = 8


def init_values():
    return {k: np.random.default_rng([4, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def grads_of(r, step, dtype):
    rng = np.random.default_rng([step, r, 77])
    return {k: rng.standard_normal(s).astype(np.float32).astype(dtype) for k, s in SHAPES.items()}


def export_matches_the_reference(directory: Path):
    for dtype_name in ("float32", "bfloat16"):
        dtype = resolve_dtype(dtype_name)
        opt = ZeroAdamW(init_values(), comm, lr=1e-2, weight_decay=0.1, param_dtype=dtype_name,
                        bucket_elements=400)
        ref = ReferenceAdam(init_values(), lr=1e-2, weight_decay=0.1, decoupled=True)
        for step in range(1, STEPS + 1):
            for k, g in grads_of(rank, step, dtype).items():
                opt.grads[k][...] = g
            opt.step()
            every = [grads_of(r, step, dtype) for r in range(size)]
            ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
                      for k in SHAPES})
        file = directory / f"moments-{dtype_name}.safetensors"
        opt.save_consolidated(file)
        if rank == 0:
            saved = load_file(str(file))
            for k in SHAPES:
                for kind, want, bound in (("master", ref.params[k], 1e-5),
                                          ("exp_avg", ref.m[k], 1e-5),
                                          ("exp_avg_sq", ref.v[k], 1e-5)):
                    got = saved[f"{kind}/{k}"]
                    check(got.dtype == np.float32 and got.shape == SHAPES[k], (kind, k))
                    err = max_rel_err(got, want)
                    check(err <= bound, f"{dtype_name} {kind}/{k}: off the reference by {err}")


def make(options: dict):
    return ZeroAdam(init_values(), comm, param_dtype="float16", bucket_elements=400,
                    loss_scale=LossScaler.dynamic_scaler(init_scale=2.0 ** 12, growth_interval=3),
                    **options)


def train(opt, steps):
    for step in steps:
        for k, g in grads_of(rank, step, np.float16).items():
            opt.grads[k][...] = g * np.float16(opt.loss_scale / 64)
        if step == 3 and rank == size - 1:
            opt.grads["w"][0, 0] = np.inf  # every rank skips this step and backs off
        opt.step()


def export_bytes(opt, file: Path) -> bytes:
    opt.save_consolidated(file)
    return comm.bcast(file.read_bytes() if rank == 0 else None)


def state_survives_a_reload(directory: Path):
    opt = make({"lr": 1e-2})
    train(opt, range(1, 6))
    group = opt.param_groups[0]
    group.update(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02)
    train(opt, range(6, 8))
    check(opt.step_count == 6, f"one of 7 steps must have been skipped: {opt.step_count}")
    saved = (opt.step_count, opt.scaler.state(), dict(group))
    check(saved[1] != make({}).scaler.state(), "the scaler never changed: nothing is tested")
    opt.save(directory / "root")
    opt.save_consolidated(directory / "consolidated.safetensors")
    train(opt, range(8, 12))
    uninterrupted = export_bytes(opt, directory / "uninterrupted.safetensors")

    for how in ("save/load", "save_consolidated/load_consolidated"):
        other = make({"lr": 0.5, "betas": (0.5, 0.5), "eps": 0.1, "weight_decay": 0.3})
        if how == "save/load":
            other.load(directory / "root")
        else:
            other.load_consolidated(directory / "consolidated.safetensors")
        loaded = (other.step_count, other.scaler.state(), dict(other.param_groups[0]))
        for what, a, b in zip(("step", "loss scaler", "options"), loaded, saved):
            if what == "options":
                a = {k: a[k] for k in ("lr", "betas", "eps", "weight_decay")}
                b = {k: b[k] for k in ("lr", "betas", "eps", "weight_decay")}
            check(a == b, f"{how}: {what} {a!r} after loading, {b!r} saved")
        train(other, range(8, 12))
        check(export_bytes(other, directory / "resumed.safetensors") == uninterrupted,
              f"{how}: training on differs from the uninterrupted run")


if __name__ == "__main__":
    where = Path(sys.argv[1])
    export_matches_the_reference(where)
    state_survives_a_reload(where)
    if rank == 0:
        print(f"OK checkpoint content on {size} ranks")
