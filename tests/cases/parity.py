"""N ranks == one process: the sharded optimizer against its rule's float64 reference run on the
gradients averaged over ranks (``casekit.oracle``; the project's bound: fp32 relative error
<= 1e-6, 16-bit within one unit in the last place).

    mpiexec -n N python -m mpi4py tests/cases/parity.py [SUB-CASE ...] [--rule NAME ...]
        [--backend numpy|cupy] [--nccl]

Sub-cases (all by default):
- ``rules``: every rule of the registry, each variant with each option set of
  ``casekit.RULE_OPTIONS`` it takes, in fp32, fp16 and bf16, with two param groups (options of
  their own), clipping and a fixed loss scale, on awkward shapes with buckets of one quantum
  (tensors straddle shards and buckets). A rule without a float64 reference is held to one
  process running the engine on the averaged gradients (exact ones: bitwise where elementwise).
- ``layouts``: ZeroAdamW on awkward layouts (0-d, empty, sizes no N divides, fewer elements
  than ranks, thousands of tensors over many buckets, shards longer than the CPU kernels'
  chunk); every parameter and gradient a view of one flat buffer; ranks start from different
  values (rank 0's win the broadcast) and end with the same bits.
- ``training``: the training loop's features: param groups with their own lr and weight decay,
  a learning rate changed every step, clipping (``grad_norm`` and ``clip_coef`` reported as the
  reference computes them), gradient accumulation, a fixed and a growing dynamic loss scale;
  ``step()`` leaves the gradients zeroed.

``--backend cupy`` puts the parameters on the GPU (picked by node-local rank); ``--nccl``
communicates through ``zero1_mpi.comm.nccl`` instead of MPI; ``--rule`` runs those rules only.
"""

import argparse

import numpy as np

import casekit as kit
from casekit import check, rank, size, world
from zero1_mpi import LossScaler, ZeroAdam, ZeroAdamW, decay_groups
from zero1_mpi.kernels.backend import resolve_dtype, to_numpy

parser = argparse.ArgumentParser()
parser.add_argument("sub_cases", nargs="*")
parser.add_argument("--rule", action="append")
parser.add_argument("--backend", default="numpy")
parser.add_argument("--nccl", action="store_true")
ARGS = parser.parse_args()
xp = kit.use_backend(ARGS.backend)
kernels, counts = set(), {}


def communicator():
    if ARGS.nccl:
        from zero1_mpi.comm.nccl import NcclCommunicator
        return NcclCommunicator(world)
    return world


# -- every rule of the registry --------------------------------------------------------------

RULE_STEPS = 10


def rule_case(entry, variant, options, dtype_name, use_engine):
    dtype = resolve_dtype(dtype_name)
    engine = {"bucket_elements": 1, "max_grad_norm": 5.0, "loss_scale": 8.0}
    mine = kit.init_values(xp=xp, r=rank)  # rank 0's values must win the broadcast
    params = kit.groups_of(mine, options)
    opt = kit.build(variant, params, communicator(), options, param_dtype=dtype_name, **engine)
    oracle = kit.oracle(variant, options, kit.init_values(xp=xp), groups=params,
                        max_grad_norm=5.0, use_engine=use_engine,
                        engine={"bucket_elements": 1, "loss_scale": 8.0,
                                "param_dtype": dtype_name})
    exact = isinstance(oracle, kit.EngineOracle)  # the engine as oracle: exact gradients
    where = f"{entry.name} {variant.settings()} {options} {dtype_name}"
    for step in range(1, RULE_STEPS + 1):
        kit.hand_over(opt, kit.grads_of(rank, step, dtype=dtype, exact=exact))
        opt.step()
        if exact:
            oracle.step_sum(kit.sum_grads(step, dtype=dtype, exact=True))
            for k in kit.SHAPES:  # a two-phase rule sums its norms in another order
                kit.near(opt.params[k], oracle.params[k], not variant.tensor_sums,
                         f"{where} step {step} {k!r} against one process")
        else:
            oracle.step(kit.mean_grads(step, dtype=dtype))
            kit.close_to(opt.params, oracle.params, dtype, f"{where} step {step}")
    kernels.add(opt.kernel)
    return exact


