"""Gradient sharding (``shard_gradients=True``, ZeRO stage 2) on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/stage2.py DIR [SUB-CASE ...] [--backend cupy]

- ``rules``: every rule of the registry (each variant), fp32, bf16 and fp16, param groups,
  clipping and a loss scale. One micro-batch a step: with an fp32 gradient shard, stage 2 equals
  stage 1 bit for bit (the step's ``StepInfo`` too). Three micro-batches a step (and one, with
  the parameters' 16-bit shard): within the parity bound of the float64 reference run on the
  gradient the shard holds (each micro-batch's fp32 sum, rounded once to a 16-bit shard).
- ``features``: bitwise stage 1 with dynamic fp16 scaling and an overflow planted on the last
  rank, with the default fp16 shard and ``reduce_dtype="float16"``, with a one-bucket staging
  pool and the tensors handed over out of order. Stage 2 steps with ``wait=False`` throughout.
- ``hierarchical`` (N even, 4 or more): the same with ``shard_group_size=2``.
- ``misuse`` (NumPy only): raised on every rank with nothing updated: a wrong shape on one
  rank, a wrong dtype, a tensor missing at step() or handed over twice, different hand-over
  orders on the ranks; ``grads`` and ``grads_ready`` say what to do instead.
- ``checkpoints``: stage 2 saves, stage 1 loads (and the reverse), and rank 0 alone loads them
  and steps as the N ranks do.

``--backend cupy`` puts the parameters on the GPU (picked by node-local rank).
"""

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, rank, size, world
from zero1_mpi import CollectiveError, ZeroSGD
from zero1_mpi.kernels.backend import resolve_dtype, to_numpy

parser = argparse.ArgumentParser()
parser.add_argument("directory", type=Path)
parser.add_argument("sub_cases", nargs="*")
parser.add_argument("--backend", default="numpy")
ARGS = parser.parse_args()
xp = kit.use_backend(ARGS.backend)
STEPS = 6
SHAPES = {"scalar": (), "empty": (0, 3), "vec": (7,), "mat": (5, 13), "long": (300,),
          "bias": (3,)}
counts = {}


def grads_of(r, step, micro=0):
    return kit.grads_of(r, step, SHAPES, micro=micro, scale=1.0 + r)


def make(variant, options, dtype, stage2, on=world, **engine):
    """``stage2``: False (stage 1), "fp32" (an fp32 gradient shard) or True (the parameters'
    dtype)."""
    params = kit.groups_of(kit.init_values(SHAPES, xp=xp), options)
    engine = {"bucket_elements": 64, "max_grad_norm": 5.0, **engine}
    if not stage2:
        engine.pop("grad_staging", None)  # (stage 2's alone)
    if stage2:
        engine["shard_gradients"] = True
        if stage2 == "fp32":
            engine["grad_shard_dtype"] = "float32"
    return kit.build(variant, params, on, options, param_dtype=dtype, **engine)


def same(a, b, where):
    for k in SHAPES:
        check(kit.same_bits(a.params[k], b.params[k]), f"{where}: {k!r} differs from stage 1")


def bitwise_with_stage1(variant, options, dtype, shard="fp32", order=None, **engine):
    """``shard``: "fp32", or True (the parameters' dtype: bitwise where the reduction itself
    is in that dtype, fp16 with ``reduce_dtype="float16"``). Stage 2 steps with
    ``wait=False`` (its gathers completed when the parameters are read)."""
    ours, theirs = make(variant, options, dtype, shard, **engine), \
        make(variant, options, dtype, False, **engine)
    where = f"{variant.settings()} {dtype} {engine}"
    for step in range(1, STEPS + 1):
        g = grads_of(rank, step)
        if step == 3 and rank == size - 1 and engine.get("loss_scale") == "dynamic":
            g["mat"][0, 0] = np.inf  # an overflow: both skip the step and back off
        kit.hand_over(ours, g, order)
        kit.hand_over(theirs, g)
        a, b = ours.step(wait=False), theirs.step()
        check(repr(a) == repr(b), f"{where}: step {step}: {a} vs stage 1's {b}")
        same(ours, theirs, f"{where} step {step}")


