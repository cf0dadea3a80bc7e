"""Gradient sharding (``shard_gradients=True``, ZeRO stage 2) on N ranks.

- One micro-batch a step: with an fp32 gradient shard, every rule and dtype equals stage 1 bit
  for bit, and so does the default fp16 shard with ``reduce_dtype="float16"`` (param groups, clipping, a loss scale; dynamic fp16 scaling with an overflow planted on
  the last rank; the overlapped step; hierarchical sharding on 4 ranks; a one-bucket staging
  pool with the tensors handed over out of order).
- Three micro-batches a step: within the parity bound of the float64 reference run on the
  gradient the shard holds (each micro-batch's fp32 sum, rounded once to a 16-bit shard).
- Misuse raises on every rank with nothing updated: a wrong shape on one rank, a tensor missing
  at step() or handed over twice, different hand-over orders on the ranks.
- Checkpoints: stage 2 saves, stage 1 loads (and the reverse), and rank 0 alone loads them.

    mpiexec -n N python -m mpi4py tests/cases/stage2.py DIR [cupy]

``cupy`` puts the parameters on the GPU (picked by node-local rank) and skips the misuse part.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check, raises
from reference import (ReferenceAdam, ReferenceLAMB, ReferenceLion, ReferenceSGD,
                       close_to_reference)
from zero1_mpi import CollectiveError, ZeroAdam, ZeroAdamW, ZeroLAMB, ZeroLion, ZeroSGD
from zero1_mpi.backend import resolve_dtype, to_numpy, xp_for

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "numpy"
xp = xp_for(BACKEND)
STEPS = 6
SHAPES = {"scalar": (), "empty": (0, 3), "vec": (7,), "mat": (5, 13), "long": (300,),
          "bias": (3,)}
RULES = {  # optimizer, its options, reference, the reference's options
    "adam": (ZeroAdam, {"weight_decay": 0.01}, ReferenceAdam, {"weight_decay": 0.01}),
    "adamw": (ZeroAdamW, {"weight_decay": 0.1}, ReferenceAdam,
              {"weight_decay": 0.1, "decoupled": True}),
    "sgd": (ZeroSGD, {"momentum": 0.9, "weight_decay": 0.01}, ReferenceSGD,
            {"momentum": 0.9, "weight_decay": 0.01}),
    "lion": (ZeroLion, {"weight_decay": 0.1}, ReferenceLion, {"weight_decay": 0.1}),
    "lamb": (ZeroLAMB, {"weight_decay": 0.01}, ReferenceLAMB, {"weight_decay": 0.01}),
}
LR = {"adam": 1e-2, "adamw": 1e-2, "sgd": 0.05, "lion": 1e-3, "lamb": 1e-2}
FLAT = [k for k in SHAPES if len(SHAPES[k]) < 2]


def init():
    return {k: xp.asarray(np.random.default_rng([5, len(k)]).standard_normal(s)
                          .astype(np.float32)) for k, s in SHAPES.items()}


def grads_of(r, step, micro=0):
    rng = np.random.default_rng([13, step, micro, r])
    return {k: rng.standard_normal(s).astype(np.float32) * (1 + r) for k, s in SHAPES.items()}


def make(rule, dtype, stage2, on=comm, **engine):
    cls, options = RULES[rule][:2]
    params = init()
    groups = [{"params": {k: v for k, v in params.items() if k not in FLAT}},
              {"params": {k: params[k] for k in FLAT}, "weight_decay": 0.0, "lr": LR[rule] / 2}]
    engine = {"bucket_elements": 64, "max_grad_norm": 5.0, **engine}
    if stage2:
        engine["shard_gradients"] = True
        if stage2 == "fp32":
            engine["grad_shard_dtype"] = "float32"
    return cls(groups, on, lr=LR[rule], param_dtype=dtype, **options, **engine)


def reference(rule):
    _, _, cls, options = RULES[rule]
    groups = [{"names": [k for k in SHAPES if k not in FLAT]},
              {"names": FLAT, "weight_decay": 0.0, "lr": LR[rule] / 2}]
    return cls({k: to_numpy(v) for k, v in init().items()}, lr=LR[rule], groups=groups,
               max_grad_norm=5.0, **options)


def hand_over(opt, grads, order=None):
    """Write (stage 1) or hand over (stage 2) ``grads``, scaled by the loss scale, in the
    parameter dtype; stage 2 in backward's order (the reverse of the layout) unless told."""
    dtype = opt.param_dtype
    for k in order or list(SHAPES)[::-1]:
        g = xp.asarray((grads[k] * opt.loss_scale).astype(dtype))
        if opt.grad_shard_dtype is None:
            opt.grads[k][...] += g
        else:
            opt.add_grad(k, g)


