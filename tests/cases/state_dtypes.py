"""The rule's state in bf16 and in 8 bits (``state_dtype``) on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/state_dtypes.py DIRECTORY [rules] [checkpoint]
        [ledger]

``rules``: every rule of the registry (each variant), fp32 and bf16 parameters in two param
groups, stage 1 and 2 (an fp32 gradient shard: the model's gradients), flat and (N even, N >
2) in groups of 2, against a float64 model of the rule whose state arrays are kept as the
engine keeps them at the end of each step: bf16 rounded with the engine's bits
(``reference.sr_bf16``: the parameter's flat index, the step, the array), or 8-bit blocks of
each rank's pieces (``reference.int8_state_encode``; LAMB as the engine runs it: its trust
ratio from the moments before they are rounded). The fp32 and float64 runs may round a value
to either side now and then: with bf16 state the parameters are within the project's bound
after every step (but for 1% of a tensor, or one element, within a tenth of the learning rate a
step) and 99% of the state is the model's (the rest within 3 bf16 steps); with
8-bit state 99% is the model's, the rest within a code, the parameters within a tenth of the
learning rate a step. ``checkpoint``: a bf16-state run's checkpoint loads into
an fp32-state optimizer on one rank with the same state values, the other way the values round
to nearest, and the same for the 8-bit state (quantized once on the load). ``ledger``: 2 bytes
a bf16 state element, 1 + 4/256 an 8-bit one (small tensors: 4); Adam's K with bf16 params is 6
and 4.03125.
"""

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

import casekit as kit
import reference as ref
from casekit import check, rank, size, world
from zero1_mpi import ZeroAdamW
from zero1_mpi.kernels.backend import BFLOAT16
from zero1_mpi.state.int8_blocks import CODES, MIN_8BIT_SIZE, STATE_BLOCK

parser = argparse.ArgumentParser()
parser.add_argument("directory", type=Path)
parser.add_argument("sub_cases", nargs="*")
ARGS = parser.parse_args()
#: "big" is the one tensor the 8-bit state quantizes (4096 elements and more); the rest keep fp32.
SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (700,), "big": (4100,),
          "bias": (3,)}
STEPS = 4
#: Each reference's state attributes, in the order of the rule's ``state_names``.
STATE_OF = {"adam": ("m", "v"), "lamb": ("m", "v"), "sgd": ("buf",), "lion": ("m",),
            "sign_momentum": ("buf",)}


