"""Training-loop features stay exact under sharding: N ranks == one process.

Param groups with their own lr / weight decay, a learning rate changed every step, global
gradient-norm clipping, the reported gradient norm, a fixed loss scale and gradient
accumulation, for every param dtype, against the float64 reference. Run on any number of ranks.
"""

import numpy as np
from mpi4py import MPI

from reference import ReferenceAdam, close_to_reference
from zero1_mpi import LossScaler, ZeroAdam, ZeroAdamW, decay_groups
from zero1_mpi.backend import resolve_dtype

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w1": (7, 5), "b1": (5,), "scale": (), "w2": (5, 3), "b2": (3,), "big": (400,)}
STEPS = 20


def init_values():
    return {k: np.random.default_rng([11, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def grads_of(r, step, dtype, micro=0, scale=1.0):
    rng = np.random.default_rng([5, step, r, micro])
    # Large enough that clipping at max_grad_norm=1 is active in most steps.
    return {k: (rng.standard_normal(s).astype(np.float32) * scale).astype(dtype)
            for k, s in SHAPES.items()}


def run(name, dtype_name, cls, *, max_grad_norm=None, loss_scale=None, micro_batches=1,
        schedule=False):
    dtype = resolve_dtype(dtype_name)
    decoupled = cls is ZeroAdamW
    groups = decay_groups(init_values(), weight_decay=0.1)  # matrices decay, vectors don't
    groups[1]["lr"] = 3e-2                                   # and have their own lr
    opt = cls(groups, comm, lr=1e-2, param_dtype=dtype_name, max_grad_norm=max_grad_norm,
              loss_scale=loss_scale)
    ref = ReferenceAdam(init_values(), lr=1e-2, decoupled=decoupled, max_grad_norm=max_grad_norm,
                        groups=[{"names": list(g["params"]), "weight_decay": g["weight_decay"],
                                 "lr": g.get("lr", 1e-2)} for g in groups])
    for step in range(1, STEPS + 1):
        scale = opt.loss_scale
        if schedule:  # any schedule: here a warm-up then a decay, set between steps
            for g_opt, g_ref, base in zip(opt.param_groups, ref.groups, (1e-2, 3e-2)):
                g_opt["lr"] = g_ref["lr"] = base * min(step / 5, 1.0) * (1 - step / 40)
        for micro in range(micro_batches):  # accumulate the mean of the micro-batches
            for k, g in grads_of(rank, step, dtype, micro, scale).items():
                opt.grads[k][...] += (np.asarray(g, np.float32) / micro_batches).astype(dtype)
        info = opt.step()
        want_norm = ref.step(accumulated(step, dtype, micro_batches, scale))
        where = f"{name}/{dtype_name}/{cls.__name__} step {step} on rank {rank} of {size}"
        if info.skipped or info.step != step or info.loss_scale != scale:
            raise AssertionError(f"{where}: unexpected {info}")
        if abs(info.grad_norm - want_norm) > 1e-5 * want_norm:
            raise AssertionError(f"{where}: grad_norm {info.grad_norm} != {want_norm}")
        if max_grad_norm is not None:
            want_coef = min(1.0, max_grad_norm / (want_norm + 1e-6))
            if abs(info.clip_coef - want_coef) > 1e-5 * want_coef:
                raise AssertionError(f"{where}: clip_coef {info.clip_coef} != {want_coef}")
        for k in SHAPES:
            ok, err = close_to_reference(opt.params[k], ref.params[k], dtype)
            if not ok:
                raise AssertionError(f"{where}: {k!r} off by {err}")
        if any(np.any(g != 0) for g in opt.grads.values()):
            raise AssertionError(f"{where}: step() left gradients behind")
    return opt


def accumulated(step, dtype, micro_batches, scale):
    """What the reference sees: exactly what each rank accumulated, unscaled and averaged."""
    total = {k: np.zeros(s) for k, s in SHAPES.items()}
    for r in range(size):
        acc = {k: np.zeros(s, dtype) for k, s in SHAPES.items()}
        for micro in range(micro_batches):
            for k, g in grads_of(r, step, dtype, micro, scale).items():
                acc[k] += (np.asarray(g, np.float32) / micro_batches).astype(dtype)
        for k in SHAPES:
            total[k] += np.asarray(acc[k], np.float64) / scale
    return {k: v / size for k, v in total.items()}


def main():
    cases = 0
    for dtype_name in ("float32", "float16", "bfloat16"):
        for cls in (ZeroAdam, ZeroAdamW):
            run("groups+clip+schedule", dtype_name, cls, max_grad_norm=1.0, schedule=True)
            cases += 1
        run("no clipping needed", dtype_name, ZeroAdamW, max_grad_norm=1e6)
        run("accumulation", dtype_name, ZeroAdamW, micro_batches=3)
        cases += 2
    # A fixed loss scale: gradients arrive multiplied by it and are unscaled in the kernel.
    run("fixed loss scale", "float16", ZeroAdamW, loss_scale=1024.0, max_grad_norm=1.0)
    grows = LossScaler.dynamic_scaler(init_scale=256.0, growth_interval=5)
    opt = run("dynamic loss scale, growing", "float16", ZeroAdam, loss_scale=grows)
    if opt.loss_scale != 256.0 * 2 ** (STEPS // 5):
        raise AssertionError(f"the loss scale did not grow: {opt.loss_scale}")
    cases += 2
    if rank == 0:
        print(f"OK training: {cases} cases x {STEPS} steps on {size} ranks")


if __name__ == "__main__":
    main()
