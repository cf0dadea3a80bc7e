"""The complete rule file of docs/update-rules.md ("Adding an update rule"), run as written: N
ranks against one process running the same rule on the averaged gradients (float64), in fp32
and bf16, with clipping; then a checkpoint saved on N ranks loads on one (rank 0, alone) and
steps on as the N ranks do. The block is written to ``DIR/rank<r>/sign_momentum.py`` and imported.

    mpiexec -n N python -m mpi4py tests/cases/readme_rule.py DIR
"""

import importlib
import re
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from expect import check
from reference import clipped, close_to_reference
from zero1_mpi.backend import resolve_dtype

PAGE = Path(__file__).resolve().parents[2] / "docs" / "update-rules.md"
section = PAGE.read_text().split("## Adding an update rule", 1)[1]
code = re.search(r"```python\n(.*?)```", section, re.S).group(1)

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
home = Path(sys.argv[1]) / f"rank{rank}"
home.mkdir(parents=True, exist_ok=True)
(home / "sign_momentum.py").write_text(code)
sys.path.insert(0, str(home))
ZeroSignMomentum = importlib.import_module("sign_momentum").ZeroSignMomentum
SHAPES = {"w": (7, 5), "b": (5,), "s": ()}
LR, BETA, STEPS = 1e-2, 0.8, 6


def init():
    return {k: np.random.default_rng([3, len(k)]).standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}


def grads(r, step):
    rng = np.random.default_rng([7, step, r])
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def run(dtype_name, directory):
    dtype = resolve_dtype(dtype_name)
    opt = ZeroSignMomentum(init(), comm, lr=LR, beta=BETA, param_dtype=dtype_name,
                           max_grad_norm=1.0, bucket_elements=1)
    params = {k: v.astype(np.float64) for k, v in init().items()}
    m = {k: np.zeros(s) for k, s in SHAPES.items()}
    for step in range(1, STEPS + 1):
        for k, g in grads(rank, step).items():
            opt.grads[k][...] = g.astype(dtype)
        opt.step()
        every = [grads(r, step) for r in range(size)]
        mean = {k: np.mean([e[k].astype(dtype).astype(np.float64) for e in every], axis=0)
                for k in SHAPES}
        mean, _ = clipped(mean, 1.0)
        for k in SHAPES:
            m[k] = BETA * m[k] + (1 - BETA) * mean[k]
            params[k] -= LR * np.sign(m[k])
            ok, err = close_to_reference(opt.params[k], params[k], dtype)
            check(ok, f"{dtype_name} step {step} {k!r}: off by {err} on rank {rank} of {size}")
    saved = opt.save(directory / dtype_name)
    for k, g in grads(rank, STEPS + 1).items():  # one more step, here and after the load
        opt.grads[k][...] = g.astype(dtype)
    opt.step()
    if rank == 0:  # the checkpoint of N ranks, loaded on one, steps on the mean gradient
        alone = ZeroSignMomentum(init(), MPI.COMM_SELF, lr=LR, beta=BETA,
                                 param_dtype=dtype_name, max_grad_norm=1.0, bucket_elements=1)
        alone.load(saved)
        every = [grads(r, STEPS + 1) for r in range(size)]
        for k in SHAPES:
            alone.grads[k][...] = np.mean([e[k].astype(dtype).astype(np.float64)
                                           for e in every], axis=0).astype(dtype)
        alone.step()
        for k in SHAPES:
            ok, err = close_to_reference(alone.params[k], np.asarray(opt.params[k], np.float64),
                                         dtype)
            check(ok, f"{dtype_name}: {k!r} off by {err} after loading {size} ranks' "
                      "checkpoint on one and stepping")
    comm.Barrier()

if __name__ == "__main__":
    for dtype_name in ("float32", "bfloat16"):
        run(dtype_name, Path(sys.argv[1]))
    if rank == 0:
        print(f"OK the docs' rule on {size} ranks")