def same(a, b, where):
    for k in SHAPES:
        x, y = to_numpy(a.params[k]), to_numpy(b.params[k])
        check(np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)),
              f"{where}: {k!r} differs from stage 1 on rank {rank} of {size}")


def bitwise_with_stage1(rule, dtype, shard="fp32", **engine):
    """``shard``: "fp32" (an fp32 gradient shard), or True (the parameters' dtype: bitwise
    where the reduction itself is in that dtype, fp16 with ``reduce_dtype="float16"``)."""
    order = engine.pop("order", None)
    ours, theirs = make(rule, dtype, shard, **engine), make(rule, dtype, False, **engine)
    for step in range(1, STEPS + 1):
        g = grads_of(rank, step)
        if step == 3 and rank == size - 1 and engine.get("loss_scale") == "dynamic":
            g["mat"][0, 0] = np.inf  # an overflow: both skip the step and back off
        hand_over(ours, g, order)
        hand_over(theirs, g)
        a, b = ours.step(wait=False), theirs.step()
        check(repr(a) == repr(b), f"{rule}/{dtype}/{engine}: step {step}: {a} vs stage 1's {b}")
        same(ours, theirs, f"{rule}/{dtype}/{engine} step {step}")


def near_reference(rule, dtype, stage2, micro_batches):
    """Against the float64 reference run on the gradient the shard holds: each micro-batch's
    sum over ranks in fp32 (rank order), added to the shard in fp32 and, for a shard of the
    parameters' 16-bit dtype, rounded to it once (``stage2=True``), divided by N."""
    opt, ref = make(rule, dtype, stage2), reference(rule)
    rounded = stage2 is True and dtype != "float32"
    for step in range(1, STEPS + 1):
        shard = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        for micro in range(micro_batches):
            hand_over(opt, grads_of(rank, step, micro))
            every = [grads_of(r, step, micro) for r in range(size)]
            for k in SHAPES:
                total = np.zeros(SHAPES[k], np.float32)
                for e in every:
                    total += e[k].astype(dtype).astype(np.float32)
                shard[k] = shard[k] + total
                if rounded:
                    shard[k] = shard[k].astype(dtype).astype(np.float32)
        opt.step()
        ref.step({k: shard[k].astype(np.float64) / size for k in SHAPES})
        for k in SHAPES:
            ok, err = close_to_reference(to_numpy(opt.params[k]), ref.params[k],
                                         resolve_dtype(dtype))
            check(ok, f"{rule}/{dtype}/{stage2}/{micro_batches} micro-batches: step {step}, "
                      f"{k!r} off by {err} from the float64 reference on rank {rank} of {size}")


def raises_everywhere(kind, text, fn):  # every rank runs it: each must raise
    raises(kind, text, fn)


