"""zero1_mpi.jax on N ranks == one process running the same rule on the averaged gradients.

``parity``: a pytree of nested dicts, lists and tuples with odd-sized leaves (some not 64-byte
aligned), gradients from a jit-compiled ``jax.value_and_grad`` at ``opt.params()``; AdamW in
float32 and bfloat16 with param groups (by predicate, by names), SGD with momentum through
``accumulate()``; against the float64 references of tests/reference.py. ``errors``: a wrong
pytree, shape or dtype on one rank raises ValueError on every rank with nothing updated, and
so do bad constructor arguments. ``flax``: a flax.linen model against ``optax.adamw``. ``int8``: 8-bit reduction and
gathers through the binding (the same bytes on every rank, near 16-bit collectives).

    mpiexec -n N python -m mpi4py tests/cases/jax_adapter.py parity|errors|flax ...
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax
import jax.numpy as jnp
import numpy as np
from casekit import check
from mpi4py import MPI
from reference import ReferenceAdam, ReferenceSGD, close_to_reference

from zero1_mpi import ZeroAdamW
from zero1_mpi.jax import ZeroOptimizer

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS = 6
NEW_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 5)


def init_tree():
    """Nested dicts, a list and a tuple; 65, 13, 208, 48, 3, 1 and 3 elements."""
    rng = np.random.default_rng(7)

    def leaf(*shape, shift=0.0):
        return jnp.asarray((rng.standard_normal(shape) * 0.5 + shift).astype(np.float32))

    return {"dense": {"kernel": leaf(5, 13), "bias": leaf(13)},
            "blocks": [{"w": leaf(13, 16)}, {"w": leaf(16, 3), "b": leaf(3)}],
            "pair": (leaf(shift=1.5), leaf(3))}  # a scale well away from 0


def loss_fn(p, x):
    p = jax.tree.map(lambda v: v.astype(jnp.float32), p)
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    h = jnp.tanh(h @ p["blocks"][0]["w"])
    out = (h @ p["blocks"][1]["w"] + p["blocks"][1]["b"]) * p["pair"][0] + p["pair"][1]
    return jnp.mean((out - 1.0) ** 2)


loss_and_grads = jax.jit(jax.value_and_grad(loss_fn))


def batch(r, step):
    rng = np.random.default_rng([3, step, r])
    return jnp.asarray(rng.standard_normal((4, 5)).astype(np.float32))


def flat64(tree, names):
    return dict(zip(names, (np.asarray(v, np.float64) for v in jax.tree.leaves(tree))))


CONFIGS = [  # dtype, rule, options, groups (as the adapter takes them, as the reference does)
    ("float32", "adamw", {"lr": 1e-2, "weight_decay": 0.1, "max_grad_norm": 1.0},
     [{"params": lambda name, leaf: leaf.ndim < 2, "weight_decay": 0.0, "lr": 5e-3}],
     lambda names: [{"names": [n for n in names if n not in VECTORS]},
                    {"names": VECTORS, "weight_decay": 0.0, "lr": 5e-3}]),
    ("bfloat16", ZeroAdamW, {"lr": 1e-2, "weight_decay": 0.1},
     [{"params": ["dense/kernel", "pair/0"], "weight_decay": 0.0}],
     lambda names: [{"names": [n for n in names if n not in ("dense/kernel", "pair/0")]},
                    {"names": ["dense/kernel", "pair/0"], "weight_decay": 0.0}]),
    ("float32", "sgd", {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.01}, None, None),
]
VECTORS = ["blocks/1/b", "dense/bias", "pair/0", "pair/1"]


def parity(**engine):
    """``engine``: more options (``stage2`` passes ``shard_gradients``: the gradients are
    handed over leaf by leaf, the micro-batches summed in an fp32 gradient shard)."""
    for dtype, rule, options, groups, ref_groups in CONFIGS:
        opt = ZeroOptimizer(init_tree(), rule, comm, groups=groups, param_dtype=dtype,
                            bucket_elements=64, **options, **engine)
        names = opt.names
        init = flat64(init_tree(), names)
        ref_options = {k: v for k, v in options.items() if k != "momentum" or rule == "sgd"}
        if rule == "sgd":
            ref = ReferenceSGD(init, **ref_options)
        else:
            ref = ReferenceAdam(init, decoupled=True, groups=ref_groups(names), **ref_options)
        for step in range(STEPS):
            params = opt.params()
            check(jax.tree.structure(params) == jax.tree.structure(init_tree()), "structure")
            check(all(v.dtype == np.dtype(dtype) for v in jax.tree.leaves(params)), "dtype")
            _, grads = loss_and_grads(params, batch(rank, step))
            accumulated = 2 if rule == "sgd" else 1  # twice the gradients: accumulate() + step()
            if accumulated == 2:
                opt.accumulate(grads)
            opt.step(grads)
            every = comm.allgather(flat64(grads, names))
            ref.step({k: accumulated * np.mean([e[k] for e in every], axis=0) for k in names})
            now = flat64(opt.params(), names)
            for k in names:
                ok, err = close_to_reference(np.asarray(now[k]).astype(dtype), ref.params[k],
                                             dtype)
                check(ok, f"{dtype} {rule}: step {step}, {k!r} off by {err} on rank {rank} of "
                          f"{size}")
        done = opt.zero_copy()
        check(done["grads"] == names, f"gradients copied before the one copy: {done}")
        check(set(done["aligned"]) < set(names), f"every leaf aligned, none tested odd: {done}")
        check(set(done["aligned"]) <= set(done["params"]), f"aligned ones copied: {done}")
        if NEW_JAX:  # JAX 0.4.30 also aliased some unaligned addresses
            check(done["params"] == done["aligned"], f"zero-copy where not aligned: {done}")
        # whole 64-byte leaves of the first group come first, so they start aligned
        itemsize = np.dtype(dtype).itemsize
        first = opt.param_groups[0]["names"]
        whole = [n for n in first if init[n].size * itemsize % 64 == 0]
        check(list(first[:len(whole)]) == whole and set(whole) <= set(done["aligned"]),
              f"{first}: {done}")
    if rank == 0:
        print(f"OK jax adapter parity{' (stage 2)' if engine else ''}: {len(CONFIGS)} configs "
              f"x {STEPS} steps on {size} ranks")


def expect_error(call, *texts):
    """``call()`` raises ValueError/TypeError on this rank with all ``texts`` in its message."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        check(all(t in str(exc) for t in texts), f"rank {rank}: {exc!r} lacks {texts}")
        return
    raise AssertionError(f"rank {rank}: no error, expected {texts}")


