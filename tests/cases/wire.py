"""The 8-bit wire (``reduce_dtype="int8"``, ``error_feedback``, ``compress_hops``,
``gather_dtype="int8"``) on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/wire.py [reduce] [gather] [overflow] [rules]
        [options] [feedback]

``reduce``: every rank's reduced gradient shards equal, bit for bit, a float64 model of the
format (``reference.int8_encode`` / ``int8_sum``: each member's rows quantized with its own
residual, summed in rank order; across the shard groups the same again), over three rounds
(the residuals carried), stage 1 and 2, fp32 / bf16 / fp16, flat and (4 or 6 ranks) in groups
of 2 (2 or 3 replicas), every hop or the one across. ``gather``: with 8-bit parameter gathers, every rank's copy is the
same bytes, each step's copy is within the stated bound of the masters' 16-bit rounding, the
masters are bit for bit those of 16-bit gathers, and overlap (``grads_ready``, ``wait=False``)
changes no bit. ``overflow``: an inf or nan in one block of one
rank's gradient skips the step on every rank (dynamic loss scale) or raises everywhere.
``feedback``: the residuals double with the loss scale, bit for bit, and are forgotten on a
skipped step and on a load.
``rules``: every rule of the registry with 8-bit reduction and gathers against its float64
reference on the mean of the decoded gradients. ``options``: bad values raise on every rank.
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np

import casekit as kit
import reference as ref
from casekit import check, rank, size, world
from zero1_mpi import ZeroAdamW, ZeroSGD
from zero1_mpi.kernels.backend import resolve_dtype

SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (700,), "big": (3000,)}
#: Where the ``feedback`` case saves (the same directory on every rank: rank 0's temporary one).
DIRECTORY = world.bcast(tempfile.mkdtemp(prefix="zero1-wire-") if rank == 0 else None)
BUCKET = 2048  # several buckets, and shards with partial blocks
F32 = np.float32


def flat_grads(opt, r, step, dtype):
    """Rank ``r``'s gradient of ``step`` as the flat buffer it hands over (padding zero)."""
    g = kit.grads_of(r, step, SHAPES, dtype)
    flat = np.zeros(opt.layout.total, dtype)
    for t in opt.layout.tensors:
        flat[t.offset : t.offset + t.numel] = np.asarray(g[t.name], dtype).reshape(-1)
    return flat