def misuse():
    opt = make("adam", "bfloat16", True)
    before = {k: np.array(opt.params[k]) for k in SHAPES}

    def unchanged():
        for k in SHAPES:
            check(np.array_equal(np.asarray(opt.params[k]).view(np.uint16),
                                 before[k].view(np.uint16)), f"{k!r} changed by a failed step")
        check(opt.step_count == 0, "a failed step counted")

    def wrong_shape_on_the_last_rank():
        for k in list(SHAPES)[::-1]:
            g = np.ones((2, 2) if k == "vec" and rank == size - 1 else SHAPES[k], np.float32)
            opt.add_grad(k, g)
        opt.step()
    raises_everywhere(ValueError, "the gradient of 'vec' has shape (2, 2)",
                      wrong_shape_on_the_last_rank)
    unchanged()

    def wrong_dtype_on_rank_0():
        for k in list(SHAPES)[::-1]:
            opt.add_grad(k, np.ones(SHAPES[k], np.float64 if rank == 0 else np.float32))
        opt.step()
    raises_everywhere(ValueError, "the gradient of 'bias' is float64", wrong_dtype_on_rank_0)
    unchanged()

    def missing():
        for k in list(SHAPES)[::-1]:
            if k != "bias":
                opt.add_grad(k, np.ones(SHAPES[k], np.float32))
        opt.step()
    raises_everywhere(ValueError, "step() before the gradients of ['bias']", missing)
    unchanged()

    def twice():
        opt.add_grad("long", np.ones(SHAPES["long"], np.float32))
        opt.add_grad("long", np.ones(SHAPES["long"], np.float32))
        opt.step()
    raises_everywhere(ValueError, "'long' was handed over twice", twice)
    unchanged()
    raises_everywhere(KeyError, "opt.add_grad(name, grad)", lambda: opt.grads["vec"])
    raises_everywhere(ValueError, "grads_ready() is for the full gradient buffer",
                      lambda: opt.grads_ready("vec"))

    # Two tensors of one bucket each, all buckets one size: ranks that hand them over in
    # different orders run mismatched (but equal-sized) reductions; the step says so.
    quantum = 64 * size
    shapes = {"a": (quantum,), "b": (quantum,)}
    other = ZeroSGD({k: np.zeros(s, np.float32) for k, s in shapes.items()}, comm, lr=0.1,
                    bucket_elements=quantum, shard_gradients=True)

    def different_orders():
        for k in ("a", "b") if rank == 0 else ("b", "a"):
            other.add_grad(k, np.full(shapes[k], 1.0 + (k == "a"), np.float32))
        other.step()
    if size > 1:
        raises_everywhere(CollectiveError, "handed their gradients over in different orders",
                          different_orders)
        check(not np.asarray(other.params["a"]).any(), "a failed step updated 'a'")
    for k in ("a", "b"):  # afterwards it trains
        other.add_grad(k, np.ones(shapes[k], np.float32))
    other.step()
    check(np.allclose(np.asarray(other.params["b"]), -0.1), "no step after the error")


def checkpoints(directory: Path):
    for saver, loader in ((True, False), ("fp32", False), (False, "fp32")):
        a = make("adamw", "bfloat16", saver)
        for step in range(1, 4):
            hand_over(a, grads_of(rank, step))
            a.step()
        path = a.save(directory / f"stage2-{saver}")
        b = make("adamw", "bfloat16", loader)
        b.load(directory / f"stage2-{saver}")
        same(a, b, f"saved with shard_gradients={saver}, loaded with {loader}")
        for opt in (a, b):
            hand_over(opt, grads_of(rank, 9))
            opt.step()
        if saver is not True:  # the same numerics from here on (a 16-bit shard rounds)
            same(a, b, f"saved with shard_gradients={saver}, loaded with {loader}, a step")
        if rank == 0:  # any world size: one rank alone, in the other stage, takes the step
            alone = make("adamw", "bfloat16", not saver, on=MPI.COMM_SELF)
            alone.load(path)
            hand_over(alone, {k: np.mean([grads_of(r, 9)[k].astype("bfloat16")
                                          .astype(np.float32) for r in range(size)], axis=0)
                              for k in SHAPES})
            alone.step()
            for k in SHAPES:
                ok, err = close_to_reference(to_numpy(alone.params[k]),
                                             to_numpy(a.params[k]).astype(np.float64),
                                             "bfloat16")
                check(ok, f"{k!r}: loaded on one rank, a step lands {err} ulps away")
        comm.Barrier()


def main(directory: Path):
    if BACKEND == "cupy":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        xp.cuda.Device(local % xp.cuda.runtime.getDeviceCount()).use()
    cases = 0
    for rule in RULES:
        for dtype in ("float32", "bfloat16", "float16"):
            bitwise_with_stage1(rule, dtype, loss_scale=8.0)
            near_reference(rule, dtype, True, 1)
            near_reference(rule, dtype, True, 3)
            near_reference(rule, dtype, "fp32", 3)
            cases += 4
    bitwise_with_stage1("adam", "float16", loss_scale="dynamic")
    bitwise_with_stage1("adamw", "float16", True, loss_scale=8.0, reduce_dtype="float16")
    bitwise_with_stage1("lamb", "bfloat16", grad_staging=1,
                        order=["mat", "scalar", "long", "empty", "bias", "vec"])
    if size % 2 == 0 and size > 2:
        bitwise_with_stage1("adamw", "bfloat16", shard_group_size=2)
        bitwise_with_stage1("lion", "float32", shard_group_size=2)
    if BACKEND == "numpy":
        misuse()
    checkpoints(directory)
    if rank == 0:
        print(f"OK stage 2: {cases} rule/dtype cases x {STEPS} steps on {size} ranks "
              f"({BACKEND})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
