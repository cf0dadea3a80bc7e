"""zero1_mpi.jax: pytrees in and out (skipped where JAX is not installed, failed instead where
``ZERO1_REQUIRE_JAX=1``, as in CI; the Flax test likewise needs flax and optax there).

The multi-rank case (tests/cases/jax_adapter.py) checks parity with the float64 references on
3 ranks, errors raised on every rank, a Flax model against ``optax.adamw``, and a flax.nnx
model with an optax schedule and mask against ``optax.adamw(schedule, mask=...)`` with a resume
bit for bit; the tests here show that the module's three aliasing rules are needed (what
breaks without them happens on the installed JAX) and that the adapter's own way keeps them,
and what optax users bring on one rank: schedules (optax's count, set and ended through
``param_groups``, skipped steps, saves and loads), optax's names, masks, and leaves that are
not parameters, named.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI
from mpirun import ROOT, run_mpi

REQUIRED = os.environ.get("ZERO1_REQUIRE_JAX") == "1"
try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    if REQUIRED:
        raise ImportError("ZERO1_REQUIRE_JAX=1 but JAX does not import: "
                          "pip install '.[jax]'") from exc
    pytest.skip(f"JAX is not installed (pip install '.[jax]'): {exc}", allow_module_level=True)

from zero1_mpi.jax import ZeroOptimizer, leaf_names

NEW_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 5)


@pytest.mark.parametrize("n", [3])
def test_n_ranks_match_one_process_on_the_averaged_gradients(n):
    out = run_mpi(n, "jax_adapter.py", "parity", *(["errors", "stage2"] if n == 3 else []),
                  timeout=180).stdout
    assert f"OK jax adapter parity: 3 configs x 6 steps on {n} ranks" in out, out
    if n == 3:  # shard_gradients=True: the gradients handed over leaf by leaf (stage 2)
        assert "OK jax adapter parity (stage 2): 3 configs x 6 steps on 3 ranks" in out, out
    if n == 3:  # wrong pytrees, shapes, dtypes and arguments raise on every rank
        assert "OK jax adapter errors on 3 ranks" in out, out


def test_the_8bit_wire_through_the_binding():
    out = run_mpi(3, "jax_adapter.py", "int8", timeout=180).stdout
    assert "OK jax adapter int8 wire on 3 ranks" in out, out


def test_a_flax_model_with_a_jit_step_matches_optax_adamw():
    needs_flax()
    out = run_mpi(2, "jax_adapter.py", "flax", timeout=180).stdout
    assert "OK jax adapter flax: 10 steps on 2 ranks" in out, out


def test_importing_the_package_does_not_import_jax():
    code = "import sys, zero1_mpi; print('jax' in sys.modules, 'zero1_mpi.jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_leaves_are_named_by_path_and_whole_64_byte_leaves_come_first():
    tree = {"b": [np.ones(3, np.float32), (np.ones((4, 4), np.float32),)],
            "a": {"x": np.ones(5, np.float32), "y": np.ones(32, np.float32)}}
    assert leaf_names(tree) == ["a/x", "a/y", "b/0", "b/1/0"]
    opt = ZeroOptimizer(tree, "sgd", MPI.COMM_SELF, lr=0.1)
    assert opt.names == ["a/x", "a/y", "b/0", "b/1/0"]
    # 128 and 64 bytes first (tree order), then 20 and 12: all but the last start aligned
    assert [t.name for t in opt.sharded.layout.tensors] == ["a/y", "b/1/0", "a/x", "b/0"]
    assert opt.zero_copy()["aligned"] == ["a/x", "a/y", "b/1/0"]
    out = opt.params()
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    done = opt.zero_copy()  # JAX 0.4.30 also aliased some unaligned addresses
    assert done["params"] == done["aligned"] if NEW_JAX else set(done["aligned"]) <= \
        set(done["params"])


def aligned(n: int, dtype, offset_bytes: int = 0) -> np.ndarray:
    """``n`` zeros starting ``offset_bytes`` past a multiple of 64 bytes."""
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset_bytes
    return raw[start:start + n * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_what_the_docstring_says_of_device_put_holds_here(dtype):
    """If this fails after a JAX upgrade, ZeroOptimizer's docstring needs the new facts."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    where = f"JAX {jax.__version__}"
    host = aligned(256, dtype)
    view = jax.device_put(host)
    assert view.unsafe_buffer_pointer() == host.ctypes.data and view.dtype == dtype, where
    host[...] = 3
    assert float(view[0]) == 3.0, where  # a view: it shows what NumPy writes
    odd = aligned(256, dtype, offset_bytes=16)
    if NEW_JAX:
        assert jax.device_put(odd).unsafe_buffer_pointer() != odd.ctypes.data, where
    grad = jnp.ones(256, dtype) * 2
    back = np.asarray(grad)
    assert back.ctypes.data == grad.unsafe_buffer_pointer() and not back.flags.writeable, where