def rules(use_engine=False):
    cases = engine_cases = 0
    for entry in kit.registry(ARGS.rule).values():
        for variant, options in kit.rule_cases(entry):
            for dtype_name in kit.DTYPES:
                engine_cases += rule_case(entry, variant, options, dtype_name, use_engine)
                cases += 1
    what = "rule cases against one engine" if use_engine else \
        f"rule cases ({engine_cases} against one engine)"
    counts["engine-oracle" if use_engine else "rules"] = f"{cases} {what} x {RULE_STEPS} steps"


# -- layouts -----------------------------------------------------------------------------------

AWKWARD = {"scalar": (), "empty": (0, 3), "one": (1,), "vec": (7,), "mat": (5, 13),
           "cube": (3, 1, 7), "wide": (2, 129)}
LAYOUTS = {  # shapes, engine options, dtypes, steps
    "awkward": (AWKWARD, {}, kit.DTYPES, 10),
    # Buckets of one quantum (64 x ranks): tensors straddle shards and buckets.
    "awkward-buckets": ({**AWKWARD, "long": (700,)}, {"bucket_elements": 1}, kit.DTYPES, 10),
    "fewer-than-ranks": ({"s": ()}, {}, kit.DTYPES, 10),
    "thousands": ({f"t{i}": (1 + i % 5,) for i in range(2000)}, {"bucket_elements": 1500},
                  ("bfloat16",), 3),
    # Shards of over 65,536 elements (NUMPY_CHUNK) on up to 4 ranks: the CPU kernels' chunks.
    "chunks": ({"big": (270_001,)}, {}, ("bfloat16",), 3),
}


def is_view_of(view, flat) -> bool:
    """``view``'s bytes lie inside ``flat``'s, by address (CuPy's ``shares_memory`` said False
    for the 0-d views here on CuPy 14.2)."""
    if view.size == 0:
        return True
    face = "__cuda_array_interface__" if ARGS.backend == "cupy" else "__array_interface__"
    start, at = getattr(flat, face)["data"][0], getattr(view, face)["data"][0]
    return start <= at and at + view.nbytes <= start + flat.nbytes