class RoundedModel:
    """A float64 reference whose state arrays are rounded stochastically after each step, as
    the engine rounds them: ``step(means)``, ``params``."""

    def __init__(self, variant, options, init, groups, opt, mode):
        self.inner = kit.oracle(variant, options, init, groups=groups, max_grad_norm=5.0)
        self.attrs, self.layout, self.t = STATE_OF[variant.name], opt.layout, 0
        self.shard_rank, self.mode = opt.shard_rank, mode
        self.blocks = blocks_by_tensor(opt.layout, opt.shard_group_size)

    @property
    def params(self):
        return self.inner.params

    def step(self, means):
        self.t += 1
        if isinstance(self.inner, ref.ReferenceLAMB):
            self._lamb_step(means)
            return
        self.inner.step(means)
        for array, attr in enumerate(self.attrs):
            state = getattr(self.inner, attr)
            for t in self.layout.tensors:
                if t.name in state:  # (not SGD's buffer before its first step)
                    state[t.name] = self._round(t.name, state[t.name], array)

    def _round(self, name, values, array):
        """``values`` of tensor ``name`` as the engine keeps them after a step."""
        t = next(t for t in self.layout.tensors if t.name == name)
        x = np.asarray(values, np.float32).reshape(-1)
        if self.mode == "bfloat16":
            bits = ref.sr_bf16(x, t.offset + np.arange(t.numel), self.t, array)
            out = (bits.astype(np.uint32) << 16).view(np.float32)
        else:  # 8 bits: each block of each rank's pieces of the tensor (small tensors: fp32)
            out = x.copy()
            for lo, hi in self.blocks.get(name, ()):
                codes, scales = ref.int8_state_encode(x[lo:hi], CODES[False], CODES[True])
                out[lo:hi] = ref.int8_state_decode(codes, scales, CODES[False], CODES[True])
        return out.astype(np.float64).reshape(np.shape(values))

    def _lamb_step(self, means):
        """LAMB as the engine runs it with rounded state: the trust ratio's norms from the
        moments before rounding (phase one), the direction from the rounded ones (two)."""
        lamb, t = self.inner, self.t
        grads, _ = ref.clipped(means, lamb.max_grad_norm)
        lamb.t = t
        for group in lamb.groups:
            lr, (b1, b2), eps, wd = (group[k] for k in ("lr", "betas", "eps", "weight_decay"))
            for k in group["names"]:
                p, g = lamb.params[k], grads[k]
                m = b1 * lamb.m[k] + (1 - b1) * g
                v = b2 * lamb.v[k] + (1 - b2) * g * g

                def direction(m, v):
                    return (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * p

                p_norm, u_norm = np.linalg.norm(p), np.linalg.norm(direction(m, v))
                ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
                lamb.m[k], lamb.v[k] = self._round(k, m, 0), self._round(k, v, 1)
                p -= lr * ratio * direction(lamb.m[k], lamb.v[k])

    def state_rows(self, names) -> dict:
        """The model's state as the engine's rows over this rank's owned ranges."""
        rows = {}
        for array, name in enumerate(names):
            full = np.zeros(self.layout.total)
            state = getattr(self.inner, self.attrs[array])
            for t in self.layout.tensors:
                if t.name in state:
                    full[t.offset : t.offset + t.numel] = np.reshape(state[t.name], -1)
            rows[name] = np.concatenate([full[lo:hi] for lo, hi, _ in
                                         self.layout.owned(self.shard_rank)] or
                                        [np.zeros(0)])
        return rows


def blocks_by_tensor(layout, k) -> dict:
    """The 8-bit state's blocks, by tensor name, as element ranges of the tensor: each shard
    rank's pieces of it cut into ``STATE_BLOCK`` values from the piece's start; tensors under
    ``MIN_8BIT_SIZE`` elements have none (fp32)."""
    blocks = {}
    for r in range(k):
        for bucket in layout.buckets:
            lo = bucket.shard(r)[0]
            for index, _, a, b in layout.tensor_pieces(bucket, r):
                t = layout.tensors[index]
                if t.numel < MIN_8BIT_SIZE:
                    continue
                start, stop = lo + a - t.offset, lo + b - t.offset
                blocks.setdefault(t.name, []).extend(
                    (c, min(stop, c + STATE_BLOCK)) for c in range(start, stop, STATE_BLOCK))
    return blocks


def rules():
    groups_k = [None] + ([2] if size % 2 == 0 and size > 2 else [])
    count = 0
    for entry in kit.registry().values():
        if entry.name not in STATE_OF:
            continue
        for variant, options in kit.variant_cases(entry):
            if not variant.state_names:
                continue
            for dtype, mode in (("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                ("float32", "int8"), ("bfloat16", "int8")):
                for k in groups_k:
                    for stage2 in (False, True):
                        init = kit.init_values(SHAPES)
                        params = kit.groups_of(init, options)
                        opt = kit.build(variant, params, world, options, param_dtype=dtype,
                                        state_dtype=mode, bucket_elements=1024,
                                        max_grad_norm=5.0, shard_group_size=k,
                                        shard_gradients=stage2,
                                        grad_shard_dtype="float32" if stage2 else None)
                        model = RoundedModel(variant, options, init, params, opt, mode)
                        where = (f"{entry.name} {variant.settings()} {dtype} {mode} state "
                                 f"k={k} s2={stage2}")
                        for step in range(STEPS):
                            kit.train(opt, [step], SHAPES)
                            model.step(kit.mean_grads(step, SHAPES, dtype))
                            if mode == "bfloat16":
                                near_bf16(kit.params_of(opt), model.params, dtype,
                                          options["lr"] * (step + 1), f"{where} step {step}")
                        got = kit.state_rows(opt)
                        want = model.state_rows(variant.state_names)
                        if mode == "int8":
                            near_8bit(opt, model, got, want, variant, options, where)
                            count += 1
                            continue
                        for name in variant.state_names:
                            g = got[name].astype(np.float64)
                            check(np.array_equal(got[name], got[name].astype(BFLOAT16)
                                                 .astype(np.float32)), f"{where}: {name} not bf16")
                            # a rounding the fp32 and float64 runs draw to either side now
                            # and then (one bf16 step, carried on by the next steps' betas)
                            step_of = np.abs(want[name]) * 2.0**-7 + 1e-30
                            off = np.abs(g - want[name]) / step_of
                            check((off <= 3).all() and (off <= 1e-3).mean() >= 0.99,
                                  f"{where}: {name} off by {off.max()} bf16 steps, "
                                  f"{(off <= 1e-3).mean():.4f} as the model's")
                        count += 1
    print(f"rank {rank}: rules: {count} cases") if rank == 0 else None


def near_bf16(params, want, dtype, moved, where):
    """The parameters with bf16 state after a step: within the project's bound
    (``reference.within_reference``), but for the few elements whose state the fp32 and float64
    runs rounded to either side (at most 1% of a tensor, or one element): those within a tenth
    of ``moved`` (the learning rate summed over the steps so far), as with 8-bit state. The
    rounding draws the same for both runs; the runs differ by a last fp32 bit, so a value
    whose draw falls in between (about 1 in 2^16) takes the other side."""
    for k, w in want.items():
        got, w = kit.to_numpy(params[k]), np.asarray(w, np.float64)
        outside = ~ref.within_reference(got, w, kit.resolve_dtype(dtype))
        off = np.abs(got.astype(np.float64) - w)[outside]
        check(outside.sum() <= max(1, outside.size // 100) and (off <= 0.1 * moved).all(),
              f"{where}: {k!r}: {outside.sum()} of {outside.size} outside the bound, the "
              f"farthest off by {off.max(initial=0)}")


def near_8bit(opt, model, got, want, variant, options, where):
    """The 8-bit state, which the fp32 and float64 runs may put on either side of a code's
    boundary now and then: 99% of its values (and all the fp32 ones) as the model's to 1e-6,
    the rest within one code; the parameters within a tenth of the learning rate a step."""
    for name in variant.state_names:
        g, w = got[name].astype(np.float64), want[name]
        scale = np.abs(w).max(initial=1e-30)  # (fp32 against float64: to roundoff, whose
        same = np.abs(g - w) <= 1e-5 * np.abs(w) + 1e-6 * scale  # cancellations magnify)
        check(same.mean() >= 0.99, f"{where}: {name}: {same.mean():.4f} of it as the model's")
        check((np.abs(g - w) <= 0.1 * np.abs(w) + 0.02 * scale).all(),
              f"{where}: {name} off by {np.max(np.abs(g - w))} (largest {scale})")
    lr = options["lr"]
    for k, p in kit.params_of(opt).items():
        diff = np.abs(p.astype(np.float64) - np.asarray(model.params[k], np.float64))
        bound = 0.1 * lr * STEPS + np.abs(np.asarray(model.params[k])) * 2.0**-7
        check((diff <= bound).all(), f"{where}: params {k} off by {diff.max()}")


def checkpoint():
    """Every pair of modes, through a checkpoint and through the consolidated file."""
    init = kit.init_values(SHAPES)
    for saver, loader in (("bfloat16", "float32"), ("float32", "bfloat16"), ("int8", "float32"),
                          ("float32", "int8"), ("int8", "bfloat16")):
        opt = ZeroAdamW(dict(init), world, lr=1e-2, param_dtype="bfloat16", state_dtype=saver,
                        bucket_elements=64)
        kit.train(opt, range(3), SHAPES)
        root, file = ARGS.directory / f"from-{saver}", ARGS.directory / f"{saver}.safetensors"
        opt.save(root)
        opt.save_consolidated(file)
        full = kit.rows_by_tensor(opt, world)
        for load, path in (("load", root), ("load_consolidated", file)):
            if rank == 0:
                other = ZeroAdamW(dict(init), MPI.COMM_SELF, lr=1e-2, param_dtype="bfloat16",
                                  state_dtype=loader, bucket_elements=64)
                getattr(other, load)(path)
                same_loaded(kit.rows_by_tensor(other, MPI.COMM_SELF), full,
                            f"{saver} -> {loader} ({load})", loader)
                kit.train(other, range(3, 5), SHAPES)  # and it steps on
        world.Barrier()
    print(f"rank {rank}: checkpoint: both ways, at 1 rank from {size}") if rank == 0 else None


def same_loaded(got, full, where, loader) -> None:
    """The state ``got`` after a load of ``full`` into a ``loader`` state: exact, or rounded to
    nearest (bf16), or quantized once (8-bit; its small tensors exact)."""
    for name in ("exp_avg", "exp_avg_sq"):
        for k in SHAPES:
            saved, what = full[name][k], f"{where} {name} {k}"
            if loader == "int8" and k == "big":  # quantized once, within a code
                off = np.abs(got[name][k] - saved)
                check((off <= 0.08 * np.abs(saved) + 0.005 * np.abs(saved).max()).all(), what)
                continue
            want = saved.astype(BFLOAT16).astype(np.float32) if loader == "bfloat16" else saved
            check(kit.same_bits(got[name][k], want), what)
    check(all(kit.same_bits(got["master"][k], full["master"][k]) for k in SHAPES), where)


def ledger():
    opt = ZeroAdamW(kit.init_values(SHAPES), world, param_dtype="bfloat16",
                    state_dtype="bfloat16", bucket_elements=64)
    kit.train(opt, range(2), SHAPES)
    r = opt.memory_report()
    owned = opt.layout.owned_real(opt.shard_rank)
    check(r.state_dtype == "bfloat16" and r.state == {"exp_avg": 2 * owned,
                                                      "exp_avg_sq": 2 * owned}, str(r))
    check(r.bytes_per_param == 6 and r.formula_label == "2Ψ+2Ψ+6Ψ/N", r.formula_label)
    opt = ZeroAdamW(kit.init_values(SHAPES), world, param_dtype="bfloat16",
                    state_dtype="int8", bucket_elements=1024)
    kit.train(opt, range(2), SHAPES)
    r, owned = opt.memory_report(), opt.layout.owned_real(opt.shard_rank)
    kept = opt.state.stored["exp_avg"]
    small = sum(t.numel for t in opt.layout.tensors if t.numel < MIN_8BIT_SIZE)
    check(world.allreduce(kept.side.size) == small, "the small tensors' state is not fp32")
    check(r.state["exp_avg"] == owned + 4 * kept.scales.size + 4 * kept.side.size, str(r))
    check(r.bytes_per_param == 2 + 2 * (1 + 4 / 256), r.formula_label)
    check(r.formula_label == "2Ψ+2Ψ+4.03125Ψ/N", r.formula_label)
    print(f"rank {rank}: ledger: 2 bytes a bf16 state element, 1 + 4/256 an 8-bit one") \
        if rank == 0 else None


kit.sub_cases({"rules": rules, "checkpoint": checkpoint, "ledger": ledger}, ARGS.sub_cases)
if rank == 0:
    print(f"OK state_dtypes on {size} ranks")