def test_bfloat16_parameters_come_out_as_bfloat16_views():
    """``jax.device_put`` aliases an aligned NumPy bfloat16 array (DLPack would refuse it)."""
    opt = ZeroOptimizer({"w": jnp.ones((8, 8))}, "adamw", MPI.COMM_SELF, param_dtype="bfloat16")
    w = opt.params()["w"]
    assert w.dtype == jnp.bfloat16
    assert w.unsafe_buffer_pointer() == opt.sharded.params["w"].ctypes.data
    info = opt.step({"w": jnp.ones((8, 8), jnp.bfloat16)})
    assert info.step == 1 and opt.zero_copy()["grads"] == ["w"]


def test_the_aliasing_rules_are_needed_and_the_adapter_keeps_them():
    """What the module docstring's rules prevent, shown on the installed JAX: (3) a jit
    function that closes over the parameters keeps their first values; (2) a pytree taken
    before ``step()`` shows the values after it; (1) a computation still running when the
    buffer is rewritten reads the new values. The adapter's way has none of these."""
    n = 1 << 18
    make = lambda: ZeroOptimizer({"w": np.ones(n, np.float32)}, "sgd",
                                 MPI.COMM_SELF, lr=0.5)
    opt = make()
    ones = jnp.ones(n)
    before = opt.params()
    closure = jax.jit(lambda x: (x * before["w"]).sum())
    argument = jax.jit(lambda p, x: (x * p["w"]).sum())
    assert float(closure(ones)) == float(argument(before, ones)) == n
    snapshot = jax.tree.map(jnp.copy, before)
    opt.step({"w": ones})                                  # w: 1 -> 0.5
    after = opt.params()
    assert float(argument(after, ones)) == n / 2           # the adapter's way: an argument
    assert float(closure(ones)) == n                       # (3) broken: a stale constant
    assert float(before["w"][0]) == 0.5                    # (2) the old pytree changed
    assert float(snapshot["w"][0]) == 1.0                  # ... a copy did not

    @jax.jit
    def slow(p):  # about 0.1 s of work that reads the parameters at every iteration
        x = jax.lax.fori_loop(0, 100, lambda i, x: jnp.sin(x) + p["w"], jnp.zeros(n))
        return x.sum(), {"w": jnp.ones(n)}

    racing, waiting = make(), make()
    expected = float(slow(racing.params())[0])
    value, grads = slow(racing.params())
    running = not value.is_ready()  # JAX 0.4.30 ran jit calls on the CPU synchronously
    racing.sharded.grads["w"][...] = 1.0
    racing.sharded.step()                                  # while slow() still reads w
    assert (float(value) != expected) == running           # (1) broken: it read new values
    assert running or not NEW_JAX
    value, grads = slow(waiting.params())
    waiting.step(grads)                                    # waits for slow() first
    assert float(value) == expected
    assert np.array_equal(racing.params()["w"], waiting.params()["w"])


# -- what optax users bring: schedules, optax's names, masks; leaves that are not parameters --

def needs_flax():
    """flax and optax, or a skip (a failure where ``ZERO1_REQUIRE_JAX=1``)."""
    try:
        import flax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as exc:
        if REQUIRED:
            raise ImportError("ZERO1_REQUIRE_JAX=1 but flax does not import: "
                              "pip install flax") from exc
        pytest.skip(f"flax is not installed (pip install flax): {exc}")


def sgd(tree=None, **options):
    """SGD on one rank over ``tree`` (default: one leaf ``w`` of ones): ``p -= lr * g``."""
    return ZeroOptimizer(tree or {"w": np.ones(4, np.float32)}, "sgd", MPI.COMM_SELF, **options)


