"""zero1_mpi.jax on N ranks == one process running the same rule on the averaged gradients.

``parity``: a pytree of nested dicts, lists and tuples with odd-sized leaves (some not 64-byte
aligned), gradients from a jit-compiled ``jax.value_and_grad`` at ``opt.params()``; AdamW in
float32 and bfloat16 with param groups (by predicate, by names), SGD with momentum through
``accumulate()``; against the float64 references of tests/reference.py. ``errors``: a wrong
pytree, shape or dtype on one rank raises ValueError on every rank with nothing updated, and
so do bad constructor arguments, leaves that are not parameters, bad masks and a failing
schedule. ``flax``: a flax.linen model against ``optax.adamw``. ``nnx``: a flax.nnx attention
model with an optax schedule and mask against ``optax.adamw(schedule, mask=...)``. ``resume``
(a directory): the schedule goes on bit for bit after ``load``, ``load_consolidated`` and a
load on one rank. ``int8``: 8-bit reduction and gathers through the binding (the same bytes
on every rank, near 16-bit collectives; warnings are errors).

    mpiexec -n N python -m mpi4py tests/cases/jax_adapter.py parity|errors|flax|nnx|int8|resume DIR ...
"""

import functools
import os
import sys
import warnings
from pathlib import Path

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
    expect_error(lambda: ZeroOptimizer(odd, "adamw", comm), "'pair/1'", "floating-point",
                 f"detected on rank {last}")
    # leaves that are not parameters (an nnx model's RNG state, a Python number), named
    keyed = {**tree, "rng": {"key": jax.random.key(0), "count": jnp.uint32(0)}, "t": 0.5}
    expect_error(lambda: ZeroOptimizer(keyed if rank == last else tree, "adamw", comm),
                 "'rng/count' (dtype uint32)", "'rng/key' (a PRNG key array", "'t' (a Python "
                 "float)", "nnx.split(model, nnx.Param, ...)", f"detected on rank {last}")
    # masks: not bools, not like params; optax's options zero1_mpi has not
    every = jax.tree.map(lambda leaf: True, tree)
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, mask={**every, "pair": 1}),
                 "mask['pair'] is 1", "True (weight decay applies) or False")
    mask = {"dense": False, "blocks": True} if rank == 0 else {"dense": False, "blocks": True,
                                                                "pair": True}
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, mask=mask),
                 "mask is not a pytree like params", "no value for ['pair/0', 'pair/1']",
                 "detected on rank 0")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, mask=lambda p: {**every, "x": True}),
                 "it has ['x'] that params lacks")
    expect_error(lambda: ZeroOptimizer(tree, "lion", comm, eps_root=1e-8),
                 "eps_root=1e-08 is an optax option", "pass eps")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, learning_rate=1e-3, lr=1e-3),
                 "learning_rate= (optax's name) and lr= both given")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, mu_dtype="bfloat16"),
                 "mu_dtype='bfloat16'", "state_dtype")
    expect_error(lambda: ZeroOptimizer(tree, "adamw", comm, groups=[
        {"params": ["pair/0"], "weight_decay": lambda count: 0.1}]),
        "groups[0]: weight_decay=", "only lr (learning_rate) may be a schedule")
    # a schedule that fails on one rank: the step fails on every rank, nothing updated
    opt = ZeroOptimizer(tree, "adamw", comm, lr=lambda count: 1e-2 / (1 + count))
    before = flat64(opt.params(), opt.names)
    if rank == last:
        opt.param_groups[0]["lr"] = lambda count: 1 / 0
    expect_error(lambda: opt.step(good), "param_groups[0]['lr']: the schedule failed at step "
                 "count 0", "ZeroDivisionError: division by zero",
                 f"detected on rank {last}")
    check(opt.step_count == 0 and opt.param_groups[0]["lr"] == 1e-2, "a failed step counted")
    after = flat64(opt.params(), opt.names)
    check(all(np.array_equal(before[k], after[k]) for k in before), "a failed step updated")
    opt.param_groups[0]["lr"] = lambda count: 1e-2 / (1 + count)  # the same on every rank
    opt.step(good)
    check(opt.step_count == 1 and opt.param_groups[0]["lr"] == 5e-3, opt.param_groups)
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


@functools.cache
def nnx_model():
    """A flax.nnx attention model's parameters (a State), its jit-compiled ``value_and_grad``
    and its data by rank and step."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                               decode=False, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.norm(x + self.attn(x)).mean(axis=1))

    # nnx's names and shapes (traced, not run), filled from NumPy: init would compile a lot
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Block(nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(17)
    params = jax.tree.map(
        lambda s: jnp.asarray((rng.standard_normal(s.shape) * 0.3).astype(np.float32)), shapes)

    @jax.jit
    def loss_and_grads(params, x, y):
        def loss(p):
            logits = nnx.merge(graphdef, p)(x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
        return jax.value_and_grad(loss)(params)

    def data(r, step):
        rng = np.random.default_rng([13, step, r])
        return (jnp.asarray(rng.standard_normal((4, 5, 8)).astype(np.float32)),
                jnp.asarray(rng.integers(0, 3, 4).astype(np.int32)))

    return params, loss_and_grads, data


def decay_mask(params):
    """optax's mask: weight decay for the kernels, not for biases (2-D in attention) or the
    norm's scale. (An nnx State's path ends in the Variable's ``.value``.)"""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: "kernel" in jax.tree_util.keystr(path), params)


