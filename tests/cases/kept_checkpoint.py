"""A checkpoint written by an earlier release loads bit for bit (tests/data/checkpoint-0.1.0).

    mpiexec -n 2 python -m mpi4py tests/cases/kept_checkpoint.py write DIR
    mpiexec -n N python -m mpi4py tests/cases/kept_checkpoint.py check DIR SCRATCH

``write`` (run once, by the release whose checkpoint is kept) trains AdamW on bf16 parameters
with its remainder masters, 8-bit state and 8-bit gathers, two param groups, for 3 steps on 2
ranks; saves a sharded checkpoint under ``DIR`` and the consolidated export ``DIR/export``;
then takes one more step and writes each rank's parameters after it (``DIR/next.npz``).
``check`` loads the kept checkpoint on N ranks into an optimizer built with other learning
rates, re-exported to ``SCRATCH``: the parameters are the saved ones, and the masters and the
tensors kept in fp32 are the kept export's; on 2 ranks (the saving world size, where the docs
promise bit for bit) the re-export is byte for byte the kept export and the next step is
bitwise the one the writing release took. Only the public interface is used, so that any
release runs ``write``.
"""

import argparse
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroAdamW

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
SHAPES = {"w": (64, 64), "b": (64,), "s": (), "v": (7, 3)}
BF16 = ml_dtypes.bfloat16


def build(lr):
    rng = np.random.default_rng(7)
    values = {k: rng.standard_normal(s).astype(np.float32).astype(BF16) for k, s in SHAPES.items()}
    groups = [{"params": {k: values[k] for k in ("w", "b")}, "lr": lr},
              {"params": {k: values[k] for k in ("s", "v")}, "lr": lr / 2, "weight_decay": 0.0}]
    return ZeroAdamW(groups, world, lr=lr, weight_decay=0.05, state_dtype="int8",
                     gather_dtype="int8")


def step(opt, index, writer_rank):
    """One step on the gradients the writing run's rank ``writer_rank`` had at step ``index``."""
    rng = np.random.default_rng([index, writer_rank])
    for name, shape in SHAPES.items():
        opt.grads[name][...] = rng.standard_normal(shape).astype(np.float32).astype(BF16)
    opt.step()


def params_of(opt):
    return {k: np.asarray(opt.params[k]).view(np.uint16).copy() for k in SHAPES}


def tensors(path):
    """A safetensors file's tensors by name, as bytes."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    return {k: body[v["data_offsets"][0] : v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def fail(message):
    print(f"rank {rank} of {size}: {message}", file=sys.stderr, flush=True)
    world.Abort(1)


parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["write", "check"])
parser.add_argument("directory", type=Path)
parser.add_argument("scratch", type=Path, nargs="?", help="check: where the re-export goes")
args = parser.parse_args()

if args.mode == "write":
    opt = build(1e-2)
    for index in range(3):
        step(opt, index, rank)
    opt.save(args.directory)
    opt.save_consolidated(args.directory / "export")
    saved = params_of(opt)
    step(opt, 3, rank)
    after = world.gather(params_of(opt), root=0)
    if rank == 0:
        np.savez(args.directory / "next.npz",
                 **{f"saved/{k}": v for k, v in saved.items()},
                 **{f"rank{r}/{k}": v for r, p in enumerate(after) for k, v in p.items()})
    opt.close()
else:
    kept = np.load(args.directory / "next.npz")
    opt = build(3e-3)
    opt.load(args.directory)
    for name, bits in params_of(opt).items():
        if not np.array_equal(bits, kept[f"saved/{name}"]):
            fail(f"{name}: the loaded parameters are not the saved ones")
    out = args.scratch / f"reexport-{size}.safetensors"
    opt.save_consolidated(out)
    if rank == 0:
        if size == 2 and out.read_bytes() != (args.directory / "export").read_bytes():
            fail("the re-export differs from the kept export")
        kept_rows, rows = tensors(args.directory / "export"), tensors(out)
        exact = [k for k in rows if k.startswith("master/") or not k.endswith("/w")]
        if len(exact) < 4 or [k for k in exact if kept_rows[k] != rows[k]]:
            fail("the masters, or a tensor kept in fp32, differ from the kept export's")
    if size == 2:
        step(opt, 3, rank)
        for name, bits in params_of(opt).items():
            if not np.array_equal(bits, kept[f"rank{rank}/{name}"]):
                fail(f"{name}: the step after the load differs from the writing release's")
    opt.close()
    if rank == 0:
        print(f"OK the kept checkpoint loads bit for bit on {size} ranks", flush=True)