def steps_taken(opt, n, grad=1.0):
    """The change of ``w`` in each of ``n`` steps with gradient ``grad`` (times the loss
    scale): the lr each step used."""
    moved = []
    for _ in range(n):
        before = float(opt.params()["w"][0])
        opt.step({"w": jnp.full(4, grad * opt.loss_scale, jnp.float32)})
        moved.append(before - float(opt.params()["w"][0]))
    return moved


def test_an_lr_schedule_is_evaluated_at_optax_count_before_each_step():
    """``count`` is the number of updates applied before this one (optax's convention);
    ``param_groups`` shows the next step's lr; a skipped step does not count."""
    seen = []

    def schedule(count):
        seen.append(count)
        return jnp.asarray(0.125 * 0.5**count, jnp.float32)  # a 0-d array, as optax's

    opt = sgd(lr=schedule, loss_scale="dynamic")
    assert opt.param_groups[0]["lr"] == 0.125 and opt.lr_schedules == {0: schedule}
    assert steps_taken(opt, 3) == [0.125, 0.0625, 0.03125]
    assert opt.param_groups[0]["lr"] == 0.015625 and opt.step_count == 3
    counted = len(seen)
    assert opt.step({"w": jnp.full(4, jnp.inf)}).skipped  # an overflow: nothing counted
    assert opt.step_count == 3 and opt.param_groups[0]["lr"] == 0.015625
    assert len(seen) == counted  # (nor evaluated again: the count did not move)
    assert steps_taken(opt, 1) == [0.015625]
    assert set(seen) == {0, 1, 2, 3, 4}


def test_an_lr_set_in_param_groups_may_be_a_schedule_a_number_or_a_0d_array():
    opt = sgd(lr=jnp.float32(0.5))  # a 0-d array as the optimizer's lr
    assert opt.param_groups[0]["lr"] == 0.5 and not opt.lr_schedules
    assert steps_taken(opt, 1) == [0.5]
    opt.param_groups[0]["lr"] = lambda count: 0.25 * (count + 1)  # at counts 1 and 2
    assert steps_taken(opt, 2) == [0.5, 0.75]
    opt.param_groups[0]["lr"] = jnp.float32(0.125)  # a number ends the schedule
    assert steps_taken(opt, 2) == [0.125, 0.125] and not opt.lr_schedules
    opt.param_groups[0]["lr"] = 0.25
    assert steps_taken(opt, 1) == [0.25]


def test_a_group_may_have_its_own_schedule():
    tree = {"w": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
    opt = sgd(tree, lr=lambda count: 0.5, groups=[
        {"params": ["b"], "lr": lambda count: 0.25},  # its own
    ])
    assert [g["names"] for g in opt.param_groups] == [("w",), ("b",)]
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25] and len(opt.lr_schedules) == 2
    fixed = sgd(tree, lr=lambda count: 0.5, groups=[{"params": ["b"], "lr": 0.125}])
    assert [g["lr"] for g in fixed.param_groups] == [0.5, 0.125]
    assert list(fixed.lr_schedules) == [0]


def test_a_save_holds_the_next_lr_and_a_load_goes_on_with_the_schedule(tmp_path):
    schedule = lambda count: 0.5 ** (count + 1)  # noqa: E731
    opt = sgd(lr=schedule)
    steps_taken(opt, 2)
    opt.param_groups[0]["lr"] = schedule  # set again between steps: nothing reaches the core
    path = opt.save(tmp_path / "checkpoints")
    opt.save_consolidated(tmp_path / "state.safetensors")
    assert opt.param_groups[0]["lr"] == 0.125
    for load in (lambda o: o.load(path),
                 lambda o: o.load_consolidated(tmp_path / "state.safetensors")):
        fresh = sgd(lr=schedule)
        load(fresh)
        assert fresh.step_count == 2 and fresh.param_groups[0]["lr"] == 0.125
        assert steps_taken(fresh, 2) == [0.125, 0.0625] and fresh.lr_schedules == {0: schedule}
    plain = sgd(lr=0.5)  # built without a schedule: the saved number stays
    plain.load(path)
    assert steps_taken(plain, 2) == [0.125, 0.125]