def near_reference(variant, options, dtype, stage2, micro_batches):
    """Against the float64 reference run on the gradient the shard holds: each micro-batch's
    sum over ranks in fp32 (rank order), added to the shard in fp32 and, for a shard of the
    parameters' 16-bit dtype, rounded to it once (``stage2=True``), divided by N."""
    opt = make(variant, options, dtype, stage2, loss_scale=8.0)
    ref = kit.oracle(variant, options, kit.init_values(SHAPES), max_grad_norm=5.0,
                     groups=kit.groups_of(kit.init_values(SHAPES), options))
    if isinstance(ref, kit.EngineOracle):
        return  # a rule without a float64 reference: held to stage 1 bit for bit above
    rounded = stage2 is True and dtype != "float32"
    for step in range(1, STEPS + 1):
        shard = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        for micro in range(micro_batches):
            kit.hand_over(opt, grads_of(rank, step, micro))
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
        kit.close_to(opt.params, ref.params, dtype,
                     f"{variant.settings()}/{dtype}/{stage2}/{micro_batches} micro-batches: "
                     f"step {step}, against the float64 reference")


def every_rule():
    """``(variant, options)`` of every variant of the registry."""
    return [case for entry in kit.registry().values() for case in kit.variant_cases(entry)]


def rules():
    cases = 0
    for variant, options in every_rule():
        for dtype in kit.DTYPES:
            bitwise_with_stage1(variant, options, dtype, loss_scale=8.0)
            near_reference(variant, options, dtype, True, 1)
            near_reference(variant, options, dtype, True, 3)
            near_reference(variant, options, dtype, "fp32", 3)
            cases += 4
    counts["rules"] = f"{cases} rule/dtype cases"


def adam(decoupled=True):
    entry = kit.registry()["adam"]
    variant = next(v for v in entry.variants if v.decoupled == decoupled)
    return variant, variant.check_options(**{**entry.defaults, "lr": 1e-2,
                                             "weight_decay": 0.1})


def features():
    bitwise_with_stage1(*adam(False), "float16", loss_scale="dynamic")
    bitwise_with_stage1(*adam(), "float16", True, loss_scale=8.0, reduce_dtype="float16")
    lamb = kit.registry()["lamb"]
    bitwise_with_stage1(lamb.variants[0], lamb.variants[0].check_options(**lamb.defaults),
                        "bfloat16", grad_staging=1,
                        order=["mat", "scalar", "long", "empty", "bias", "vec"])
    counts["features"] = "3 features"


def hierarchical():
    check(size % 2 == 0 and size > 2, "hierarchical needs an even number of ranks, 4 or more")
    bitwise_with_stage1(*adam(), "bfloat16", shard_group_size=2)
    lion = kit.registry()["lion"]
    bitwise_with_stage1(lion.variants[0], lion.variants[0].check_options(**lion.defaults),
                        "float32", shard_group_size=2)
    counts["hierarchical"] = "shard_group_size=2"


