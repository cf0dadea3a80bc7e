"""Parameter sharding (``shard_params=True``, ZeRO stage 3) on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/stage3.py DIR [SUB-CASE ...]

Each step runs as a model's would: the forward opens every unit in turn (``opt.gathered``),
reading its tensors; the backward opens them in reverse and hands each tensor's gradient over
inside its unit's block. Stages 1 and 2 run the same loop on the same units (there
``gathered`` gives views of the full buffer).
- ``rules``: every rule of the registry (each variant), fp32, bf16 and fp16, two param groups,
  uneven units (one of several buckets), clipping and a loss scale: one micro-batch a step,
  the parameters stage 3 gathers equal stage 1's and stage 2's bit for bit at every step (the
  gradient shard in fp32 for 16-bit parameters, as stage 2 equals stage 1 so), and the
  ``StepInfo`` too; three micro-batches a step equal stage 2's; fp32 Adam and bf16 Adam are
  within the parity bound of the float64 reference on the averaged gradients.
- ``layouts``: on those units, stage 3 equals stage 1 laid out without units bit for bit
  (elementwise rules, every dtype, no clipping).
- ``features``: fp16 with dynamic loss scaling and a planted overflow, the 8-bit gradient wire
  with error feedback (as stage 2), one staging bucket.
- ``prefetch``: from the second step on, opening a unit leaves the next one of the last step's
  order in flight; a changed order (units swapped, one skipped, one opened twice) gives the
  same bits as stage 1; a unit held open across ``step()`` shows the new values after it; a
  unit nested in itself is gathered once.
- ``checkpoints``: stage 3 saves, stage 1 (no units) loads on rank 0 alone and the reverse on
  N ranks: the same parameters and the same next step.
- ``misuse``: an unknown unit, writing a gathered tensor, reading ``opt.params`` outside its
  unit, the 8-bit gathers: clear errors on every rank, nothing changed.
- ``hierarchical`` (N even): ``shard_group_size=2``, bit for bit as stages 1 and 2.
- ``memory``: ``memory_report()`` books this rank's shard of the parameters; the formula is
  the table's Stage 3 column (16Ψ/N for fp32 Adam; 14Ψ/N for bf16 with remainder masters).
"""

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, rank, size, world
from zero1_mpi import ZeroAdamW
from zero1_mpi.kernels.backend import to_numpy

parser = argparse.ArgumentParser()
parser.add_argument("directory", type=Path)
parser.add_argument("sub_cases", nargs="*")
ARGS = parser.parse_args()
STEPS = 5
SHAPES = {"scalar": (), "empty": (0, 3), "vec": (7,), "mat": (5, 13), "long": (300,),
          "bias": (3,)}
#: The units: uneven, "long" spanning several 64-element buckets, two of them across
#: ``kit.groups_of``' two param groups (tensors of 2 or more dimensions, then the rest).
UNITS = {"mixed": ["mat", "vec"], "small": ["empty", "scalar"], "long": ["long"],
         "bias": ["bias"]}
counts = {}


def grads_of(r, step, micro=0):
    return kit.grads_of(r, step, SHAPES, micro=micro, scale=1.0 + r)


def make(variant, options, dtype, stage, on=world, **engine):
    """Stage 1, 2 or 3 with ``UNITS``; 16-bit gradient shards in fp32 unless ``engine`` says."""
    params = kit.groups_of(kit.init_values(SHAPES), options)
    engine = {"bucket_elements": 64, "max_grad_norm": 5.0, "units": UNITS, **engine}
    if stage >= 2:
        engine.setdefault("grad_shard_dtype", None if dtype == "float32" else "float32")
        engine["shard_gradients"] = True
    else:
        engine.pop("grad_shard_dtype", None)
        engine.pop("grad_staging", None)  # (stage 2's and 3's alone)
    if stage == 3:
        engine["shard_params"] = True
    return kit.build(variant, params, on, options, param_dtype=dtype, **engine)


def forward(opt, order=None) -> dict:
    """Open each unit (``order``: of ``UNITS``), copying what it gives: the parameters."""
    seen = {}
    for unit in order or UNITS:
        with opt.gathered(unit) as p:
            check(sorted(p) == sorted(UNITS[unit]), f"gathered({unit!r}) gave {sorted(p)}")
            seen.update({k: to_numpy(v).copy() for k, v in p.items()})
    return seen


def backward(opt, grads, order=None) -> None:
    """Open the units in reverse (or ``order``), handing each tensor over inside its block
    (stage 1: written to ``grads``), scaled by the loss scale."""
    for unit in order or list(UNITS)[::-1]:
        with opt.gathered(unit):
            kit.hand_over(opt, {k: grads[k] for k in UNITS[unit]}, UNITS[unit][::-1],
                          accumulate=True)


