"""Checkpoints of every rule of the registry saved on N ranks load on M ranks, for any N and M.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint.py save DIR/N<N> [--rule NAME ...]
    mpiexec -n M python -m mpi4py tests/cases/checkpoint.py load DIR [--rule NAME ...]

``save`` trains each rule's variants (two param groups with options of their own, clipping in
some steps only) HALF steps in fp32 and bf16, writes a sharded checkpoint and a consolidated
export, trains HALF more and exports again. ``load`` takes every ``DIR/N*`` and checks, on M
ranks, per rule, variant and dtype, for ``load`` and ``load_consolidated`` alike, into an
optimizer built with other learning rates:
- the export holds the rule's float64 reference state (master weights and state arrays) after
  HALF steps on the saving ranks' gradients: what was saved is right, not only self-consistent;
- the loaded state (every row of ``shard_state``: master weights, the rule's state arrays) is
  bitwise the saved one, every element compared on some rank; every rank's full parameters
  are the saved masters rounded; the step count and the group options are the saved ones; its
  re-export is byte for byte the saved export;
- training on matches the float64 reference (the parity bound) and, when M == N, is bitwise
  the run that was never interrupted.
And (``load`` only) the dynamic loss scaler after an overflow and options changed between steps
survive ``save``/``load`` and the export into an optimizer built with others: training on is
bitwise the uninterrupted run.
"""

import argparse
import json
import struct
from pathlib import Path

import numpy as np

import casekit as kit
from casekit import check, rank, size, world
from reference import max_rel_err
from zero1_mpi import LossScaler, ZeroAdam
from zero1_mpi.kernels.backend import resolve_dtype

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["save", "load"])
parser.add_argument("directory", type=Path)
parser.add_argument("--rule", action="append")
ARGS = parser.parse_args()
SHAPES = {"scalar": (), "w": (17, 9), "empty": (0, 4), "v": (5,), "long": (2000,)}
DTYPES = ("float32", "bfloat16")
HALF = 5
MAX_GRAD_NORM = 40.0
#: The reference's attribute holding each state array of a rule.
REFERENCE_STATE = {"exp_avg": "m", "exp_avg_sq": "v", "momentum_buffer": "buf"}


def cases():
    """``(label, variant, options)``: each variant of each rule of the registry."""
    return [(f"{name}-{index}", variant, options)
            for name, entry in kit.registry(ARGS.rule).items()
            for index, (variant, options) in enumerate(kit.variant_cases(entry))]


def grads_of(r, step, dtype):
    """Large on odd steps (clipped to MAX_GRAD_NORM on 1-4 ranks), small on even ones."""
    return kit.grads_of(r, step, SHAPES, dtype, seed=17, scale=2.0 if step % 2 else 0.3)


def make(variant, options, dtype_name, lr_factor=1.0):
    """``lr_factor`` != 1 builds it with other learning rates, which a load must replace."""
    params = kit.groups_of(kit.init_values(SHAPES), options)
    params[1]["lr"] *= lr_factor
    return kit.build(variant, params, world, {**options, "lr": options["lr"] * lr_factor},
                     param_dtype=dtype_name, max_grad_norm=MAX_GRAD_NORM, bucket_elements=500)


def train(opt, steps):
    for step in steps:
        kit.hand_over(opt, grads_of(rank, step, opt.param_dtype))
        opt.step()


def save(directory: Path):
    for label, variant, options in cases():
        for dtype_name in DTYPES:
            out = directory / label / dtype_name
            opt = make(variant, options, dtype_name)
            train(opt, range(1, HALF + 1))
            opt.save(out / "root")
            opt.save_consolidated(out / "half.safetensors")
            train(opt, range(HALF + 1, 2 * HALF + 1))
            opt.save_consolidated(out / "end.safetensors")
    if rank == 0:
        (directory / "world_size").write_text(str(size))


def same_file(a: Path, b: Path) -> bool:
    return world.bcast(a.read_bytes() == b.read_bytes() if rank == 0 else None)