def layout_case(name, dtype_name):
    shapes, options, _, steps = LAYOUTS[name]
    dtype = resolve_dtype(dtype_name)
    hyper = {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    opt = ZeroAdamW(kit.init_values(shapes, xp=xp, r=rank), communicator(),
                    param_dtype=dtype_name, **hyper, **options)
    ref = kit.REFERENCES["adam"](opt.rule, params=kit.init_values(shapes), **hyper)
    flat = kit.shard_arrays(opt)
    for k, s in shapes.items():
        check(is_view_of(opt.params[k], flat["params"]), f"params[{k!r}] is not a view")
        check(is_view_of(opt.grads[k], flat["grads"]), f"grads[{k!r}] is not a view")
        check(opt.params[k].shape == s and opt.params[k].dtype == dtype, k)
    for step in range(1, steps + 1):
        opt.zero_grad()
        kit.hand_over(opt, kit.grads_of(rank, step, shapes, dtype))
        opt.step()
        ref.step(kit.mean_grads(step, shapes, dtype))
        kit.close_to(opt.params, ref.params, dtype, f"{name} {dtype_name} step {step}")
    check(kit.everywhere_same(to_numpy(flat["params"]).tobytes()),
          f"{name} {dtype_name}: the parameters differ between ranks")
    kernels.add(opt.kernel)


def layouts():
    cases = 0
    for name, (_, _, dtypes, _) in LAYOUTS.items():
        for dtype_name in dtypes:
            layout_case(name, dtype_name)
            cases += 1
    counts["layouts"] = f"{cases} layouts"


# -- the training loop's features ------------------------------------------------------------

TRAIN_SHAPES = {"w1": (7, 5), "b1": (5,), "scale": (), "w2": (5, 3), "b2": (3,), "big": (400,)}
TRAIN_STEPS = 10


def accumulated(step, dtype, micro_batches, scale):
    """What the reference sees: exactly what each rank accumulated, unscaled and averaged."""
    total = {k: np.zeros(s) for k, s in TRAIN_SHAPES.items()}
    for r in range(size):
        acc = {k: np.zeros(s, dtype) for k, s in TRAIN_SHAPES.items()}
        for micro in range(micro_batches):
            for k, g in kit.grads_of(r, step, TRAIN_SHAPES, dtype, seed=5, micro=micro,
                                     scale=scale).items():
                acc[k] += (np.asarray(g, np.float32) / micro_batches).astype(dtype)
        for k in TRAIN_SHAPES:
            total[k] += np.asarray(acc[k], np.float64) / scale
    return {k: v / size for k, v in total.items()}


def training_case(name, dtype_name, cls, *, max_grad_norm=None, loss_scale=None,
                  micro_batches=1, schedule=False):
    dtype = resolve_dtype(dtype_name)
    groups = decay_groups(kit.init_values(TRAIN_SHAPES, xp=xp), weight_decay=0.1)
    groups[1]["lr"] = 3e-2  # matrices decay; vectors do not, and have their own lr
    opt = cls(groups, communicator(), lr=1e-2, param_dtype=dtype_name,
              max_grad_norm=max_grad_norm, loss_scale=loss_scale)
    ref = kit.REFERENCES["adam"](opt.rule, params=kit.init_values(TRAIN_SHAPES), lr=1e-2,
                                 max_grad_norm=max_grad_norm,
                                 groups=[{"names": list(g["params"]),
                                          "weight_decay": g["weight_decay"],
                                          "lr": g.get("lr", 1e-2)} for g in groups])
    for step in range(1, TRAIN_STEPS + 1):
        scale = opt.loss_scale
        if schedule:  # any schedule: here a warm-up then a decay, set between steps
            for g_opt, g_ref, base in zip(opt.param_groups, ref.groups, (1e-2, 3e-2)):
                g_opt["lr"] = g_ref["lr"] = base * min(step / 5, 1.0) * (1 - step / 40)
        for micro in range(micro_batches):  # accumulate the mean of the micro-batches
            for k, g in kit.grads_of(rank, step, TRAIN_SHAPES, dtype, seed=5, micro=micro,
                                     scale=scale).items():
                opt.grads[k][...] += xp.asarray((np.asarray(g, np.float32) / micro_batches)
                                                .astype(dtype))
        info = opt.step()
        want_norm = ref.step(accumulated(step, dtype, micro_batches, scale))
        where = f"{name}/{dtype_name}/{cls.__name__} step {step}"
        check(not info.skipped and info.step == step and info.loss_scale == scale,
              f"{where}: unexpected {info}")
        check(abs(info.grad_norm - want_norm) <= 1e-5 * want_norm,
              f"{where}: grad_norm {info.grad_norm} != {want_norm}")
        if max_grad_norm is not None:
            want_coef = min(1.0, max_grad_norm / (want_norm + 1e-6))
            check(abs(info.clip_coef - want_coef) <= 1e-5 * want_coef,
                  f"{where}: clip_coef {info.clip_coef} != {want_coef}")
        kit.close_to(opt.params, ref.params, dtype, where)
        check(not any(bool((g != 0).any()) for g in opt.grads.values()),
              f"{where}: step() left gradients behind")
    kernels.add(opt.kernel)
    return opt


def training():
    cases = 0
    for dtype_name in kit.DTYPES:
        for cls in (ZeroAdam, ZeroAdamW):
            training_case("groups+clip+schedule", dtype_name, cls, max_grad_norm=1.0,
                          schedule=True)
        training_case("no clipping needed", dtype_name, ZeroAdamW, max_grad_norm=1e6)
        training_case("accumulation", dtype_name, ZeroAdamW, micro_batches=3)
        cases += 4
    # A fixed loss scale: gradients arrive multiplied by it and are unscaled in the kernel.
    training_case("fixed loss scale", "float16", ZeroAdamW, loss_scale=1024.0, max_grad_norm=1.0)
    grows = LossScaler.dynamic_scaler(init_scale=256.0, growth_interval=5)
    opt = training_case("dynamic loss scale, growing", "float16", ZeroAdam, loss_scale=grows)
    check(opt.loss_scale == 256.0 * 2 ** (TRAIN_STEPS // 5),
          f"the loss scale did not grow: {opt.loss_scale}")
    counts["training"] = f"{cases + 2} training cases x {TRAIN_STEPS} steps"


if __name__ == "__main__":
    kit.sub_cases({"rules": rules, "engine-oracle": lambda: rules(use_engine=True),
                   "layouts": layouts, "training": training}, ARGS.sub_cases)
    if rank == 0:
        via = " via NCCL" if ARGS.nccl else ""
        print(f"OK parity: {', '.join(counts.values())} on {size} ranks ({ARGS.backend}{via}, "
              f"kernel {'+'.join(sorted(kernels))})")