def full_params(opt) -> dict:
    return forward(opt)


def same(a: dict, b: dict, where: str) -> None:
    for k in SHAPES:
        check(kit.same_bits(a[k], b[k]), f"{where}: {k!r} differs")


def bitwise(variant, options, dtype, micro_batches=1, stages=None, plant=None, **engine):
    """Stage 3 against stages 2 and 1 (with ``micro_batches`` > 1: stage 2 alone);
    ``plant(step, grads)`` may change this rank's gradients."""
    stages = stages or ((3, 2) if micro_batches > 1 else (3, 2, 1))
    opts = [make(variant, options, dtype, stage, **engine) for stage in stages]
    where = f"{variant.settings()} {dtype} {micro_batches} micro-batches {engine}"
    for step in range(1, STEPS + 1):
        seen = [forward(opt) for opt in opts]
        for opt in opts:
            if opt.grad_shard_dtype is None:
                opt.zero_grad()
            for micro in range(micro_batches):
                grads = grads_of(rank, step, micro)
                if plant is not None:
                    plant(step, grads)
                backward(opt, grads)
        infos = [repr(opt.step()) for opt in opts]
        check(len(set(infos)) == 1, f"{where}: step {step}: {infos}")
        for other, stage in zip(seen[1:], stages[1:]):
            same(seen[0], other, f"{where}: before step {step}, stage {stage}")
    after = [full_params(opt) for opt in opts]
    for other, stage in zip(after[1:], stages[1:]):
        same(after[0], other, f"{where}: at the end, stage {stage}")
    for opt in opts:
        opt.close()


def near_reference(variant, options, dtype):
    opt = make(variant, options, dtype, 3, loss_scale=8.0)
    ref = kit.oracle(variant, options, kit.init_values(SHAPES), max_grad_norm=5.0,
                     groups=kit.groups_of(kit.init_values(SHAPES), options))
    for step in range(1, STEPS + 1):
        forward(opt)
        backward(opt, grads_of(rank, step))
        opt.step()
        every = [grads_of(r, step) for r in range(size)]
        sums = {k: np.zeros(SHAPES[k], np.float32) for k in SHAPES}
        for e in every:  # fp32 sums in rank order, as the gradient shard holds them
            for k in SHAPES:
                sums[k] += e[k].astype(dtype).astype(np.float32)
        ref.step({k: sums[k].astype(np.float64) / size for k in SHAPES})
        kit.close_to(full_params(opt), ref.params, dtype,
                     f"{variant.settings()}/{dtype}: step {step}, against the float64 reference")
    opt.close()


def rules():
    cases = 0
    for entry in kit.registry().values():
        for variant, options in kit.variant_cases(entry):
            for dtype in kit.DTYPES:
                bitwise(variant, options, dtype, loss_scale=8.0)
                cases += 1
    adam = kit.registry()["adam"]
    variant, options = kit.variant_cases(adam)[-1]
    for dtype in ("float32", "bfloat16"):
        bitwise(variant, options, dtype, micro_batches=3, loss_scale=8.0)
        near_reference(variant, options, dtype)
        cases += 2
    counts["rules"] = f"{cases} rule/dtype cases"


def adamw():
    entry = kit.registry()["adam"]
    variant = next(v for v in entry.variants if v.decoupled)
    return variant, variant.check_options(**{**entry.defaults, "lr": 1e-2,
                                             "weight_decay": 0.1})