def errors():
    check(size >= 2, "the errors case needs 2 or more ranks")
    last = size - 1
    opt = ZeroOptimizer(init_tree(), "sgd", comm, lr=0.1)
    before = flat64(opt.params(), opt.names)
    _, good = loss_and_grads(opt.params(), batch(rank, 0))

    lacking = {**good, "pair": good["pair"][:1]} if rank == last else good
    expect_error(lambda: opt.step(lacking), "step(): grads is not a pytree",
                 "lacks ['pair/1']", f"detected on rank {last}")
    wrong = jax.tree.map(lambda g: g, good)
    if rank == 0:
        wrong["dense"]["bias"] = jnp.zeros(12)
    expect_error(lambda: opt.step(wrong), "grads['dense/bias'] has shape (12,)",
                 "detected on rank 0")
    expect_error(lambda: opt.step(jax.tree.map(lambda g: np.asarray(g).astype(np.int32), good)),
                 "has dtype int32", "or float32")
    opt.accumulate(good)
    opt.accumulate(jax.tree.map(lambda g: jnp.asarray(np.asarray(g, np.float16)), good)
                   if rank == last else good)
    expect_error(opt.step, "accumulate(): grads['blocks/0/w'] has dtype float16",
                 f"detected on rank {last}")
    expect_error(lambda: jax.jit(opt.step)(good), "is a tracer", "outside jax.jit")
    check(opt.step_count == 0, f"a failed step counted: {opt.step_count}")
    after = flat64(opt.params(), opt.names)
    check(all(np.array_equal(before[k], after[k]) for k in before), "a failed step updated")

    # The failed steps dropped their gradients: one good step now == one step of a fresh one.
    opt.step(good)
    fresh = ZeroOptimizer(init_tree(), "sgd", comm, lr=0.1)
    fresh.step(good)
    check(all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(opt.params()),
                                                   jax.tree.leaves(fresh.params()))),
          "the failed steps left gradients behind")

    tree = init_tree()
    expect_error(lambda: ZeroOptimizer(tree, "adamw" if rank else "adamx", comm),
                 "unknown update rule 'adamx'", "detected on rank 0")
    expect_error(lambda: ZeroOptimizer({"a/b": tree["pair"][1], "a": {"b": tree["pair"][1]}},
                                       "adamw", comm), "same name 'a/b'")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, groups=[{"params": ["dense/w"]}]),
                 "lacks: ['dense/w']")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, groups={"params": ["pair/0"]}),
                 "groups must be a list")
    odd = {**tree, "pair": (tree["pair"][0], np.arange(3))} if rank == last else tree
    expect_error(lambda: ZeroOptimizer(odd, "adamw", comm), "'pair/1'", "floating point",
                 f"detected on rank {last}")
    if rank == 0:
        print(f"OK jax adapter errors on {size} ranks")


