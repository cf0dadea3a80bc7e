"""offload='cpu' == the optimizer without it, whole and in part (offload_fraction=0.5): every
rule of the registry (each variant), every dtype, param groups, clipping and a loss scale,
compared after every step (bitwise on NumPy parameters: the same host kernel runs either way;
on CuPy ones, within the kernels' rounding); with stage 2 (shard_gradients), each rule; and
with remainder masters, bf16 and 8-bit state (bf16 parameters), each rule.
Checkpoints and consolidated exports load across offloaded (whole, half) and non-offloaded
optimizers and train on bitwise; right after a load (before any step) the parameters of every
bucket are the saved ones; the memory report splits device and host bytes by their formulas.
At the split's edges (ranks owning only padding, a tensor over many buckets, shares putting one
piece or all but one on the host; Adam and LAMB, stage 1 and 2) partly offloaded equals not
offloaded, and a partly offloaded save loads on one rank with another share.

    mpiexec -n N python -m mpi4py tests/cases/offload.py DIR [--backend cupy] [--group K]
"""

import argparse
import itertools
from pathlib import Path

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, rank, size, world
from reference import max_rel_err, max_ulp_diff
from zero1_mpi.kernels.backend import to_numpy
from zero1_mpi.memory import bytes_per_param

parser = argparse.ArgumentParser()
parser.add_argument("directory", type=Path)
parser.add_argument("--backend", default="numpy")
parser.add_argument("--group", type=int)  # shard_group_size
ARGS = parser.parse_args()
xp = kit.use_backend(ARGS.backend)
SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (700,), "wide": (3, 333)}
STEPS = 5
HALF = {"offload_fraction": 0.5}


def make(variant, options, dtype, offload, groups=True, shapes=SHAPES, comm=world, **engine):
    """``offload``: None, ``"cpu"`` or ``"half"`` (``"cpu"`` with ``HALF``)."""
    if offload == "half":
        offload, engine = "cpu", {**HALF, **engine}
    params = kit.init_values(shapes, xp=xp)
    if groups:  # vectors in a second group with their own options
        params = kit.groups_of(params, options, {"lr": options["lr"] / 2})
    engine = {"bucket_elements": 500, "max_grad_norm": 5.0, "loss_scale": 8.0, **engine}
    return kit.build(variant, params, comm, options, param_dtype=dtype,
                     shard_group_size=ARGS.group if comm is world else None, offload=offload,
                     offload_threads=2 if offload else None, **engine)


def train(opt, steps):
    kit.train(opt, steps)


def state_of(opt) -> list:
    rows = kit.state_rows(opt)
    return [rows[row] for row in opt.state_rows] + \
        [to_numpy(opt.params[k]).reshape(-1).copy() for k in opt.params]


def same(a, b, what, stored=None):
    """Bitwise on NumPy. On CuPy the device kernel and the host kernel may round differently
    (contractions); ``stored``: the relative unit of a 16- or 8-bit state that a decoded fp32
    row carries (a rounding that went the other way moves the next steps by about one)."""
    if ARGS.backend == "numpy":
        check(all(kit.same_bits(x, y) for x, y in zip(a, b)),
              f"{what}: offloaded and not offloaded differ")
    elif stored is not None:
        for x, y in zip(a, b):
            if x.dtype != np.float32:
                check(max_ulp_diff(x, y) <= 2, f"{what}: {max_ulp_diff(x, y)} ulps off")
            else:
                err = max_rel_err(x, y)
                check(err <= 2 * stored, f"{what}: off by {err} of the row's largest")
    else:
        for x, y in zip(a, b):
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            tol = 1e-5 if x.dtype == np.float32 else 2.0 ** -7
            check(np.allclose(x64, y64, rtol=tol, atol=tol * 1e-2),
                  f"{what}: off by {np.max(np.abs(x64 - y64), initial=0)}")


def check_parity(label, variant, options, dtype, **engine):
    """Not offloaded, offloaded whole and half: the same after every step."""
    plain = make(variant, options, dtype, None, **engine)
    off = make(variant, options, dtype, "cpu", **engine)
    half = make(variant, options, dtype, "cpu", **HALF, **engine)
    check(off.offload == "cpu" and plain.offload is None, "offload attribute")
    check(0 < half.memory_report().offload_fraction < 1, "offload_fraction=0.5 split nothing")
    for step in range(1, STEPS + 1):
        for opt in (plain, off, half):
            train(opt, [step])
        same(state_of(plain), state_of(off), f"{label} {dtype} {engine} step {step}")
        same(state_of(plain), state_of(half), f"{label} {dtype} {engine} half, step {step}")
    return plain, off, half


