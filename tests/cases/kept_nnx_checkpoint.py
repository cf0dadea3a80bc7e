"""A flax.nnx checkpoint written by 0.1.0, whose leaf names end in ``/value``, loads bit for
bit (tests/data/nnx-checkpoint-0.1.0).

    mpiexec -n 2 python -m mpi4py tests/cases/kept_nnx_checkpoint.py write DIR
    mpiexec -n N python -m mpi4py tests/cases/kept_nnx_checkpoint.py check DIR

``write`` (run once, by 0.1.0) trains AdamW on an nnx model's ``nnx.Param`` State for 3 steps
on 2 ranks, the biases in a group without weight decay chosen by 0.1.0's names
(``name.endswith("bias/value")``), saves a sharded checkpoint under ``DIR`` and the
consolidated export ``DIR/export.safetensors``, writes the
parameters (``DIR/params.npz``), takes one more step and writes them again
(``DIR/next.npz``; leaves by their index in the tree, as the names changed). ``check`` builds
the same optimizer with the same selector (0.1.0's names: taken with a DeprecationWarning),
loads the checkpoint, and into another the export (0.1.0's names: taken with a
DeprecationWarning): the parameters are the saved ones bit for bit, and on 2 ranks the next
step is bitwise the one 0.1.0 took. Only the
public interface is used, so that any release runs ``write``.
"""

import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from mpi4py import MPI

from zero1_mpi.jax import ZeroOptimizer

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
WRITER_RANKS = 2


class Model(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(24, 16, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)


def build():
    state = nnx.state(Model(nnx.Rngs(3)), nnx.Param)
    groups = [{"params": lambda name, leaf: name.endswith("bias/value"), "weight_decay": 0.0}]
    return ZeroOptimizer(state, "adamw", world, groups=groups, lr=1e-2, weight_decay=0.1)


def grads(opt, index, writer_rank):
    """The gradients the writing run's rank ``writer_rank`` had at step ``index``."""
    leaves, treedef = jax.tree_util.tree_flatten(opt.params())
    rng = np.random.default_rng([index, writer_rank])
    return treedef.unflatten([rng.standard_normal(np.shape(x)).astype(np.float32)
                              for x in leaves])


def step(opt, index):
    """One step on the mean of the writing run's two ranks' gradients: the same update at any
    world size (each rank gives the mean here, which the ranks then average)."""
    a, b = (grads(opt, index, r) for r in range(WRITER_RANKS))
    if size == WRITER_RANKS:
        opt.step(a if rank == 0 else b)
    else:
        opt.step(jax.tree_util.tree_map(lambda x, y: (np.asarray(x) + np.asarray(y)) / 2, a, b))


def leaves_of(opt):
    return {str(i): np.asarray(x).copy() for i, x in enumerate(jax.tree_util.tree_leaves(
        opt.params()))}


def write(directory: Path):
    assert size == WRITER_RANKS
    opt = build()
    for index in range(3):
        step(opt, index)
    opt.save(directory)
    opt.save_consolidated(directory / "export.safetensors")
    if rank == 0:
        np.savez(directory / "params.npz", **leaves_of(opt))
    step(opt, 3)
    if rank == 0:
        np.savez(directory / "next.npz", **leaves_of(opt))
        print(f"wrote {directory}")


def check(directory: Path):
    for way, load in (("checkpoint", lambda o: o.load(directory)),
                      ("export", lambda o: o.load_consolidated(directory / "export.safetensors"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = build()
            load(opt)
        messages = [str(w.message) for w in caught
                    if issubclass(w.category, DeprecationWarning)]
        if not (any(m.startswith("groups[0]['params'] uses 0.1.0's") for m in messages)
                and any("holds 0.1.0's names of" in m for m in messages)):
            raise AssertionError(f"rank {rank}: {way}: 0.1.0's names taken without a "
                                 f"warning: {messages}")
        saved = np.load(directory / "params.npz")
        for key, value in leaves_of(opt).items():
            if value.tobytes() != saved[key].tobytes():
                raise AssertionError(f"rank {rank}: {way}: leaf {key} differs from the saved")
        if size == WRITER_RANKS:  # the saving world size: the next step bit for bit
            step(opt, 3)
            after = np.load(directory / "next.npz")
            for key, value in leaves_of(opt).items():
                if value.tobytes() != after[key].tobytes():
                    raise AssertionError(f"rank {rank}: {way}: leaf {key} after the next step")
        opt.close()
    if rank == 0:
        print(f"OK 0.1.0's nnx checkpoint and export loaded on {size} ranks")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](Path(sys.argv[2]))