def flax_model():
    import flax.linen as nn
    import optax
    from flax.core import FrozenDict

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(jnp.tanh(nn.Dense(13)(x)))
            return nn.Dense(3)(x)

    model = MLP()
    # Flax's names and shapes (traced, not run), filled from NumPy: init would compile a lot
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 5)))
    rng = np.random.default_rng(5)
    variables = FrozenDict(jax.tree.map(
        lambda s: jnp.asarray((rng.standard_normal(s.shape) * 0.5).astype(np.float32)), shapes))

    def loss(variables, x, y):
        logits = model.apply(variables, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step_fn = jax.jit(jax.value_and_grad(loss))

    def data(r, step):
        rng = np.random.default_rng([11, step, r])
        return (jnp.asarray(rng.standard_normal((8, 5)).astype(np.float32)),
                jnp.asarray(rng.integers(0, 3, 8).astype(np.int32)))

    no_decay = lambda name, leaf: leaf.ndim < 2
    opt = ZeroOptimizer(variables, "adamw", comm, lr=2e-2, weight_decay=0.1,
                        groups=[{"params": no_decay, "weight_decay": 0.0}])
    check("params/Dense_0/kernel" in opt.names and "params/LayerNorm_0/scale" in opt.names,
          f"names: {opt.names}")
    check(isinstance(opt.params(), FrozenDict), "params() lost the FrozenDict")
    mask = jax.tree.map(lambda leaf: leaf.ndim >= 2, variables)
    tx = optax.adamw(2e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, mask=mask)

    @jax.jit
    def reference_update(ref, state, every):
        """One process: optax on the gradients averaged over the ranks' batches."""
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *every)
        updates, state = tx.update(mean, state, ref)
        return optax.apply_updates(ref, updates), state

    ref, state = variables, jax.jit(tx.init)(variables)
    worst = 0.0
    for step in range(10):
        _, grads = step_fn(opt.params(), *data(rank, step))
        opt.step(grads)
        every = [step_fn(ref, *data(r, step))[1] for r in range(size)]
        ref, state = reference_update(ref, state, every)
        for ours, theirs in zip(jax.tree.leaves(opt.params()), jax.tree.leaves(ref)):
            diff = np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64)).max()
            worst = max(worst, float(diff))
    # a step moves a parameter by up to lr = 2e-2: float32 roundings differ by 1e-4 of that
    check(worst < 1e-5, f"flax + zero1_mpi.jax differ from optax.adamw by {worst}")
    if rank == 0:
        print(f"OK jax adapter flax: 10 steps on {size} ranks, worst difference {worst:.1e}")


def int8_wire():
    """8-bit reduction (with error feedback) and gathers through the binding: every rank's
    parameters are the same bytes, within 2% (relative L2) of 16-bit collectives' after the
    steps."""
    runs = {}
    for wire in ({}, {"reduce_dtype": "int8", "gather_dtype": "int8", "error_feedback": True}):
        opt = ZeroOptimizer(init_tree(), "adamw", comm, param_dtype="bfloat16", lr=1e-2,
                            bucket_elements=64, **wire)
        for step in range(STEPS):
            _, grads = loss_and_grads(opt.params(), batch(rank, step))
            opt.step(grads)
        now = flat64(opt.params(), opt.names)
        flat = np.concatenate([np.ravel(now[k]) for k in opt.names])
        check(all(np.array_equal(flat, other) for other in comm.allgather(flat)),
              f"{wire}: the parameters differ between ranks")
        runs[bool(wire)] = flat
    err = np.linalg.norm(runs[True] - runs[False]) / np.linalg.norm(runs[False])
    check(0 < err < 0.02, f"int8 collectives {err:.3g} (relative L2) from 16-bit ones")
    if rank == 0:
        print(f"OK jax adapter int8 wire on {size} ranks: {err:.2e} from 16-bit")


if __name__ == "__main__":
    for part in sys.argv[1:]:
        {"parity": parity, "errors": errors, "flax": flax_model, "int8": int8_wire,
         "stage2": lambda: parity(shard_gradients=True, grad_shard_dtype="float32")}[part]()
