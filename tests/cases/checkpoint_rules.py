"""Checkpoints of the rules beside Adam (SGD with momentum, Lion, LAMB) saved on N ranks load on
M ranks, as tests/cases/checkpoint.py does for Adam.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint_rules.py save DIR/N<N> RULE [RULE ...]
    mpiexec -n M python -m mpi4py tests/cases/checkpoint_rules.py load DIR RULE [RULE ...]

``save`` trains HALF steps, writes a sharded checkpoint and a consolidated export, trains HALF
more steps and exports again. ``load`` takes every ``DIR/N*`` and checks, on M ranks, per rule
and parameter dtype:
- the loaded state (master weights and the rule's state arrays: ``momentum_buffer``,
  ``exp_avg``, ``exp_avg_sq``) is bitwise the saved one, read through ``shard_state`` against
  the export's tensors, and re-exported byte for byte; every rank's full parameters are the
  saved masters rounded; so are the step count and the group options (the loading optimizer is
  built with other learning rates, which the checkpoint replaces);
- ``load_consolidated`` of the export gives the same state, bit for bit;
- training on after either load matches the float64 reference (the parity bound) and, when
  M == N, is bitwise the run that was never interrupted.
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zero1_mpi
from expect import check
from reference import ReferenceLAMB, ReferenceLion, ReferenceSGD, close_to_reference
from zero1_mpi.backend import resolve_dtype

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"scalar": (), "w": (17, 9), "empty": (0, 4), "v": (5,), "long": (2000,)}
DTYPES = ("float32", "bfloat16")
HALF = 5
MAX_GRAD_NORM = 40.0
GROUP_1 = ("scalar", "v")  # a second param group with options of its own
# name: (optimizer class name, float64 reference, its state arrays, defaults, group 1 options).
RULES = {
    "sgd": ("ZeroSGD", ReferenceSGD, ("momentum_buffer",),
            {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
            {"momentum": 0.8, "dampening": 0.0, "nesterov": True, "weight_decay": 0.0,
             "lr": 0.02}),
    "lion": ("ZeroLion", ReferenceLion, ("exp_avg",),
             {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
             {"betas": (0.8, 0.95), "weight_decay": 0.0, "lr": 1e-3}),
    "lamb": ("ZeroLAMB", ReferenceLAMB, ("exp_avg", "exp_avg_sq"),
             {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01},
             {"betas": (0.8, 0.99), "weight_decay": 0.0, "lr": 5e-4}),
}


def init_values():
    return {k: np.random.default_rng([9, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def make(rule, dtype_name, lr_factor=1.0):
    """The rule's optimizer; ``lr_factor`` != 1 builds it with other learning rates, which a
    load must replace by the saved ones."""
    class_name, _, _, defaults, group_1 = RULES[rule]
    init = init_values()
    groups = [{"params": {k: v for k, v in init.items() if k not in GROUP_1}},
              {"params": {k: init[k] for k in GROUP_1},
               **{**group_1, "lr": group_1["lr"] * lr_factor}}]
    return getattr(zero1_mpi, class_name)(
        groups, comm, **{**defaults, "lr": defaults["lr"] * lr_factor}, param_dtype=dtype_name,
        max_grad_norm=MAX_GRAD_NORM, bucket_elements=500)


def grads_of(r, step, dtype):
    """Large on odd steps (clipped to MAX_GRAD_NORM on 1-4 ranks), small on even ones."""
    rng, scale = np.random.default_rng([step, r]), 2.0 if step % 2 else 0.3
    return {k: (rng.standard_normal(s) * scale).astype(np.float32).astype(dtype)
            for k, s in SHAPES.items()}


def train(opt, steps):
    for step in steps:
        for k, g in grads_of(rank, step, opt.param_dtype).items():
            opt.grads[k][...] = g
        opt.step()


def save(directory: Path, rules):
    for rule in rules:
        for dtype_name in DTYPES:
            out = directory / rule / dtype_name
            opt = make(rule, dtype_name)
            train(opt, range(1, HALF + 1))
            opt.save(out / "root")
            opt.save_consolidated(out / "half.safetensors")
            train(opt, range(HALF + 1, 2 * HALF + 1))
            opt.save_consolidated(out / "end.safetensors")
    if rank == 0:
        (directory / "world_size").write_text(str(size))


def same_file(a: Path, b: Path) -> bool:
    return comm.bcast(a.read_bytes() == b.read_bytes() if rank == 0 else None)


def read_export(path: Path) -> dict:
    """The tensors of a consolidated file, read here without the package (safetensors)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__")
    body = data[8 + length:]
    return {key: np.frombuffer(body[a:b], "<f4").reshape(info["shape"])
            for key, info in header.items() for a, b in [info["data_offsets"]]}