def test_a_schedule_that_fails_fails_the_step_with_nothing_updated():
    opt = sgd(lr=0.5)
    opt.param_groups[0]["lr"] = lambda count: float("nan")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]: the schedule failed at "
                                         r"step count 0: ValueError: .* must be a finite"):
        opt.step({"w": jnp.ones(4)})
    assert opt.step_count == 0 and opt.param_groups[0]["lr"] == 0.5
    assert float(opt.params()["w"][0]) == 1.0
    opt.param_groups[0]["lr"] = 0.25
    assert steps_taken(opt, 1) == [0.25]
    with pytest.raises(ValueError, match=r"lr=<function .* it raised at count 0: "
                                         r"ZeroDivisionError"):
        sgd(lr=lambda count: 1 / count)
    with pytest.raises(ValueError, match=r"groups\[0\]: lr=<function .* raised at count 0"):
        sgd(groups=[{"params": ["w"], "learning_rate": lambda count: [][count]}])
    with pytest.raises(TypeError, match="only lr .learning_rate. may be a schedule"):
        sgd(momentum=lambda count: 0.9)


def test_optax_names_mean_the_same_options():
    tree = {"w": np.ones((4, 4), np.float32)}
    opts = lambda **o: ZeroOptimizer(tree, "adamw", MPI.COMM_SELF, **o).param_groups  # noqa
    assert opts(learning_rate=0.5, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.1) == \
        opts(lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert opts(b1=0.8)[0]["betas"] == (0.8, 0.999)  # the other from the rule's default
    lion = ZeroOptimizer(tree, "lion", MPI.COMM_SELF, b1=0.5)
    assert lion.param_groups[0]["betas"] == (0.5, 0.99)
    neutral = opts(eps_root=0.0, mu_dtype=None, nesterov=False)  # what zero1_mpi does
    assert neutral == opts()
    grouped = ZeroOptimizer(tree, "adamw", MPI.COMM_SELF, betas=(0.7, 0.9), groups=[
        {"params": ["w"], "learning_rate": 0.25, "b2": 0.95}]).param_groups
    assert grouped[0]["lr"] == 0.25 and grouped[0]["betas"] == (0.7, 0.95)
    sgd_opt = ZeroOptimizer(tree, "sgd", MPI.COMM_SELF, momentum=0.9, nesterov=True)
    assert sgd_opt.param_groups[0]["nesterov"] is True  # SGD's own option, not optax's
    for bad, text in [({"eps_root": 1e-8}, "eps_root=1e-08 is an optax option zero1_mpi has "
                       "not: zero1_mpi adds eps outside"),
                      ({"mu_dtype": jnp.bfloat16}, "state_dtype ('bfloat16' or 'int8')"),
                      ({"accumulator_dtype": "bfloat16"}, "state_dtype"),
                      ({"nesterov": True}, "only 'sgd' has Nesterov momentum"),
                      ({"b1": 0.9, "betas": (0.9, 0.9)}, "b1= (optax's name) and betas= "
                       "both given")]:
        with pytest.raises(ValueError, match=re_escape(text)):
            opts(**bad)


def re_escape(text):
    import re
    return re.escape(text)


def test_a_mask_exempts_leaves_from_weight_decay_within_their_groups():
    tree = {"enc": {"kernel": np.ones((4, 4), np.float32), "bias": np.ones((2, 2), np.float32)},
            "dec": {"kernel": np.ones((4, 4), np.float32), "bias": np.ones(4, np.float32)}}
    make = lambda **o: ZeroOptimizer(tree, "adamw", MPI.COMM_SELF, weight_decay=0.1, **o)  # noqa
    by_name = lambda opt: {n: (g["weight_decay"], g["lr"])  # noqa
                           for g in opt.param_groups for n in g["names"]}
    kernels = {"enc": {"kernel": True, "bias": False}, "dec": {"kernel": True, "bias": False}}
    want = {"enc/kernel": (0.1, 1e-3), "dec/kernel": (0.1, 1e-3),
            "enc/bias": (0.0, 1e-3), "dec/bias": (0.0, 1e-3)}
    assert by_name(make(mask=kernels)) == want
    assert by_name(make(mask=lambda p: jax.tree.map(lambda x: x.shape == (4, 4), p))) == want
    prefix = make(mask={"enc": False, "dec": True})  # a prefix: one bool for a subtree
    assert [(g["names"], g["weight_decay"]) for g in prefix.param_groups] == [
        (("dec/kernel", "dec/bias"), 0.1), (("enc/kernel", "enc/bias"), 0.0)]
    everything = make(mask=False)
    assert [g["weight_decay"] for g in everything.param_groups] == [0.0]
    # with groups: a masked-out leaf keeps its group's other options, with no weight decay
    grouped = make(mask=kernels, groups=[{"params": lambda name, leaf: name.startswith("dec"),
                                          "lr": 0.5}])
    assert [(g["names"], g["weight_decay"], g["lr"]) for g in grouped.param_groups] == [
        (("enc/kernel",), 0.1, 1e-3), (("enc/bias",), 0.0, 1e-3),
        (("dec/kernel",), 0.1, 0.5), (("dec/bias",), 0.0, 0.5)]
    with pytest.raises(ValueError, match=re_escape("no value for ['enc/bias', 'enc/kernel']")):
        make(mask={"dec": True})
    with pytest.raises(TypeError, match=re_escape("mask['dec/bias'] is 0")):
        make(mask={"enc": True, "dec": {"kernel": True, "bias": 0}})


def test_leaves_that_are_not_parameters_are_named_with_the_fix():
    tree = {"w": jnp.ones(4), "step": jnp.int32(0), "key": jax.random.key(0), "t": 0.5,
            "on": np.array([True])}
    with pytest.raises(TypeError) as info:
        ZeroOptimizer(tree, "adamw", MPI.COMM_SELF)
    message = str(info.value)
    for text in ("'key' (a PRNG key array, key<fry>)", "'on' (dtype bool)",
                 "'step' (dtype int32)", "'t' (a Python float)",
                 "nnx.split(model, nnx.Param, ...)", "jnp.asarray(x, jnp.float32)"):
        assert text in message, message


def test_a_group_that_selects_no_leaf_is_refused_naming_it_and_the_leaves():
    """A selector that is False for every leaf (a function or an empty collection) would leave
    its options unused without a word: refused, naming the group and the first leaf names."""
    tree = {"dense": {"kernel": np.ones((4, 2), np.float32), "bias": np.ones(2, np.float32)}}
    for selector in (lambda name, leaf: name.endswith("beta"), []):
        with pytest.raises(ValueError, match=re_escape(
                "groups[1]['params'] selects no leaf of the 2 of params, named like "
                "['dense/bias', 'dense/kernel']")):
            ZeroOptimizer(tree, "adamw", MPI.COMM_SELF, groups=[
                {"params": lambda name, leaf: leaf.ndim == 2, "lr": 1e-3},
                {"params": selector, "weight_decay": 0.0}])
    for n, more in ((6, ""), (7, " ...")):  # the first 6 names shown, and whether there are more
        tree = {f"w{i}": np.ones(2, np.float32) for i in range(n)}
        shown = [f"w{i}" for i in range(6)]
        with pytest.raises(ValueError, match=re_escape(f"named like {shown}{more} (leaf_names")):
            ZeroOptimizer(tree, "sgd", MPI.COMM_SELF, groups=[{"params": []}])


def test_selectors_and_masks_of_0_1_0_names_work_with_a_warning():
    """0.1.0 named an nnx Variable's leaf ``lin/bias/value``: a selector (function or names)
    or a mask written against those names selects what today's names select, with a
    DeprecationWarning; the optimizer is the one today's names build."""
    needs_flax()
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.out = nnx.Linear(3, 2, rngs=rngs)

    params = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
    today = ZeroOptimizer(params, "adamw", MPI.COMM_SELF, groups=[
        {"params": lambda name, leaf: name.endswith("bias"), "weight_decay": 0.0}])
    expected = [(g["names"], g["weight_decay"]) for g in today.param_groups]
    old = [
        {"groups": [{"params": lambda name, leaf: name.endswith("bias/value"),
                     "weight_decay": 0.0}]},
        {"groups": [{"params": ["lin/bias/value", "out/bias/value"], "weight_decay": 0.0}]},
        {"mask": {"lin": {"bias": {"value": False}, "kernel": {"value": True}},
                  "out": {"bias": {"value": False}, "kernel": {"value": True}}}},
    ]
    for options in old:
        with pytest.warns(DeprecationWarning, match="0.1.0's leaf names"):
            opt = ZeroOptimizer(params, "adamw", MPI.COMM_SELF, **options)
        got = [(g["names"], g["weight_decay"]) for g in opt.param_groups]
        assert sorted(got) == sorted(expected), (options, got)
        assert opt.names == today.names


@pytest.mark.parametrize("n", [2, 3])
def test_a_flax_nnx_checkpoint_of_0_1_0_loads_bit_for_bit(n):
    """tests/cases/kept_nnx_checkpoint.py on tests/data/nnx-checkpoint-0.1.0 (written by
    0.1.0, its names ending in ``/value``): the sharded checkpoint and the consolidated export
    give the saved parameters, and on 2 ranks the next step bitwise 0.1.0's."""
    needs_flax()
    out = run_mpi(n, "kept_nnx_checkpoint.py", "check",
                  str(ROOT / "tests" / "data" / "nnx-checkpoint-0.1.0"), timeout=240).stdout
    assert f"OK 0.1.0's nnx checkpoint and export loaded on {n} ranks" in out, out


def test_flax_nnx_state_names_drop_the_variables_value():
    """A flax.nnx State's leaves are ``Variable.value``: named as the Variable (``lin/kernel``,
    as ``nnx.to_pure_dict`` and the model's attributes), while a dict key ``value`` (the
    attention's value projection) stays. The full state's RNG leaves are refused by name."""
    needs_flax()
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=4, decode=False,
                                               rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    model = Model(nnx.Rngs(0, dropout=1))
    params = nnx.state(model, nnx.Param)
    names = leaf_names(params)
    assert "lin/kernel" in names and "attn/value/bias" in names
    assert names == leaf_names(nnx.to_pure_dict(params))
    opt = ZeroOptimizer(params, "adamw", MPI.COMM_SELF)
    assert opt.names == names and type(opt.params()) is type(params)
    with pytest.raises(TypeError, match=re_escape("'drop/rngs/key' (a PRNG key array")):
        ZeroOptimizer(nnx.state(model), "adamw", MPI.COMM_SELF)


def test_an_nnx_model_with_an_optax_schedule_and_mask_matches_optax_adamw(tmp_path):
    """2 ranks: ``learning_rate=schedule`` and ``mask`` against ``optax.adamw(schedule,
    mask=...)`` on the mean gradient; a resume through ``load``, ``load_consolidated`` and a
    load on one rank goes on bit for bit."""
    needs_flax()
    out = run_mpi(2, "jax_adapter.py", "nnx", "resume", str(tmp_path), timeout=180).stdout
    assert "OK jax adapter nnx + optax schedule and mask: 8 steps on 2 ranks" in out, out
    assert "OK jax adapter resume with a schedule on 2 ranks: load, load_consolidated, " \
        "load on one rank" in out, out


def test_clip_grad_norm_takes_the_accumulated_gradients_and_a_schedule_set_between_steps():
    """The core's clip_grad_norm_ through the binding: the global norm of what accumulate()
    gave (one rank here), the step clipped to it, a schedule set in param_groups meanwhile
    evaluated at the count."""
    opt = sgd(lr=0.5)
    opt.param_groups[0]["lr"] = lambda count: 0.25 * (count + 1)
    opt.accumulate({"w": jnp.full(4, 2.0, jnp.float32)})  # norm 4
    assert opt.clip_grad_norm_(1.0) == pytest.approx(4.0)
    info = opt.step()
    assert info.clip_coef == pytest.approx(0.25) and info.grad_norm == pytest.approx(4.0)
    np.testing.assert_allclose(np.asarray(opt.params()["w"]), 1.0 - 0.25 * 0.5)


def test_stage3_is_refused_with_the_reason():
    """A jitted step reads the whole pytree: stage 3 would gather every unit at once."""
    with pytest.raises(ValueError, match="shard_params=True is refused for JAX: a jitted step "
                                         "reads the whole parameter pytree at once"):
        ZeroOptimizer({"w": jnp.ones(4)}, "adamw", MPI.COMM_SELF, shard_params=True)