def check_memory(plain, off, dtype):
    ours, theirs = off.memory_report(), plain.memory_report()
    check(ours.offloaded and not theirs.offloaded, "offloaded flag")
    check(ours.device_bytes + ours.host_bytes == ours.total, "device + host != total")
    check(ours.parameters + ours.gradients == ours.device_formula_bytes,
          f"device {ours.parameters + ours.gradients} != {ours.device_formula_bytes}")
    group = world.Split(rank // off.shard_group_size, rank)
    held = group.allreduce(ours.optimizer_state)
    check(held == ours.bytes_per_param * ours.psi,
          f"the group's host state {held} != K Psi = {ours.bytes_per_param} * {ours.psi}")
    check(abs(ours.host_formula_bytes - held / off.shard_group_size) < 1e-6 * held + 1,
          "host formula is not K Psi / N")
    # fp32 offload keeps its own master; not offloaded, bf16 masters are remainders (2 bytes
    # each and 8 a tie) where offloaded ones are fp32
    extra = 4 * ours.psi if dtype == "float32" else 0
    if theirs.masters == "remainder":
        ties = group.allreduce(theirs.master_weights) - 2 * ours.psi
        check(ties >= 0 and ties % 8 == 0, f"the ties' bytes {ties}")
        extra = 2 * ours.psi - ties
    check(group.allreduce(ours.optimizer_state - theirs.optimizer_state) == extra,
          "offloading changed the sharded state's size")
    # not offloaded, the host holds only the page-locked staging of CuPy parameters (an MPI
    # that is not CUDA-aware)
    check(theirs.host_bytes == theirs.host_scratch and theirs.host_state in (0, None)
          and theirs.device_bytes == theirs.total - theirs.host_scratch,
          f"non-offloaded split: host {theirs.host_bytes}, of which scratch {theirs.host_scratch}")
    if plain.backend == "numpy":
        check(theirs.host_bytes == 0, f"NumPy parameters not offloaded: host {theirs.host_bytes}")
    group.Free()


def check_partial_memory(half, dtype):
    """Half offloaded: the host holds the fp32 master and state of the real elements from the
    cut on, the device the rest; the share is 0.5 to within one bucket's shard."""
    r = half.memory_report()
    owned = half.layout.owned_real(half.shard_rank)
    on_host = round(r.offload_fraction * owned)
    check(r.offloaded and r.device_bytes + r.host_bytes == r.total, "device + host != total")
    check(r.host_state == r.host_bytes_per_param * on_host,
          f"host state {r.host_state} != {r.host_bytes_per_param} x {on_host} elements")
    device_k = bytes_per_param(r.state, dtype)  # fp32 parameters: their own master there
    check(r.optimizer_state - r.host_state == device_k * (owned - on_host),
          f"device state {r.optimizer_state - r.host_state} != {device_k} x {owned - on_host}")
    largest = max(b.shard_size for b in half.layout.buckets)
    check(abs(on_host - owned / 2) <= largest, f"{on_host} of {owned} on the host")
    formula = r.device_formula_bytes + r.host_formula_bytes
    check(abs(formula - r.formula_bytes) < 1e-6 * formula, "device + host formula != formula")


def check_loads_across(label, variant, options, dtype, export):
    """Save on one side, load on the other, train on: the same bits as not stopping (with
    ``export``, half offloaded too)."""
    pairs = [("cpu", None), (None, "cpu")] + ([("half", "cpu"), (None, "half")] if export else [])
    for saver, loader in pairs:
        first = make(variant, options, dtype, saver, groups=False)
        train(first, range(1, 4))
        where = ARGS.directory / f"{label}-{dtype}-{saver}"
        first.save(where)
        if export:
            first.save_consolidated(ARGS.directory / f"{label}-{dtype}-{saver}.safetensors")
        train(first, range(4, 7))
        second = make(variant, options, dtype, loader, groups=False)
        second.load(where)
        train(second, range(4, 7))
        same(state_of(first), state_of(second),
             f"{label} {dtype}: saved with offload={saver!r}, loaded with {loader!r}")
        if export:
            third = make(variant, options, dtype, loader, groups=False)
            third.load_consolidated(ARGS.directory / f"{label}-{dtype}-{saver}.safetensors")
            train(third, range(4, 7))
            same(state_of(first), state_of(third),
                 f"{label} {dtype}: exported with offload={saver!r}, loaded with {loader!r}")


#: Tensors of 8-bit state (4096 elements and more) and one that keeps fp32 state.
MODE_SHAPES = {"big": (5000,), "mat": (65, 70), "vec": (7,)}
MODES = ({"masters": "remainder"}, {"state_dtype": "bfloat16"}, {"state_dtype": "int8"})
#: What one rounding of each kept state is worth, relative to a row's largest element: fp32
#: (remainder masters), bf16's unit, an 8-bit code of a block scaled to its largest.
STORED_UNIT = {None: 5e-6, "bfloat16": 2.0 ** -8, "int8": 1 / 127}


def check_modes(name, variant, options):
    """Remainder masters (the device's part), bf16 and 8-bit state, offloaded half (and whole,
    for the state): the same bits as not offloaded after every step; a half-offloaded save
    loads into a non-offloaded optimizer (bf16 state) and trains on to the same bits."""
    for mode in MODES:
        def build(offload):
            return make(variant, options, "bfloat16", offload, shapes=MODE_SHAPES,
                        bucket_elements=2048, **mode)
        plain = build(None)
        others = [build("half")] + ([] if "masters" in mode else [build("cpu")])
        for key, value in mode.items():  # (the state modes: auto masters, fp32 offloaded)
            check(all(getattr(o.options, key) == value for o in (plain, *others)), str(mode))
        for step in range(1, STEPS + 1):
            for opt in (plain, *others):
                train(opt, [step])
            for opt in others:
                same(state_of(plain), state_of(opt),
                     f"{name} {mode} offload_fraction={opt.offload_fraction} step {step}",
                     stored=STORED_UNIT[mode.get("state_dtype")])
        if mode == {"state_dtype": "bfloat16"}:
            where = ARGS.directory / f"modes-{name}"
            others[0].save(where)
            loaded = build(None)
            loaded.load(where)
            for opt in (others[0], loaded):
                train(opt, [STEPS + 1])
            same(state_of(others[0]), state_of(loaded), f"{name} {mode}: loaded from half",
                 stored=STORED_UNIT["bfloat16"])


def check_params_right_after_a_load(variant, options, dtype, offload):
    """Offloaded, several buckets: save, train on, load (and load the export): the parameters
    read right away, before any step, are the saved ones in every bucket (an evaluation right
    after a resume reads them)."""
    opt = make(variant, options, dtype, offload, groups=False, bucket_elements=64)
    check(len(opt.layout.buckets) >= 4, f"{len(opt.layout.buckets)} buckets: too few")
    train(opt, range(1, 4))
    saved = kit.params_of(opt)
    root = ARGS.directory / f"reload-{dtype}-{offload}"
    export = ARGS.directory / f"reload-{dtype}-{offload}.safetensors"
    opt.save(root)
    opt.save_consolidated(export)
    for load in (lambda: opt.load(root), lambda: opt.load_consolidated(export)):
        train(opt, range(4, 6))
        check(any(not kit.same_bits(opt.params[k], saved[k]) for k in SHAPES),
              "training on changed nothing: the test would prove nothing")
        load()
        for t in opt.layout.tensors:
            bucket = next(b.index for b in opt.layout.buckets
                          if b.offset <= t.offset < b.offset + b.size)
            check(kit.same_bits(opt.params[t.name], saved[t.name]),
                  f"{dtype}: params[{t.name!r}] (bucket {bucket}) right after the load is not "
                  "the saved value")


#: Layouts at the edges: ranks that own only padding; one tensor cut over many buckets (and by
#: the host's start inside a bucket); pieces larger and smaller than a bucket.
EDGES = {"tiny": ({"w": (10,)}, 64), "one": ({"big": (2000,)}, 128),
         "mixed": ({"a": (3,), "b": (700,), "c": (5, 13), "e": (5000,)}, 256)}
SHARES = (0.05, 0.3, 0.95)


def check_edges():
    """Partly offloaded at the edges of the split (shares that put one piece or all but one on
    the host), Adam and two-phase LAMB, stage 1 and 2: the same bits as not offloaded; then a
    save on N ranks with one share loads on one rank with another (checkpoint and export): the
    same state and parameters, bit for bit."""
    cases = 0
    for name in ("adam", "lamb"):
        variant, options = kit.variant_cases(kit.registry()[name])[-1]
        for label, (shapes, bucket) in EDGES.items():
            for engine in ({}, {"shard_gradients": True}):
                def build(share, comm=world):
                    return make(variant, options, "bfloat16", "cpu" if share else None,
                                groups=False, shapes=shapes, comm=comm,
                                bucket_elements=bucket, masters="fp32",
                                **({"offload_fraction": share} if share else {}), **engine)
                plain, parts = build(None), [build(share) for share in SHARES]
                for step in range(1, 4):
                    for opt in (plain, *parts):
                        train(opt, [step])
                    for share, opt in zip(SHARES, parts):
                        same(state_of(plain), state_of(opt),
                             f"{name} {label} {engine} offload_fraction={share} step {step}")
                cases += 1
        shapes, bucket = EDGES["mixed"]
        saver = make(variant, options, "bfloat16", "cpu", groups=False, shapes=shapes,
                     bucket_elements=bucket, offload_fraction=0.3)
        train(saver, [1, 2])
        root, file = ARGS.directory / f"edges-{name}", ARGS.directory / f"edges-{name}.st"
        saver.save(root)
        saver.save_consolidated(file)
        saved, params = kit.rows_by_tensor(saver), kit.params_of(saver)
        if rank == 0:
            for share, load in itertools.product((None, 0.5, 1.0), ("load", "load_consolidated")):
                one = make(variant, options, "bfloat16", "cpu" if share else None, groups=False,
                           shapes=shapes, comm=MPI.COMM_SELF, bucket_elements=64,
                           masters="fp32", **({"offload_fraction": share} if share else {}))
                getattr(one, load)(root if load == "load" else file)
                got, where = kit.rows_by_tensor(one, MPI.COMM_SELF), f"{name} {load} {share}"
                check(all(kit.same_bits(got[r][k], saved[r][k]) for r in saved for k in shapes),
                      f"{where}: saved at 0.3 on {size} ranks, the state differs on 1")
                check(all(kit.same_bits(kit.params_of(one)[k], params[k]) for k in shapes),
                      f"{where}: saved at 0.3 on {size} ranks, the parameters differ on 1")
        world.Barrier()
    return cases


def main():
    cases = staged = 0
    plain = off = None
    for name, entry in kit.registry().items():
        for index, (variant, options) in enumerate(kit.variant_cases(entry)):
            label = f"{name}-{index}"
            # In groups: fp16 takes bf16's path; fp32 keeps a host master of its own
            for dtype in kit.DTYPES if ARGS.group is None else ("float32", "bfloat16"):
                plain, off, half = check_parity(label, variant, options, dtype)
                check_memory(plain, off, dtype)
                check_partial_memory(half, dtype)
                if dtype != "float16":
                    check_loads_across(label, variant, options, dtype, export=index == 0)
                cases += 1
        # stage 2: each rule's last variant (momentum, decoupled decay, ...)
        variant, options = kit.variant_cases(entry)[-1]
        for dtype in ("float32", "bfloat16"):
            check_parity(f"{name} stage 2", variant, options, dtype, shard_gradients=True)
            staged += 1
        check_modes(name, variant, options)
    edges = check_edges() if ARGS.group is None else 0
    adam = kit.registry()["adam"]
    for dtype, offload in (("float32", "cpu"), ("float16", "cpu"), ("float32", "half")):
        check_params_right_after_a_load(*kit.rule_cases(adam)[-1], dtype, offload)
    if rank == 0:
        print(f"OK offload: {cases} cases x {STEPS} steps on {size} ranks, shard groups of "
              f"{plain.shard_group_size} ({ARGS.backend}, host kernel {off.kernel}, "
              f"{off.offload_threads} threads), whole and half; stage 2: {staged} cases; "
              f"modes: {len(MODES)} x {len(kit.registry())} rules; edges: {edges} cases")


if __name__ == "__main__":
    main()