def prefetch():
    variant, options = adamw()
    ours, theirs = (make(variant, options, "bfloat16", stage) for stage in (3, 1))
    gathers = kit.param_gathers(ours)
    # from step 3 on, each order leaves the last one where a unit was prefetched: two units
    # swapped, one skipped, one opened twice
    orders = {1: None, 2: None, 3: ["mixed", "long", "small", "bias"],
              4: ["mixed", "small", "bias"], 5: ["mixed", "mixed", "small", "long", "bias"],
              6: None}
    dropped = {}
    for step, order in orders.items():
        seen, before = {}, gathers.dropped
        for unit in order or UNITS:
            with ours.gathered(unit) as p:
                if step == 2 and unit != list(UNITS)[-1]:
                    check(gathers.in_flight == 1, f"step 2, {unit!r}: no prefetch in flight")
                with ours.gathered(unit) as again:  # nested: the same buffer
                    check(again is p, f"{unit!r} nested was gathered again")
                check(sorted(p) == sorted(UNITS[unit]), f"step {step}: {unit!r} gave {sorted(p)}")
                seen.update({k: to_numpy(v).copy() for k, v in p.items()})
        for k, v in seen.items():
            check(kit.same_bits(v, theirs.params[k]), f"step {step}: {k!r} differs")
        g = grads_of(rank, step)
        with ours.gathered("bias") as held:  # open across the step: shows the new values
            backward(ours, g)
            backward(theirs, g)
            ours.step()
            theirs.step()
            check(kit.same_bits(held["bias"], theirs.params["bias"]),
                  f"step {step}: a unit held open across step() kept the old values")
        dropped[step] = gathers.dropped - before
    # a prefetch is dropped where the order leaves the recorded one, and none after it in
    # that step: swapped (3), skipped (4), opened twice (5); at 6 the order leaves step 5's
    # where nothing was prefetched (its next unit, opened twice, was open)
    check(dropped == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 0}, f"prefetches dropped: {dropped}")
    # the last step's: the forward, "bias" again (held across the step), the backward but
    # "bias" (nested in the held block: not gathered again)
    check(gathers.in_flight == 0, "a prefetch left in flight after the step")
    units = list(UNITS)
    index = [u for u, _ in ours.options.units]  # (in the layout's order)
    expected = [index.index(u) for u in [*units, "bias", "long", "small", "mixed"]]
    check(gathers.order == expected, f"the recorded order is {gathers.order}, not {expected}")
    ours.close()
    theirs.close()
    counts["prefetch"] = "prefetch"


def safetensors_keys(path) -> set:
    import json
    import struct
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return set(json.loads(f.read(length))) - {"__metadata__"}


def checkpoints(directory: Path):
    variant, options = adamw()
    for dtype in ("float32", "bfloat16"):
        ours = make(variant, options, dtype, 3)
        for step in (1, 2):
            forward(ours)
            backward(ours, grads_of(rank, step))
            ours.step()
        root = directory / f"stage3-{dtype}"
        ours.save(root)
        want = full_params(ours)
        if rank == 0:  # stage 1, no units, alone
            alone = kit.build(variant, kit.groups_of(kit.init_values(SHAPES), options),
                              MPI.COMM_SELF, options, param_dtype=dtype, bucket_elements=64,
                              max_grad_norm=5.0)
            alone.load(root)
            same(want, kit.params_of(alone), f"{dtype}: stage 3 saved, loaded by one rank")
            alone.close()
        world.Barrier()
        theirs = make(variant, options, dtype, 1, units=None)
        for step in (1, 2):
            kit.hand_over(theirs, grads_of(rank, step))
            theirs.step()
        theirs.save(directory / f"stage1-{dtype}")
        for opt, name in ((ours, "stage3"), (theirs, "stage1")):  # the same rows, by name
            opt.save_consolidated(directory / f"{name}-{dtype}.safetensors")
        keys = [safetensors_keys(directory / f"{n}-{dtype}.safetensors") for n in ("stage3",
                                                                                  "stage1")]
        check(keys[0] == keys[1], f"{dtype}: the exports hold {keys[0] ^ keys[1]} apart")
        fresh = make(variant, options, dtype, 3)
        fresh.load(directory / f"stage1-{dtype}")
        same(full_params(fresh), kit.params_of(theirs), f"{dtype}: stage 1 saved, 3 loaded")
        forward(fresh)
        backward(fresh, grads_of(rank, 3))
        kit.hand_over(theirs, grads_of(rank, 3))
        fresh.step()
        theirs.step()
        same(full_params(fresh), kit.params_of(theirs), f"{dtype}: the step after the load")
        for opt in (ours, theirs, fresh):
            opt.close()
    counts["checkpoints"] = "checkpoints across the stages"


def misuse():
    variant, options = adamw()
    opt = make(variant, options, "float32", 3)
    before = kit.snapshot(opt)
    kit.raises(KeyError, "no unit 'nope': the units are 'small', 'mixed', 'long', 'bias'",
               lambda: opt.gathered("nope").__enter__())
    kit.raises(KeyError, "with shard_params=True a rank holds only its shard; read it inside "
               "`with opt.gathered('long') as p:`", lambda: opt.params["long"])
    kit.raises(KeyError, "'nope'", lambda: opt.params["nope"])
    check(list(opt.params) == [t.name for t in opt.layout.tensors] and len(opt.params) == 6,
          f"opt.params lists {list(opt.params)}")
    with opt.gathered("long") as p:
        kit.raises(ValueError, "read-only", lambda: p["long"].__setitem__(0, 1.0))
        check(kit.same_bits(opt.params["long"], p["long"]), "opt.params inside the block")
    check(kit.unchanged(opt, before), "a refused use changed the optimizer")
    kit.raises(ValueError, "shard_params=True with gather_dtype='int8'",
               lambda: make(variant, options, "bfloat16", 3, gather_dtype="int8"))
    kit.raises(ValueError, "shard_gradients=False with shard_params=True",
               lambda: kit.build(variant, kit.init_values(SHAPES), world, options,
                                 shard_params=True, shard_gradients=False))
    kit.raises(ValueError, "units={'a': ['vec', 'long']}: tensor 'scalar' is in no unit",
               lambda: kit.build(variant, kit.init_values(SHAPES), world, options,
                                 units={"a": ["vec", "long"]}))
    opt.close()
    counts["misuse"] = "misuse"