SCHEDULE_OPTIONS = {"b1": 0.9, "b2": 0.98, "eps": 1e-8, "weight_decay": 0.1}


def schedule():
    import optax

    return optax.warmup_cosine_decay_schedule(0.0, 2e-2, 3, 10, end_value=2e-3)


def nnx_parity():
    """zero1_mpi.jax with ``learning_rate=schedule``, optax's names and ``mask`` against
    ``optax.adamw(schedule, mask=...)`` on the mean gradient, one process."""
    import optax

    params, loss_and_grads, data = nnx_model()
    opt = ZeroOptimizer(params, "adamw", comm, learning_rate=schedule(), mask=decay_mask,
                        **SCHEDULE_OPTIONS)
    check(opt.names[:2] == ["attn/key/bias", "attn/key/kernel"], f"names: {opt.names}")
    exempt = {n for g in opt.param_groups if g["weight_decay"] == 0.0 for n in g["names"]}
    check(exempt == {n for n in opt.names if "kernel" not in n} and len(exempt) == 7,
          f"exempt from weight decay: {sorted(exempt)}")
    tx = optax.adamw(schedule(), mask=decay_mask, **SCHEDULE_OPTIONS)

    @jax.jit
    def reference_update(ref, state, mean):
        updates, state = tx.update(mean, state, ref)
        return optax.apply_updates(ref, updates), state

    # Both take the same gradients (ours, averaged): the attention's key bias has a gradient
    # of zero but for rounding, which Adam scales up to lr, so gradients taken at parameters
    # one rounding apart would part the two by lr in a step.
    ref, state = params, tx.init(params)
    worst, steps, treedef = 0.0, 8, jax.tree.structure(params)
    for step in range(steps):
        check(opt.param_groups[0]["lr"] == float(schedule()(step)), opt.param_groups)
        _, grads = loss_and_grads(opt.params(), *data(rank, step))
        every = comm.allgather([np.asarray(g) for g in jax.tree.leaves(grads)])
        opt.step(grads)
        mean = [sum(g[i] for g in every) / np.float32(size) for i in range(len(every[0]))]
        ref, state = reference_update(ref, state, jax.tree.unflatten(treedef, mean))
        for ours, theirs in zip(jax.tree.leaves(opt.params()), jax.tree.leaves(ref)):
            worst = max(worst, float(np.abs(np.asarray(ours, np.float64) - theirs).max()))
    # a step moves a parameter by up to lr (2e-2): float32 roundings differ by 1e-5 of that
    check(worst < 1e-6, f"nnx + schedule + mask differ from optax.adamw by {worst}")
    check(type(opt.params()) is type(params), "params() lost the nnx State")
    if rank == 0:
        print(f"OK jax adapter nnx + optax schedule and mask: {steps} steps on {size} ranks, "
              f"worst difference {worst:.1e}")


def resume(directory):
    """Six steps, against three, a save (sharded and consolidated) and three more after
    ``load``, ``load_consolidated`` and (on one rank, from the N-rank checkpoint) ``load``:
    the same bits. Every rank takes rank 0's data, so that one rank's gradient is the mean."""
    params, loss_and_grads, data = nnx_model()
    directory = Path(directory)

    def make(comm):
        return ZeroOptimizer(params, "adamw", comm, learning_rate=schedule(), mask=decay_mask,
                             **SCHEDULE_OPTIONS)

    def train(opt, steps):
        for step in steps:
            check(opt.step_count == step, f"step_count {opt.step_count}, expected {step}")
            opt.step(loss_and_grads(opt.params(), *data(0, step))[1])
        return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(opt.params())]

    whole = train(make(comm), range(6))
    saved = make(comm)
    train(saved, range(3))
    lr = [g["lr"] for g in saved.param_groups]
    check(lr == [float(schedule()(3))] * 2, f"the next step's lr: {lr}")
    checkpoint = saved.save(directory / "checkpoints")
    saved.save_consolidated(directory / "state.safetensors")
    loads = {"load": (comm, lambda opt: opt.load(checkpoint)),
             "load_consolidated": (comm, lambda opt: opt.load_consolidated(
                 directory / "state.safetensors")),
             "load on one rank": (MPI.COMM_SELF, lambda opt: opt.load(checkpoint))}
    for what, (on, load) in loads.items():
        opt = make(on)
        load(opt)
        check(opt.step_count == 3 and [g["lr"] for g in opt.param_groups] == lr,
              f"{what}: step {opt.step_count}, {opt.param_groups}")
        check(list(opt.lr_schedules) == [0, 1], f"{what}: {opt.lr_schedules}")
        check(train(opt, range(3, 6)) == whole, f"{what}: the steps after it differ")
    if rank == 0:
        print(f"OK jax adapter resume with a schedule on {size} ranks: {', '.join(loads)}")


def int8_wire():
    """8-bit reduction (with error feedback) and gathers through the binding: every rank's
    parameters are the same bytes, within 2% (relative L2) of 16-bit collectives' after the
    steps."""
    runs = {}
    warnings.simplefilter("error", RuntimeWarning)  # (the 8-bit gather's padding once warned)
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
    parts = iter(sys.argv[1:])
    for part in parts:
        {"parity": parity, "errors": errors, "flax": flax_model, "int8": int8_wire,
         "nnx": nnx_parity, "resume": lambda: resume(next(parts)),
         "stage2": lambda: parity(shard_gradients=True, grad_shard_dtype="float32")}[part]()