class Model:
    """The float64 model of one configuration's reduction, with every rank's residuals."""

    def __init__(self, opt, k, stage2, hops, feedback, dtype):
        self.layout, self.k, self.r = opt.layout, k, size // k
        self.stage2, self.hops, self.feedback, self.dtype = stage2, hops, feedback, dtype
        shard_dtype = np.dtype(dtype) if stage2 else np.dtype(F32)
        self.shard_dtype = shard_dtype
        self.within = [np.zeros(opt.layout.total, dtype) for _ in range(size)]
        self.across = [np.zeros(opt.layout.shard_total, shard_dtype) for _ in range(size)]

    def encode(self, values, residuals, member, lo, n):
        res = residuals[member][lo : lo + n] if self.feedback else None
        scales, q, new = ref.int8_encode(values, res)
        if self.feedback:
            residuals[member][lo : lo + n] = new
        return scales, q

    def reduce(self, grads):
        """What shard rank ``s`` of every group holds after the reduction: ``{s: float64}``."""
        out = {}
        for s in range(self.k):
            parts = []
            for b in self.layout.buckets:
                n, lo = b.shard_size, b.offset + s * b.shard_size
                group_sums = []
                for g in range(self.r):
                    members = [g * self.k + m for m in range(self.k)]
                    if self.k == 1:
                        total = grads[members[0]][lo : lo + n].astype(np.float64)
                    elif self.hops == "all":
                        rows = [self.encode(grads[m][lo : lo + n], self.within, m, lo, n)
                                for m in members]
                        total = ref.int8_sum(rows).astype(np.float64)
                    else:  # 16-bit or fp32 rows summed in rank order in fp32
                        total = grads[members[0]][lo : lo + n].astype(F32)
                        for m in members[1:]:
                            total = (total + grads[m][lo : lo + n].astype(F32)).astype(F32)
                        total = total.astype(np.float64)
                    if self.stage2:  # added into the zeroed shard, in the shard's dtype
                        total = (total.astype(F32) + F32(0)).astype(self.shard_dtype)
                    group_sums.append(total)
                if self.r == 2:  # each replica's shard to the other, summed in rank order
                    st = b.state.start
                    rows = [self.encode(np.asarray(group_sums[g], self.shard_dtype), self.across,
                                        g * self.k + s, st, n) for g in range(self.r)]
                    parts.append(ref.int8_sum(rows).astype(self.shard_dtype).astype(np.float64))
                elif self.r > 2:  # reduce-scattered in R parts, each sum quantized and gathered
                    st, part, total = b.state.start, -(-n // self.r), []
                    for j in range(self.r):
                        lo, hi = min(n, j * part), min(n, (j + 1) * part)
                        rows = [self.encode(np.asarray(group_sums[g][lo:hi], self.shard_dtype),
                                            self.across, g * self.k + s, st + lo, hi - lo)
                                for g in range(self.r)]
                        scales, q, _ = ref.int8_encode(ref.int8_sum(rows))
                        total.append(ref.int8_decode(scales, q))
                    total = np.concatenate(total).astype(F32)
                    parts.append(total.astype(self.shard_dtype).astype(np.float64))
                else:
                    parts.append(np.asarray(group_sums[0], np.float64))
            out[s] = np.concatenate(parts)
        return out


def reduce_case():
    configs = [(None, False, "all", False), (None, False, "all", True),
               (None, True, "all", False), (None, True, "all", True)]
    if size in (4, 6):  # groups of 2: 2 or 3 replicas
        configs += [(2, False, "all", True), (2, True, "all", True),
                    (2, False, "across", True), (2, True, "across", False)]
    count = 0
    for k, stage2, hops, feedback in configs:
        for dtype_name in kit.DTYPES:
            dtype = resolve_dtype(dtype_name)
            where = (f"reduce K={k} stage {2 if stage2 else 1} hops={hops} "
                     f"feedback={feedback} {dtype_name}")
            opt = ZeroSGD(kit.init_values(SHAPES), world, lr=0.1, param_dtype=dtype_name,
                          reduce_dtype="int8", shard_gradients=stage2, shard_group_size=k,
                          compress_hops=hops, error_feedback=feedback, bucket_elements=BUCKET)
            model = Model(opt, opt.shard_group_size, stage2, hops, feedback, dtype)
            for step in range(3):
                grads = [flat_grads(opt, r, step, dtype) for r in range(size)]
                kit.hand_over(opt, kit.grads_of(rank, step, SHAPES, dtype))
                got = kit.reduce_now(opt)
                want = model.reduce(grads)[opt.shard_rank]
                check(kit.same_bits(got.astype(F32), want.astype(F32))
                      or np.array_equal(got, want, equal_nan=True),
                      f"{where} round {step}: the reduced shard differs from the float64 model "
                      f"at {np.flatnonzero(got != want)[:5]}")
            fed = opt.memory_report().error_feedback
            if feedback:
                check(fed > 0, f"{where}: error feedback not booked")
            else:
                check(fed == 0, f"{where}: {fed} bytes of feedback booked without it")
            opt.close()
            count += 1
    return count


def gather_case():
    configs = [(None, False), (None, True)] + ([(2, False), (2, True)] if size in (4, 6) else [])
    worst = 0.0
    for k, stage2 in configs:
        for dtype_name in ("bfloat16", "float16"):
            where = f"gather K={k} stage {2 if stage2 else 1} {dtype_name}"
            dtype = resolve_dtype(dtype_name)
            made = [ZeroAdamW(kit.init_values(SHAPES), world, lr=3e-3, param_dtype=dtype_name,
                              reduce_dtype="int8", shard_gradients=stage2, shard_group_size=k,
                              bucket_elements=BUCKET, gather_dtype=gather)
                    for gather in ("int8", None, "int8")]
            opt, plain, overlapped = made  # the third: reductions from grads_ready, wait=False
            own = [(lo, hi, st) for lo, hi, st in opt.layout.owned(opt.shard_rank)]
            for step in range(30):
                before = kit.shard_arrays(opt)["params"].copy()
                for o in made:
                    kit.hand_over(o, kit.grads_of(rank, step, SHAPES, dtype, scale=1.0))
                    if o is overlapped:
                        if not stage2:
                            o.grads_ready([t.name for t in o.layout.tensors][::-1])
                        o.step(wait=False)
                    else:
                        o.step()
                arrays = kit.shard_arrays(opt)
                copy, master = arrays["params"], arrays["master"]
                check(kit.everywhere_same(copy.tobytes()), f"{where} step {step}: copies differ")
                for lo, hi, st in own:
                    target = master[st : st + hi - lo].astype(dtype)
                    change = target.astype(np.float64) - before[lo:hi].astype(np.float64)
                    err = np.abs(copy[lo:hi].astype(np.float64) - target.astype(np.float64))
                    bound = bound_of(change, target)
                    check((err <= bound).all(), f"{where} step {step}: the copy is "
                          f"{err.max()} off, above the bound {bound[np.argmax(err - bound)]}")
                    scale = np.abs(target.astype(np.float64)).max(initial=1e-30)
                    worst = max(worst, float(err.max() / scale))
            check(kit.same_bits(kit.state_rows(opt)["master"], kit.state_rows(plain)["master"]),
                  f"{where}: the masters differ from those of 16-bit gathers")
            check(all(kit.same_bits(opt.params[k], overlapped.params[k]) for k in SHAPES),
                  f"{where}: overlapped (grads_ready, wait=False) differs")
            for o in made:
                o.close()
    return worst


def bound_of(change, target):
    """Per value: half the scale of its 256-value block of ``change`` (the quantization's
    error) plus half a unit in the last place of ``target`` (the rounding to 16 bits)."""
    blocks = -(-change.size // 256)
    padded = np.zeros(blocks * 256)
    padded[: change.size] = np.abs(change)
    scale = np.repeat(padded.reshape(blocks, 256).max(axis=1) / 127, 256)[: change.size]
    ulp = np.abs(np.spacing(target).astype(np.float64))
    return scale / 2 * (1 + 1e-6) + ulp / 2


def overflow_case():
    configs = [dict(), dict(shard_gradients=True), dict(error_feedback=True)]
    if size in (4, 6):
        configs += [dict(shard_group_size=2), dict(shard_group_size=2, compress_hops="across")]
    for extra in configs:
        for bad in (np.inf, np.nan):
            where = f"overflow {extra} {bad}"
            opt = ZeroAdamW(kit.init_values(SHAPES), world, param_dtype="bfloat16",
                            reduce_dtype="int8", gather_dtype="int8", loss_scale="dynamic",
                            bucket_elements=BUCKET, **extra)
            kit.train(opt, range(2))
            before, scale = kit.snapshot(opt), opt.loss_scale
            grads = kit.grads_of(rank, 5, SHAPES, np.float32)
            if rank == size - 1:
                grads["big"][1000] = bad
            kit.hand_over(opt, grads)
            info = opt.step()
            check(info.skipped and opt.loss_scale == scale / 2, f"{where}: not skipped")
            check(kit.unchanged(opt, before), f"{where}: a skipped step changed the state")
            info = kit.train(opt, range(6, 8))  # the residuals hold no nan afterwards
            check(not info.skipped and np.isfinite(info.grad_norm), f"{where}: poisoned")
            opt.close()
            # without a dynamic scale: an error on every rank
            opt = ZeroAdamW(kit.init_values(SHAPES), world, reduce_dtype="int8",
                            bucket_elements=BUCKET, **extra)
            if rank == 0:
                grads["long"][3] = bad
            kit.hand_over(opt, grads)
            kit.raises(FloatingPointError, "inf or nan", opt.step)
            opt.close()
    return len(configs)


def rules_case():
    cases = 0
    for name, entry in kit.registry().items():
        for variant, options in kit.variant_cases(entry):
            for dtype_name in ("float32", "bfloat16"):
                dtype = resolve_dtype(dtype_name)
                where = f"rules {name} {variant.settings()} {dtype_name}"
                init = kit.init_values(SHAPES)
                gather = "int8" if dtype_name != "float32" else None
                opt = kit.build(variant, init, options=options, param_dtype=dtype_name,
                                reduce_dtype="int8", gather_dtype=gather, bucket_elements=BUCKET)
                oracle = kit.oracle(variant, options, init)
                model = Model(opt, size, False, "all", False, dtype)
                for step in range(3):
                    grads = [flat_grads(opt, r, step, dtype) for r in range(size)]
                    sums = model.reduce(grads)
                    flat = assemble(opt, sums)
                    means = {t.name: (flat[t.offset : t.offset + t.numel] / size)
                             .reshape(t.shape) for t in opt.layout.tensors}
                    kit.hand_over(opt, kit.grads_of(rank, step, SHAPES, dtype))
                    opt.step()
                    if isinstance(oracle, kit.EngineOracle):
                        oracle.step_sum({k: v * size for k, v in means.items()})
                    else:
                        oracle.step(means)
                copy, real = kit.shard_arrays(opt)["params"], np.zeros(opt.layout.total, bool)
                for t in opt.layout.tensors:
                    real[t.offset : t.offset + t.numel] = True
                check(not np.asarray(copy, np.float32)[~real].any(),
                      f"{where}: the parameters' padding is not zero")
                params = {k: np.asarray(kit.to_numpy(v), np.float32) for k, v in opt.params.items()}
                check(kit.everywhere_same(b"".join(p.tobytes() for p in params.values())),
                      f"{where}: the parameters differ between ranks")
                if not isinstance(oracle, kit.EngineOracle):  # the masters (the copies: gather)
                    want = np.zeros(opt.layout.total)
                    for t in opt.layout.tensors:
                        want[t.offset : t.offset + t.numel] = np.reshape(oracle.params[t.name], -1)
                    got = kit.state_rows(opt)["master"]
                    owned = np.concatenate([want[lo:hi] for lo, hi, _ in
                                            opt.layout.owned(opt.shard_rank)] or [np.zeros(0)])
                    ok, err = ref.close_to_reference(got, owned, np.dtype(F32))
                    check(ok, f"{where}: the masters are off by {err}")
                opt.close()
                cases += 1
    return cases


def feedback_case(directory):
    """The residuals follow the loss scale (doubled with it, bit for bit), are forgotten on a
    skipped step and on a load."""
    from zero1_mpi import LossScaler

    cases = 0
    for extra in (dict(), dict(shard_gradients=True)) + ((dict(shard_group_size=2),)
                                                         if size in (4, 6) else ()):
        where = f"feedback {extra}"
        growing = LossScaler.dynamic_scaler(init_scale=1024.0, growth_interval=1)
        made = [ZeroAdamW(kit.init_values(SHAPES), world, param_dtype="bfloat16",
                          reduce_dtype="int8", error_feedback=True, bucket_elements=BUCKET,
                          loss_scale=scale, **extra) for scale in (growing, 1024.0)]
        for o in made:
            kit.train(o, range(1))
        grown, fixed = (kit.feedback_residuals(o) for o in made)
        check(made[0].loss_scale == 2048.0 and len(grown) == len(fixed) > 0, where)
        for a, b in zip(grown, fixed):
            check(kit.same_bits(a, (b.astype(np.float32) * 2).astype(b.dtype)) and b.any(),
                  f"{where}: the residual did not double with the loss scale")
        opt = made[0]
        opt.save(directory / f"feedback-{cases}")
        kit.train(opt, range(1, 2))
        check(any(r.any() for r in kit.feedback_residuals(opt)), f"{where}: no residual")
        opt.load(directory / f"feedback-{cases}")
        check(not any(r.any() for r in kit.feedback_residuals(opt)),
              f"{where}: a load kept the residuals")
        kit.train(opt, range(2, 3))
        grads = kit.grads_of(rank, 3, SHAPES, np.float32)
        if rank == 0:
            grads["big"][5] = np.inf
        kit.hand_over(opt, grads)
        check(opt.step().skipped, f"{where}: not skipped")
        check(not any(r.any() for r in kit.feedback_residuals(opt)),
              f"{where}: a skipped step kept the residuals")
        for o in made:
            o.close()
        cases += 1
    return cases


def assemble(opt, sums):
    """The flat reduced gradient from each shard rank's reduced shards."""
    flat = np.zeros(opt.layout.total)
    offset = {s: 0 for s in sums}
    for b in opt.layout.buckets:
        for s in sums:
            lo = b.offset + s * b.shard_size
            flat[lo : lo + b.shard_size] = sums[s][offset[s] : offset[s] + b.shard_size]
            offset[s] += b.shard_size
    return flat


def options_case():
    init = kit.init_values(SHAPES)
    bad = [
        (dict(reduce_dtype="int4"), "reduce_dtype='int4' is not supported"),
        (dict(error_feedback=True), "pass reduce_dtype='int8' too"),
        (dict(reduce_dtype="int8", error_feedback=1), "error_feedback=1 must be True or False"),
        (dict(compress_hops="across"), "pass reduce_dtype='int8' too"),
        (dict(reduce_dtype="int8", compress_hops="some"), "compress_hops='some' is not"),
        (dict(reduce_dtype="int8", compress_hops="across"), "makes one group"),
        (dict(gather_dtype="int8"), "needs 16-bit parameters"),
        (dict(gather_dtype="float8", param_dtype="bfloat16"), "gather_dtype='float8' is not"),
        (dict(gather_dtype="int8", param_dtype="bfloat16", offload="cpu"), "not supported yet"),
    ]
    for options, text in bad:
        kit.raises(ValueError, text, lambda: ZeroAdamW(init, world, **options))
    # one rank's value differs: refused on every rank
    kit.raises(Exception, "differ", lambda: ZeroAdamW(
        init, world, reduce_dtype="int8", error_feedback=kit.on_last(True, False)))
    return len(bad)


def say(text):
    if rank == 0:
        print(text, flush=True)


if __name__ == "__main__":
    done = kit.sub_cases({"reduce": lambda: say(f"reduce: {reduce_case()} configurations"),
                          "gather": lambda: say(f"gather: worst relative error "
                                                f"{gather_case():.2e}"),
                          "overflow": lambda: say(f"overflow: {overflow_case()} configurations"),
                          "rules": lambda: say(f"rules: {rules_case()} cases"),
                          "options": lambda: say(f"options: {options_case()} bad values"),
                          "feedback": lambda: say(f"feedback: {feedback_case(Path(DIRECTORY))} "
                                                  "configurations")})
    world.Barrier()
    if rank == 0:
        shutil.rmtree(DIRECTORY, ignore_errors=True)
    say(f"OK 8-bit wire on {size} ranks: {', '.join(done)}")