def memory():
    variant, options = adamw()
    for dtype, per_param in (("float32", 16), ("bfloat16", 14)):
        opt = make(variant, options, dtype, 3, grad_shard_dtype=None)
        forward(opt)
        report = opt.memory_report()
        owned = opt.layout.owned_real(opt.shard_rank)
        item = np.dtype(opt.param_dtype).itemsize
        check(report.parameters == owned * item,
              f"{dtype}: parameters={report.parameters}, this rank's shard {owned * item}")
        psi = opt.layout.numel
        check(report.formula_bytes == per_param * psi / size,
              f"{dtype}: formula {report.formula_bytes}, expected {per_param}Ψ/N")
        check(report.formula_label == f"{per_param}Ψ/N", f"{dtype}: {report.formula_label}")
        excess = world.allreduce(report.total - report.formula_bytes)
        check(excess == world.allreduce(report.padding + report.comm_scratch),
              f"{dtype}: summed over the ranks, total - formula != padding + scratch")
        pooled = kit.param_gathers(opt).scratch_bytes
        largest = max(sum(b.size for b in opt.layout.buckets[u.first:u.stop])
                      for u in opt.layout.units)
        check(pooled == largest * item, f"{dtype}: {pooled} bytes of working buffers, "
                                        f"one of the largest unit's {largest * item} expected")
        opt.close()
    counts["memory"] = "memory"


def layouts():
    """Stage 3 on units that reorder the tensors across the param groups equals stage 1 laid
    out without units, bit for bit, for the elementwise rules (no clipping: the global norm's
    sum follows the shards, which the units move)."""
    cases = 0
    for entry in kit.registry().values():
        for variant, options in kit.variant_cases(entry):
            if variant.tensor_sums:
                continue  # (per-tensor sums over the pieces: the same, up to their order)
            for dtype in kit.DTYPES:
                ours = make(variant, options, dtype, 3, max_grad_norm=None, loss_scale=8.0)
                plain = make(variant, options, dtype, 1, units=None, max_grad_norm=None,
                             loss_scale=8.0)
                for step in range(1, STEPS + 1):
                    forward(ours)
                    backward(ours, grads_of(rank, step))
                    kit.hand_over(plain, grads_of(rank, step))
                    a, b = ours.step(), plain.step()  # (the norm's sum follows the shards)
                    check(a.skipped == b.skipped and abs(a.grad_norm - b.grad_norm)
                          <= 1e-5 * b.grad_norm, f"step {step}: {a} vs {b}")
                same(full_params(ours), kit.params_of(plain),
                     f"{variant.settings()} {dtype}: units across groups vs no units")
                ours.close()
                plain.close()
                cases += 1
    counts["layouts"] = f"{cases} against the plain layout"


def features():
    """fp16 with dynamic loss scaling and an overflow on the last rank at step 3 (every stage
    skips it and backs off); the 8-bit gradient wire with error feedback (as stage 2); one
    staging bucket."""
    variant, options = adamw()

    def overflow(step, grads):
        if step == 3 and rank == size - 1:
            grads["mat"][0, 0] = np.inf

    bitwise(variant, options, "float16", plant=overflow, loss_scale="dynamic")
    if size > 1:  # (one rank sends nothing to quantize)
        bitwise(variant, options, "bfloat16", stages=(3, 2), reduce_dtype="int8",
                error_feedback=True)
    bitwise(variant, options, "bfloat16", grad_staging=1)
    counts["features"] = "3 features"


def hierarchical():
    """Shard groups of 2 (N even): units gathered within a group, the gradient shard summed
    across the groups; stage 3 equals stages 2 and 1 bit for bit."""
    variant, options = adamw()
    for dtype in ("float32", "bfloat16"):
        bitwise(variant, options, dtype, shard_group_size=2)
    counts["hierarchical"] = "shard_group_size=2"


TABLE = {"rules": rules, "layouts": layouts, "features": features, "prefetch": prefetch, "checkpoints": lambda: checkpoints(ARGS.directory),
         "misuse": misuse, "memory": memory, "hierarchical": hierarchical}

if __name__ == "__main__":
    kit.sub_cases(TABLE, ARGS.sub_cases)
    if rank == 0:
        print(f"OK stage 3 on {size} ranks: {', '.join(counts.values())}")