def misuse():
    opt = make(*adam(False), "bfloat16", True)
    before = {k: np.array(opt.params[k]) for k in SHAPES}

    def unchanged():
        for k in SHAPES:
            check(kit.same_bits(opt.params[k], before[k]), f"{k!r} changed by a failed step")
        check(opt.step_count == 0, "a failed step counted")

    def wrong_shape_on_the_last_rank():
        for k in list(SHAPES)[::-1]:
            g = np.ones((2, 2) if k == "vec" and rank == size - 1 else SHAPES[k], np.float32)
            opt.add_grad(k, g)
        opt.step()
    kit.raises(ValueError, "the gradient of 'vec' has shape (2, 2)", wrong_shape_on_the_last_rank)
    unchanged()

    def wrong_dtype_on_rank_0():
        for k in list(SHAPES)[::-1]:
            opt.add_grad(k, np.ones(SHAPES[k], np.float64 if rank == 0 else np.float32))
        opt.step()
    kit.raises(ValueError, "the gradient of 'bias' is float64", wrong_dtype_on_rank_0)
    unchanged()

    def missing():
        for k in list(SHAPES)[::-1]:
            if k != "bias":
                opt.add_grad(k, np.ones(SHAPES[k], np.float32))
        opt.step()
    kit.raises(ValueError, "step() before the gradients of ['bias']", missing)
    unchanged()

    def twice():
        opt.add_grad("long", np.ones(SHAPES["long"], np.float32))
        opt.add_grad("long", np.ones(SHAPES["long"], np.float32))
        opt.step()
    kit.raises(ValueError, "'long' was handed over twice", twice)
    unchanged()
    kit.raises(KeyError, "opt.add_grad(name, grad)", lambda: opt.grads["vec"])
    kit.raises(ValueError, "grads_ready() is for the full gradient buffer",
               lambda: opt.grads_ready("vec"))

    # Two tensors of one bucket each, all buckets one size: ranks that hand them over in
    # different orders run mismatched (but equal-sized) reductions; the step says so.
    quantum = 64 * size
    shapes = {"a": (quantum,), "b": (quantum,)}
    other = ZeroSGD({k: np.zeros(s, np.float32) for k, s in shapes.items()}, world, lr=0.1,
                    bucket_elements=quantum, shard_gradients=True)

    def different_orders():
        for k in ("a", "b") if rank == 0 else ("b", "a"):
            other.add_grad(k, np.full(shapes[k], 1.0 + (k == "a"), np.float32))
        other.step()
    if size > 1:
        kit.raises(CollectiveError, "handed their gradients over in different orders",
                   different_orders)
        check(not np.asarray(other.params["a"]).any(), "a failed step updated 'a'")
    for k in ("a", "b"):  # afterwards it trains
        other.add_grad(k, np.ones(shapes[k], np.float32))
    other.step()
    check(np.allclose(np.asarray(other.params["b"]), -0.1), "no step after the error")
    counts["misuse"] = "misuse"


def checkpoints():
    variant, options = adam()
    for saver, loader in ((True, False), ("fp32", False), (False, "fp32")):
        a = make(variant, options, "bfloat16", saver)
        for step in range(1, 4):
            kit.hand_over(a, grads_of(rank, step))
            a.step()
        path = a.save(ARGS.directory / f"stage2-{saver}")
        b = make(variant, options, "bfloat16", loader)
        b.load(ARGS.directory / f"stage2-{saver}")
        same(a, b, f"saved with shard_gradients={saver}, loaded with {loader}")
        for opt in (a, b):
            kit.hand_over(opt, grads_of(rank, 9))
            opt.step()
        if saver is not True:  # the same numerics from here on (a 16-bit shard rounds)
            same(a, b, f"saved with shard_gradients={saver}, loaded with {loader}, a step")
        if rank == 0:  # any world size: one rank alone, in the other stage, takes the step
            alone = make(variant, options, "bfloat16", not saver, on=MPI.COMM_SELF)
            alone.load(path)
            kit.hand_over(alone, {k: np.mean([grads_of(r, 9)[k].astype("bfloat16")
                                              .astype(np.float32) for r in range(size)], axis=0)
                                  for k in SHAPES})
            alone.step()
            kit.close_to(alone.params, {k: to_numpy(a.params[k]).astype(np.float64)
                                        for k in SHAPES}, resolve_dtype("bfloat16"),
                         "loaded on one rank, a step")
        world.Barrier()
    counts["checkpoints"] = "checkpoints across the stages"


if __name__ == "__main__":
    table = {"rules": rules, "features": features, "misuse": misuse, "checkpoints": checkpoints,
             "hierarchical": hierarchical}
    default = ["rules", "features", "checkpoints"] + (["misuse"] if ARGS.backend == "numpy"
                                                      else [])
    kit.sub_cases(table, ARGS.sub_cases or default)
    if rank == 0:
        print(f"OK stage 2 on {size} ranks ({ARGS.backend}): {', '.join(counts.values())}")