def read_export(path: Path) -> dict:
    """The tensors of a consolidated file, read here without the package (safetensors)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__")
    body = data[8 + length:]
    return {key: np.frombuffer(body[a:b], "<f4").reshape(info["shape"])
            for key, info in header.items() for a, b in [info["data_offsets"]]}


def reference(variant, options, dtype_name, n_saved, steps):
    """The float64 oracle after ``steps`` steps (the first HALF on ``n_saved`` ranks' mean
    gradients, the rest on this job's) and its norms, or None for a rule without one."""
    ref = kit.oracle(variant, options, kit.init_values(SHAPES),
                     groups=kit.groups_of(kit.init_values(SHAPES), options),
                     max_grad_norm=MAX_GRAD_NORM)
    if isinstance(ref, kit.EngineOracle):
        return None, []
    norms = []
    for step in range(1, steps + 1):
        ranks = n_saved if step <= HALF else size
        every = [grads_of(r, step, resolve_dtype(dtype_name)) for r in range(ranks)]
        norms.append(ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every],
                                          axis=0) for k in SHAPES}))
    return ref, norms


def check_export_content(variant, options, dtype_name, n_saved, saved: dict, where):
    """The export after HALF steps holds the reference's state (fp32 relative error 1e-5)."""
    ref, _ = reference(variant, options, dtype_name, n_saved, HALF)
    if ref is None:
        return
    for name in SHAPES:
        wants = {"master": ref.params[name]}
        for row in variant.state_names:
            if row in REFERENCE_STATE:
                wants[row] = getattr(ref, REFERENCE_STATE[row]).get(name, np.zeros(SHAPES[name]))
        for row, want in wants.items():
            got = saved[f"{row}/{name}"]
            check(got.dtype == np.float32 and got.shape == SHAPES[name], (row, name))
            err = max_rel_err(got, want)
            check(err <= 1e-5, f"{where}: {row}/{name} off the reference by {err}")


def check_state(opt, saved: dict, where):
    """This rank's owned state, read through ``shard_state``, is bitwise the saved tensors."""
    kinds = ("master", *opt.rule.state_names)
    checked = 0
    for lo, hi, state in opt.layout.owned(opt.shard_rank):
        views = opt.shard_state(lo, hi, state)
        for t, a, b in opt.layout.pieces(lo, hi):
            for kind in kinds:
                want = saved[f"{kind}/{t.name}"].reshape(-1)[a - t.offset:b - t.offset]
                got = np.asarray(views[kind][a - lo:b - lo], np.float32)
                check(np.array_equal(got.view(np.uint32), want.view(np.uint32)),
                      f"{where}: {kind}/{t.name} differs from the saved one")
                checked += b - a
    total = world.allreduce(checked)  # every element was compared on some rank
    check(total == len(kinds) * opt.layout.numel, f"{where}: compared {total} elements")
    for kind in kinds[1:]:
        check(any(np.any(saved[f"{kind}/{name}"] != 0) for name in SHAPES),
              f"{where}: the saved {kind} is all zero")
    for name in SHAPES:  # every rank's full parameters (not only its shard): the saved masters
        want = saved[f"master/{name}"].astype(opt.param_dtype)
        check(kit.same_bits(opt.params[name], want),
              f"{where}: params[{name!r}] is not the saved master")


def check_options(opt, options, where):
    second = {o: v for o, v in kit.groups_of(kit.init_values(SHAPES), options)[1].items()
              if o != "params"}
    for group, want in zip(opt.param_groups, (options, {**options, **second})):
        for key, value in want.items():
            got = group[key]
            check((tuple(got) if isinstance(got, list) else got) == value,
                  f"{where}: option {key}={got!r} after the load, saved {value!r}")


def check_against_reference(opt, variant, options, n_saved, where):
    ref, norms = reference(variant, options, opt.param_dtype.name, n_saved, 2 * HALF)
    if ref is None:
        return
    check(min(norms) < MAX_GRAD_NORM < max(norms),
          f"{where}: clipping should apply in some steps only: {norms}")
    kit.close_to(opt.params, ref.params, opt.param_dtype, f"{where}, trained on")


