"""The generated Numba passes on N ranks: the NumPy and Numba kernels give the same bits.

    mpiexec -n N python -m mpi4py tests/cases/generated_kernels.py

Each rule of the registry (its first variant; LAMB's two phases do not take the one pass),
bf16 parameters with remainder and fp32 masters, bf16 and 8-bit state, stage 1 and stage 2,
in two param groups: four steps with ``ZERO1_MPI_KERNEL=numpy``, then with ``numba``; the
parameters and every state row must match bit for bit. On N ranks the shards start inside
tensors (the 8-bit state's blocks start at each rank's piece) and the initial masters hold
ties (half a bf16 step above an even parameter).
"""

import os

import numpy as np

import casekit as kit
from casekit import check, rank, size
from zero1_mpi.kernels.backend import BFLOAT16

SHAPES = {"emb": (37, 300), "w": (301, 29), "bias": (3,), "long": (9001,)}


def run(kernel, variant, options, **engine):
    os.environ["ZERO1_MPI_KERNEL"] = kernel
    opt = kit.build(variant, kit.groups_of(kit.with_ties(kit.init_values(SHAPES)), options),
                    kit.world, options, bucket_elements=8192, **engine)
    check(opt.kernel == kernel, f"kernel {opt.kernel}, not {kernel}")
    seen = []
    for step in range(4):
        kit.hand_over(opt, kit.grads_of(rank, step, SHAPES, BFLOAT16))
        opt.step()
        rows = kit.state_rows(opt)
        seen.append(({k: np.array(v) for k, v in opt.params.items()},
                     {row: np.array(rows[row]) for row in opt.state_rows}))
    opt.close()
    return seen


def main():
    cases = 0
    for entry in kit.registry().values():
        if entry.name == "lamb":
            continue
        variant, options = next(iter(kit.variant_cases(entry)))
        for masters in ("remainder", "fp32"):
            for state_dtype in ("bfloat16", "int8"):
                for stage2 in (False, True):
                    engine = {"param_dtype": "bfloat16", "masters": masters,
                              "state_dtype": state_dtype, "shard_gradients": stage2,
                              "max_grad_norm": 5.0}
                    want = run("numpy", variant, options, **engine)
                    got = run("numba", variant, options, **engine)
                    where = f"{entry.name} {masters} {state_dtype} stage2={stage2}"
                    for step, ((pa, ra), (pb, rb)) in enumerate(zip(want, got)):
                        for k in pa:
                            check(kit.same_bits(pa[k], pb[k]), f"{where} step {step}: {k}")
                        for row in ra:
                            check(kit.same_bits(ra[row], rb[row]), f"{where} step {step}: {row}")
                    cases += 1
    check(cases >= 12, f"only {cases} cases")
    if rank == 0:
        print(f"OK generated_kernels on {size} ranks ({cases} cases)", flush=True)


if __name__ == "__main__":
    main()
