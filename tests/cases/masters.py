"""Remainder masters (``masters="remainder"``) against fp32 masters, bit for bit, on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/masters.py DIRECTORY [rules] [ties] [checkpoint]
        [ledger]

``rules``: every rule of the registry (each variant), bf16 parameters in two param groups,
stage 1 (plain, and overlapped: ``grads_ready`` with ``step(wait=False)``) and stage 2, flat and
in shard groups of 2 and of 3 where they divide N (N > K): after every step the parameters,
masters and state equal those of ``masters="fp32"``, bit for bit, with ties among the initial
masters. ``ties``: SGD
steps that land masters on ties (half a bf16 step above an even value) and off them again.
``checkpoint``: a remainder run's checkpoint (and consolidated file) loads into an fp32-master
optimizer on one rank and the other way, to the bit. ``ledger``: ``memory_report`` counts 2
bytes a master and 8 a tie, and its formula is Adam's 2Ψ+2Ψ+10Ψ/N.
"""

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, rank, size, world
from zero1_mpi import ZeroAdamW, ZeroSGD
from zero1_mpi.kernels.backend import BFLOAT16

parser = argparse.ArgumentParser()
parser.add_argument("directory", type=Path)
parser.add_argument("sub_cases", nargs="*")
ARGS = parser.parse_args()
SHAPES = {"scalar": (), "vec": (7,), "mat": (5, 13), "long": (700,), "bias": (3,)}
STEPS = 4


def ties_everywhere(opt) -> int:
    return world.allreduce(int(opt.state.masters.ties.size))


def same_state(a, b, where) -> None:
    for k in a.params:
        check(kit.same_bits(a.params[k], b.params[k]), f"{where}: params {k}")
    rows_a, rows_b = kit.state_rows(a), kit.state_rows(b)
    for row in a.state_rows:
        check(kit.same_bits(rows_a[row], rows_b[row]), f"{where}: {row}")


def make(variant, options, masters, stage2=False, k=None, on=world):
    init = kit.with_ties(kit.init_values(SHAPES))
    params = kit.groups_of(init, options)
    engine = {"bucket_elements": 64, "max_grad_norm": 5.0, "param_dtype": "bfloat16",
              "masters": masters, "shard_gradients": stage2, "shard_group_size": k}
    return kit.build(variant, params, on, options, **engine)


def rules():
    groups = [None] + [k for k in (2, 3) if size % k == 0 and size > k]
    count = 0
    for entry in kit.registry().values():
        for variant, options in kit.variant_cases(entry):
            for k in groups:
                for mode in ("stage1", "overlap", "stage2"):
                    fp32 = make(variant, options, "fp32", mode == "stage2", k)
                    rem = make(variant, options, "remainder", mode == "stage2", k)
                    check(rem.options.masters == "remainder" and ties_everywhere(rem) > 0)
                    same_state(fp32, rem, f"{entry.name} {mode} k={k} seeded")
                    for step in range(STEPS):
                        grads = kit.grads_of(rank, step, SHAPES, BFLOAT16)
                        kit.hand_over(fp32, grads)
                        fp32.step()
                        if mode == "overlap":
                            for name in reversed(SHAPES):
                                rem.grads[name][...] = np.asarray(grads[name], np.float32) \
                                    * rem.loss_scale
                                rem.grads_ready([name])
                            rem.step(wait=step % 2 == 0)
                        else:
                            kit.hand_over(rem, grads)
                            rem.step()
                        same_state(fp32, rem, f"{entry.name} {variant.settings()} {mode} "
                                              f"k={k} step {step}")
                    count += 1
    print(f"rank {rank}: rules: {count} cases bit for bit") if rank == 0 else None


def ties():
    """SGD without momentum, lr 1: each step moves a master by exactly half a bf16 step (a
    power of two), onto a tie above its even parameter, then back, then onto it again."""
    n = 1000
    init = {"w": np.where(np.arange(n) % 2, 1.0, -4.0).astype(np.float32)}
    half = np.abs(init["w"]) * 2.0**-8  # half a bf16 step of 1.0 (and of 4.0, scaled)
    opts = [ZeroSGD(dict(init), world, lr=1.0, momentum=0.0, param_dtype="bfloat16",
                    masters=m, bucket_elements=128) for m in ("fp32", "remainder")]
    seen = []
    for step, direction in enumerate((-1.0, 0.0, 1.0, -1.0, 0.0)):
        for opt in opts:  # the same gradient on every rank: the mean is it, exactly
            opt.grads["w"][...] = (direction * np.sign(init["w"]) * half).astype(BFLOAT16)
            opt.step()
        same_state(*opts, f"ties step {step}")
        seen.append(ties_everywhere(opts[1]))
    check(seen == [n, n, 0, n, n], f"ties per step {seen}")  # every master on a tie, or none
    master = kit.rows_by_tensor(opts[1], world)["master"]["w"]
    check(kit.same_bits(master, init["w"] + np.sign(init["w"]) * half), "masters on the ties")
    print(f"rank {rank}: ties: {seen} ties made and dropped by the kernel") if rank == 0 else None


def checkpoint():
    """Both directions between the modes, and from N ranks to one."""
    for saver, loader in (("remainder", "fp32"), ("fp32", "remainder")):
        init = kit.with_ties(kit.init_values(SHAPES))
        opt = ZeroAdamW(dict(init), world, lr=1e-2, param_dtype="bfloat16", masters=saver,
                        bucket_elements=64)
        kit.train(opt, range(3), SHAPES)
        where = ARGS.directory / f"from-{saver}"
        opt.save(where)
        opt.save_consolidated(ARGS.directory / f"{saver}.safetensors")
        full = kit.rows_by_tensor(opt, world)
        for load in ("load", "load_consolidated"):
            if rank == 0:  # one rank alone: another world size, the other mode
                other = ZeroAdamW(dict(init), MPI.COMM_SELF, lr=1e-2, param_dtype="bfloat16",
                                  masters=loader, bucket_elements=64)
                getattr(other, load)(where if load == "load" else
                                     ARGS.directory / f"{saver}.safetensors")
                got = kit.rows_by_tensor(other, MPI.COMM_SELF)
                for row in ("master", "exp_avg", "exp_avg_sq", "param"):
                    for k in SHAPES:
                        check(kit.same_bits(got[row][k], full[row][k]),
                              f"{saver} -> {loader} {load} {row} {k}")
                for k in SHAPES:
                    check(kit.same_bits(other.params[k], opt.params[k]), f"{load} params {k}")
                kit.train(other, range(3, 5), SHAPES)  # and it steps on
        world.Barrier()
    print(f"rank {rank}: checkpoint: both ways, at 1 rank from {size}") if rank == 0 else None


def ledger():
    opt = ZeroAdamW(kit.with_ties(kit.init_values(SHAPES)), world, param_dtype="bfloat16",
                    bucket_elements=64)
    kit.train(opt, range(2), SHAPES)
    r = opt.memory_report()
    owned = opt.layout.owned_real(opt.shard_rank)
    ties = opt.state.masters.ties.size
    check(r.masters == "remainder" and r.bytes_per_param == 10, str(r))
    check(r.master_weights == 2 * owned + 8 * ties, f"{r.master_weights} {owned} {ties}")
    check(r.formula_label == "2Ψ+2Ψ+10Ψ/N", r.formula_label)
    print(f"rank {rank}: ledger: 2 bytes a master, 8 a tie") if rank == 0 else None


kit.sub_cases({"rules": rules, "ties": ties, "checkpoint": checkpoint, "ledger": ledger},
              ARGS.sub_cases)
if rank == 0:
    print(f"OK masters on {size} ranks")