def check_state(opt, rule, saved: dict, where):
    """This rank's owned state, read through ``shard_state``, is bitwise the saved tensors."""
    kinds = ("master", *RULES[rule][2])
    check(opt.rule.state_names == RULES[rule][2], f"{where}: state {opt.rule.state_names}")
    checked = 0
    for lo, hi, state in opt.layout.owned(rank):
        views = opt.shard_state(lo, hi, state)
        for t, a, b in opt.layout.pieces(lo, hi):
            for kind in kinds:
                want = saved[f"{kind}/{t.name}"].reshape(-1)[a - t.offset:b - t.offset]
                got = np.asarray(views[kind][a - lo:b - lo], np.float32)
                check(np.array_equal(got.view(np.uint32), want.view(np.uint32)),
                      f"{where}: {kind}/{t.name} differs from the saved one on rank {rank}")
                checked += b - a
    # Every element was compared on some rank, and the state is not trivially zero.
    total = comm.allreduce(checked)
    check(total == len(kinds) * opt.layout.numel, f"{where}: compared {total} elements")
    for kind in kinds[1:]:
        check(any(np.any(saved[f"{kind}/{name}"] != 0) for name in SHAPES),
              f"{where}: the saved {kind} is all zero")
    # Every rank's full parameters (not only its shard) are the saved masters, rounded.
    for name in SHAPES:
        want = saved[f"master/{name}"].astype(opt.param_dtype).reshape(-1)
        check(np.array_equal(opt.params[name].reshape(-1).view(np.uint8), want.view(np.uint8)),
              f"{where}: params[{name!r}] is not the saved master on rank {rank}")


def check_options(opt, rule, where):
    _, _, _, defaults, group_1 = RULES[rule]
    for group, want in zip(opt.param_groups, (defaults, {**defaults, **group_1})):
        for key, value in want.items():
            got = group[key]
            check((tuple(got) if key == "betas" else got) == value,
                  f"{where}: option {key}={got!r} after the load, saved {value!r}")


def check_against_reference(opt, rule, n_saved, where):
    _, reference, _, defaults, group_1 = RULES[rule]
    dtype = resolve_dtype(opt.param_dtype)
    ref = reference(init_values(), **defaults, max_grad_norm=MAX_GRAD_NORM,
                    groups=[{"names": [k for k in SHAPES if k not in GROUP_1]},
                            {"names": list(GROUP_1), **group_1}])
    norms = []
    for step in range(1, 2 * HALF + 1):
        ranks = n_saved if step <= HALF else size
        every = [grads_of(r, step, dtype) for r in range(ranks)]
        norms.append(ref.step({k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0)
                               for k in SHAPES}))
    check(min(norms) < MAX_GRAD_NORM < max(norms), f"{where}: clipping should apply in some "
                                                   f"steps only: {norms}")
    for k in SHAPES:
        ok, err = close_to_reference(opt.params[k], ref.params[k], dtype)
        check(ok, f"{where}: {k!r} off by {err} after training on")


def load(directory: Path, rules):
    checked = 0
    for saved_dir in sorted(directory.glob("N*")):
        n_saved = int((saved_dir / "world_size").read_text())
        for rule in rules:
            for dtype_name in DTYPES:
                where = f"{rule} saved on {n_saved}, loaded on {size} ranks, {dtype_name}"
                out = saved_dir / rule / dtype_name
                scratch = directory / f"scratch-{size}-{n_saved}-{rule}-{dtype_name}"
                half = read_export(out / "half.safetensors")

                for how in ("load", "load_consolidated"):
                    opt = make(rule, dtype_name, lr_factor=3.0)
                    if how == "load":
                        opt.load(out / "root")
                    else:
                        opt.load_consolidated(out / "half.safetensors")
                    where_how = f"{where}, {how}"
                    check(opt.step_count == HALF, f"{where_how}: step {opt.step_count}")
                    check_options(opt, rule, where_how)
                    check_state(opt, rule, half, where_how)
                    opt.save_consolidated(scratch / f"{how}.safetensors")
                    check(same_file(scratch / f"{how}.safetensors", out / "half.safetensors"),
                          f"{where_how}: the re-export differs from the saved one")

                    train(opt, range(HALF + 1, 2 * HALF + 1))
                    check_against_reference(opt, rule, n_saved, where_how)
                    if n_saved == size:  # the same reductions as the uninterrupted run: bitwise
                        opt.save_consolidated(scratch / f"{how}-end.safetensors")
                        check(same_file(scratch / f"{how}-end.safetensors",
                                        out / "end.safetensors"),
                              f"{where_how}: training on differs from the uninterrupted run")
                    checked += 1
    if rank == 0:
        print(f"OK rule checkpoints: {'+'.join(rules)}, {checked} loads on {size} ranks")


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]), sys.argv[3:])