def load(directory: Path):
    checked = 0
    for saved_dir in sorted(directory.glob("N*")):
        n_saved = int((saved_dir / "world_size").read_text())
        for label, variant, options in cases():
            for dtype_name in DTYPES:
                where = f"{label} {variant.settings()} saved on {n_saved}, loaded on {size} " \
                        f"ranks, {dtype_name}"
                out = saved_dir / label / dtype_name
                scratch = directory / f"scratch-{size}-{n_saved}-{label}-{dtype_name}"
                half = read_export(out / "half.safetensors")
                check_export_content(variant, options, dtype_name, n_saved, half, where)
                for how in ("load", "load_consolidated"):
                    opt = make(variant, options, dtype_name, lr_factor=3.0)
                    if how == "load":
                        opt.load(out / "root")
                    else:
                        opt.load_consolidated(out / "half.safetensors")
                    where_how = f"{where}, {how}"
                    check(opt.step_count == HALF, f"{where_how}: step {opt.step_count}")
                    check_options(opt, options, where_how)
                    check_state(opt, half, where_how)
                    opt.save_consolidated(scratch / f"{how}.safetensors")
                    check(same_file(scratch / f"{how}.safetensors", out / "half.safetensors"),
                          f"{where_how}: the re-export differs from the saved one")
                    train(opt, range(HALF + 1, 2 * HALF + 1))
                    check_against_reference(opt, variant, options, n_saved, where_how)
                    if n_saved == size:  # the same reductions as the uninterrupted run
                        opt.save_consolidated(scratch / f"{how}-end.safetensors")
                        check(same_file(scratch / f"{how}-end.safetensors",
                                        out / "end.safetensors"),
                              f"{where_how}: training on differs from the uninterrupted run")
                    checked += 1
    counters_survive(directory / f"counters-{size}")
    if rank == 0:
        print(f"OK checkpoints: {checked} loads on {size} ranks "
              f"({', '.join(kit.registry(ARGS.rule))})")


# -- the loss scaler and the options ---------------------------------------------------------

COUNTER_SHAPES = {"w": (33, 7), "b": (7,), "long": (1500,)}


def make_scaled(options: dict):
    return ZeroAdam(kit.init_values(COUNTER_SHAPES), world, param_dtype="float16",
                    bucket_elements=400, **options,
                    loss_scale=LossScaler.dynamic_scaler(init_scale=2.0 ** 12, growth_interval=3))


def train_scaled(opt, steps):
    for step in steps:
        for k, g in kit.grads_of(rank, step, COUNTER_SHAPES, np.float16, seed=77,
                                 scale=1.0).items():
            opt.grads[k][...] = g * np.float16(opt.loss_scale / 64)
        if step == 3 and rank == size - 1:
            opt.grads["w"][0, 0] = np.inf  # every rank skips this step and backs off
        opt.step()


def export_bytes(opt, file: Path) -> bytes:
    opt.save_consolidated(file)
    return world.bcast(file.read_bytes() if rank == 0 else None)


def counters_survive(directory: Path):
    """Dynamic loss scaling after an overflow (a skipped step, the scale backed off and grown
    again) and group options changed between steps survive both ways of saving."""
    opt = make_scaled({"lr": 1e-2})
    train_scaled(opt, range(1, 6))
    group = opt.param_groups[0]
    group.update(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02)
    train_scaled(opt, range(6, 8))
    check(opt.step_count == 6, f"one of 7 steps must have been skipped: {opt.step_count}")
    saved = (opt.step_count, opt.scaler.state(), dict(group))
    check(saved[1] != make_scaled({}).scaler.state(), "the scaler never changed: no test")
    opt.save(directory / "root")
    opt.save_consolidated(directory / "consolidated.safetensors")
    train_scaled(opt, range(8, 12))
    uninterrupted = export_bytes(opt, directory / "uninterrupted.safetensors")
    for how in ("save/load", "save_consolidated/load_consolidated"):
        other = make_scaled({"lr": 0.5, "betas": (0.5, 0.5), "eps": 0.1, "weight_decay": 0.3})
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
        train_scaled(other, range(8, 12))
        check(export_bytes(other, directory / "resumed.safetensors") == uninterrupted,
              f"{how}: training on differs from the uninterrupted run")


if __name__ == "__main__":
    {"save": save, "load": load}[ARGS.mode](ARGS.directory)
