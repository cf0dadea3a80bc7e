"""What is wrong on one rank is raised on every rank, never hangs, and changes nothing.

    mpiexec -n N python -m mpi4py tests/cases/bad_input.py [construction] [options] [overflow]

- ``construction``: bad parameters, engine options and settings (on every rank, or on the last
  rank only: the others must raise too) raise the same clear error everywhere; after every
  failed construction a good optimizer still steps alike on every rank (no collective was left
  half-done); the caller's arrays are never written; the views cannot be replaced.
- ``options``: every rule of the registry (``BAD_OPTIONS``; a rule not listed there: a negative
  learning rate): bad group options at construction (in the defaults on every rank, in group
  1 on the last rank), set in ``param_groups`` between steps on the last rank (the next step
  raises on every rank, updates nothing, and training goes on once they are set right), and
  valid options that differ between ranks (at construction and between steps); SGD's momentum
  needs the buffer chosen at construction.
- ``overflow``: inf/nan gradients on one rank are agreed by all: the step is skipped on every
  rank and the dynamic loss scale backs off; at its minimum, or without dynamic scaling, the
  error is raised everywhere with nothing updated; fp16 sums that overflow in MPI's float16.
"""

import os

import numpy as np
from mpi4py import MPI

import casekit as kit
from casekit import check, last, on_last, rank, size, world
from zero1_mpi import CollectiveError, LossScaler, ZeroAdam, ZeroSGD

cases = {}


# -- construction ------------------------------------------------------------------------------

def good():
    return {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}


def extra():
    return {**good(), "x": np.ones(2, np.float32)}


def with_nonfinite():
    params = good()
    params["w"][1, 2] = np.nan
    return params


def differs(exc=CollectiveError):
    """The exception of a value that differs between ranks: none on one rank."""
    return exc if size > 1 else None


CONSTRUCTION = [
    # (description, callable, exception type (None: no error), words the message must hold)
    ("params is a list", lambda: ZeroAdam([np.ones(3)]), TypeError, ["mapping"]),
    ("params is empty", lambda: ZeroAdam({}), ValueError, ["empty"]),
    ("a value is a list", lambda: ZeroAdam({"w": [1.0, 2.0]}), TypeError, ["params['w']"]),
    ("integer parameters", lambda: ZeroAdam({"w": np.ones(3, np.int32)}), TypeError,
     ["params['w']", "int32"]),
    ("name is not a str", lambda: ZeroAdam({1: np.ones(3, np.float32)}), TypeError, ["1"]),
    ("non-finite on the last rank", lambda: ZeroAdam(on_last(with_nonfinite(), good())),
     ValueError, ["params['w']", "non-finite", f"rank {last}"]),
    ("mixed dtypes, no param_dtype",
     lambda: ZeroAdam({"a": np.ones(2, np.float32), "b": np.ones(2, np.float16)}), ValueError,
     ["float16", "float32", "param_dtype"]),
    ("float64 without param_dtype", lambda: ZeroAdam({"a": np.ones(2)}), ValueError,
     ["float64", "param_dtype"]),
    ("unknown param_dtype", lambda: ZeroAdam(good(), param_dtype="int8"), ValueError,
     ["param_dtype='int8'", "bfloat16"]),
    ("reduce_dtype bfloat16", lambda: ZeroAdam(good(), param_dtype="bfloat16",
                                               reduce_dtype="bfloat16"), ValueError,
     ["reduce_dtype='bfloat16'", "float32"]),
    ("reduce_dtype float16 for bf16", lambda: ZeroAdam(good(), param_dtype="bfloat16",
                                                       reduce_dtype="float16"), ValueError,
     ["reduce_dtype='float16'", "bfloat16"]),
    ("comm is a string", lambda: ZeroAdam(good(), comm="world"), TypeError,
     ["comm='world'", "MPI.COMM_WORLD"]),
    ("comm is COMM_NULL", lambda: ZeroAdam(good(), comm=MPI.COMM_NULL), ValueError,
     ["COMM_NULL"]),
    ("comm is an MPI.Group", lambda: ZeroAdam(good(), comm=MPI.COMM_WORLD.group),
     TypeError, ["intracommunicator"]),
    ("different shape on the last rank",
     lambda: ZeroAdam(on_last({"w": np.ones((4, 3), np.float32), "b": np.zeros(4, np.float32)},
                              good())), differs(),
     ["(4, 3)", "(3, 4)", "same names, shapes and dtypes"]),
    ("different names on the last rank",
     lambda: ZeroAdam(on_last({"w": np.ones((3, 4), np.float32), "c": np.zeros(4, np.float32)},
                              good())), differs(), ["'c'", "'b'"]),
    ("different shape on rank 0 (the others alike)",
     lambda: ZeroAdam({**extra(), "w": np.ones((4, 3) if rank == 0 else (3, 4), np.float32)}),
     differs(),
     ["rank 0 has ('w', (4, 3)), rank 1 has ('w', (3, 4))"]),
    ("extra tensor on the last rank",  # 3 and 4 tensors: counts unlike the 2 of a name-shape pair
     lambda: ZeroAdam(on_last({**extra(), "y": np.ones(2, np.float32)}, extra())), differs(),
     ["3 tensors", "4 tensors"]),
    ("tensors grouped differently on the last rank (the groups' options alike)",
     lambda: ZeroAdam(on_last([{"params": {"w": extra()["w"]}},
                               {"params": {"b": extra()["b"], "x": extra()["x"]}}],
                              [{"params": {"w": extra()["w"], "b": extra()["b"]}},
                               {"params": {"x": extra()["x"]}}])), differs(),
     ["the parameter layout differs", "the same tensors in the same param groups"]),
    ("different param_dtype on the last rank",
     lambda: ZeroAdam(good(), param_dtype=on_last("float16", "float32")), differs(),
     ["param_dtype"]),
    ("different bucket_elements on the last rank",
     lambda: ZeroAdam(good(), bucket_elements=on_last(1000, 2000)), differs(),
     ["bucket_elements (2000 on rank 0, 1000", "same"]),
    ("unknown option type on one rank", lambda: ZeroAdam(good(), lr=on_last(10 ** 400, 0.1)),
     OverflowError, ["int too large"]),
    ("decoupled_weight_decay is a string",
     lambda: ZeroAdam(good(), decoupled_weight_decay="false"), TypeError,
     ["decoupled_weight_decay='false'", "True or False"]),
    ("a value beyond float16", lambda: ZeroAdam({"w": np.full(3, 1e5, np.float32)},
                                               param_dtype="float16"), ValueError,
     ["params['w']", "100000", "65504", "param_dtype"]),
    ("a value beyond float32", lambda: ZeroAdam({"w": np.full(3, 1e39)}, param_dtype="float32"),
     ValueError, ["float32"]),
    ("unknown offload", lambda: ZeroAdam(good(), offload="gpu"), ValueError,
     ["offload='gpu'", "'cpu'"]),
    ("offload on the last rank only", lambda: ZeroAdam(good(), offload=on_last("cpu", None)),
     differs(), ["offload (None on rank 0, 'cpu' on rank", "same"]),
    ("offload_threads of 0", lambda: ZeroAdam(good(), offload="cpu", offload_threads=0),
     ValueError, ["offload_threads=0", ">= 1"]),
    ("offload_threads without offload", lambda: ZeroAdam(good(), offload_threads=2), ValueError,
     ["offload_threads=2", "offload='cpu'"]),
    ("offload_fraction above 1", lambda: ZeroAdam(good(), offload="cpu", offload_fraction=1.5),
     ValueError, ["offload_fraction=1.5", "from 0 to 1"]),
    ("remainder masters offloaded whole", lambda: ZeroAdam(
        good(), param_dtype="bfloat16", masters="remainder", offload="cpu"), ValueError,
     ["masters='remainder'", "offload='cpu' keeps every master on the host"]),
    ("offload_fraction nan",
     lambda: ZeroAdam(good(), offload="cpu", offload_fraction=float("nan")),
     ValueError, ["offload_fraction=nan", "from 0 to 1"]),
    ("offload_fraction a string",
     lambda: ZeroAdam(good(), offload="cpu", offload_fraction="0.5"), ValueError,
     ["offload_fraction='0.5'", "from 0 to 1"]),
    ("offload_fraction without offload", lambda: ZeroAdam(good(), offload_fraction=0.5),
     ValueError, ["offload_fraction=0.5", "offload='cpu'"]),
    ("offload_fraction differs on the last rank",
     lambda: ZeroAdam(good(), offload="cpu", offload_fraction=on_last(0.25, 0.5)), differs(),
     ["offload_fraction (0.5 on rank 0, 0.25 on rank", "same"]),
    ("bad cuda_aware argument on one rank",
     lambda: ZeroAdam(good(), cuda_aware=on_last("yes", None)), TypeError, ["cuda_aware='yes'"]),
]


def expect(description, build, exc_type, words):
    """``build()`` raises ``exc_type`` (None: nothing) whose message holds ``words``; then a
    good optimizer still steps and agrees on every rank."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - the type is checked right below
        check(exc_type is not None and isinstance(exc, exc_type),
              f"{description}: unexpected {type(exc).__name__}: {exc}")
        missing = [w for w in words if w not in str(exc)]
        check(not missing, f"{description}: message {str(exc)!r} lacks {missing}")
    else:
        check(exc_type is None, f"{description}: no error raised")
    opt = ZeroAdam(good(), lr=0.5)
    opt.grads["w"][...] = 1.0
    opt.step()
    total = float(opt.params["w"].sum())
    check(np.allclose(opt.params["w"], 0.5) and world.allreduce(total, op=MPI.MAX) == total,
          f"{description}: optimizer broken afterwards")


def with_environment(name, value):
    """Build an optimizer with ``name=value`` in this rank's environment (None: unset)."""
    def build():
        if value is not None:
            os.environ[name] = value
        try:
            ZeroAdam(good())
        finally:
            os.environ.pop(name, None)
    return build


def construction():
    for description, build, exc_type, words in CONSTRUCTION:
        expect(description, build, exc_type, words)
    expect("bad ZERO1_MPI_CUDA_AWARE on one rank",
           with_environment("ZERO1_MPI_CUDA_AWARE", on_last("maybe", None)), ValueError,
           ["ZERO1_MPI_CUDA_AWARE='maybe'", f"rank {last}"])
    # Persistent collectives: a misspelt setting, and ranks that would choose differently
    # (a persistent collective matches only persistent ones: it would hang or go wrong).
    expect("bad ZERO1_MPI_PERSISTENT on one rank",
           with_environment("ZERO1_MPI_PERSISTENT", on_last("sure", "1")), ValueError,
           ["ZERO1_MPI_PERSISTENT='sure'", f"rank {last}"])
    expect("ZERO1_MPI_PERSISTENT differs between ranks",
           with_environment("ZERO1_MPI_PERSISTENT", on_last("0", "1")), differs(),
           ["persistent", "ZERO1_MPI_PERSISTENT", f"rank {last}"])

    # The caller's arrays are never written.
    mine = good()
    before = {k: v.copy() for k, v in mine.items()}
    opt = ZeroAdam(mine)
    opt.grads["w"][...] = 1.0
    opt.step()
    check(all(np.array_equal(mine[k], before[k]) for k in mine),
          "the optimizer wrote into the caller's arrays")
    # Views cannot be replaced (they would silently stop being views).
    for mapping in (opt.params, opt.grads):
        def replace():
            mapping["w"] = np.zeros((3, 4), np.float32)
        kit.raises(TypeError, "", replace)
    cases["construction"] = len(CONSTRUCTION) + 5


# -- every rule's options ----------------------------------------------------------------------

#: name: (good options, [(bad options, words the message must hold)]). The good options are
#: valid between steps too (SGD: with momentum, so that the buffer exists).
BAD_OPTIONS = {
    "adam": ({"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}, [
        ({"lr": -1.0}, ["lr=-1.0", "must be >= 0"]),
        ({"betas": (0.9, 1.0)}, ["betas[1]=1.0"]),
        ({"betas": 0.9}, ["betas=0.9"]),
        ({"eps": float("nan")}, ["eps=nan"]),
    ]),
    "sgd": ({"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01,
             "nesterov": False}, [
        ({"momentum": -0.5}, ["momentum=-0.5", "must be >= 0"]),
        ({"nesterov": True, "momentum": 0.0},
         ["nesterov=True needs momentum > 0 and dampening = 0", "momentum=0.0"]),
        ({"nesterov": True, "dampening": 0.1},
         ["nesterov=True needs momentum > 0 and dampening = 0", "dampening=0.1"]),
        ({"lr": -1.0}, ["lr=-1.0", "must be >= 0"]),
        ({"weight_decay": -0.1}, ["weight_decay=-0.1", "must be >= 0"]),
        ({"dampening": -0.2}, ["dampening=-0.2", "must be >= 0"]),
        ({"nesterov": "yes"}, ["nesterov='yes'", "True or False"]),
        ({"lr": float("nan")}, ["lr=nan", "finite number"]),
    ]),
    "lion": ({"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}, [
        ({"betas": (0.9, 1.0)}, ["betas[1]=1.0", "must be in [0, 1)"]),
        ({"betas": (-0.1, 0.99)}, ["betas[0]=-0.1", "must be in [0, 1)"]),
        ({"betas": (1.5, 0.99)}, ["betas[0]=1.5", "must be in [0, 1)"]),
        ({"betas": 0.9}, ["betas=0.9", "must be a pair"]),
        ({"lr": -1e-4}, ["lr=-0.0001", "must be >= 0"]),
        ({"weight_decay": -0.1}, ["weight_decay=-0.1", "must be >= 0"]),
        ({"weight_decay": float("nan")}, ["weight_decay=nan", "must be a finite number"]),
    ]),
    "lamb": ({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}, [
        ({"betas": (0.9, 1.0)}, ["betas[1]=1.0", "[0, 1)"]),
        ({"betas": (1.0, 0.999)}, ["betas[0]=1.0", "must be in [0, 1)"]),
        ({"eps": -1e-6}, ["eps=-1e-06", ">= 0"]),
        ({"lr": -1.0}, ["lr=-1.0", ">= 0"]),
        ({"weight_decay": -0.1}, ["weight_decay=-0.1", ">= 0"]),
    ]),
}
#: A valid value that differs from the good one, per option: set on the last rank only.
OTHER_VALUES = {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "weight_decay": 0.02,
                "nesterov": True, "betas": (0.8, 0.95), "eps": 1e-7}


def params():
    return {"w": np.linspace(-1, 1, 60, dtype=np.float32).reshape(5, 12),
            "b": np.ones(7, np.float32), "s": np.float32(0.5)}


def groups(second=None):
    """Two groups (so that messages must name the right one): ``second`` overrides group 1."""
    p = params()
    return [{"params": {"w": p["w"]}}, {"params": {"b": p["b"], "s": p["s"]}, **(second or {})}]


def fill(opt, step):
    for name, g in opt.grads.items():
        g[...] = np.random.default_rng([step, rank, len(name)]).standard_normal(g.shape)


def still_works(make, description):
    """A good optimizer steps and holds the same parameters on every rank."""
    opt = make()
    fill(opt, 1)
    opt.step()
    w = opt.params["w"].copy()
    check(not np.array_equal(w, params()["w"]), f"{description}: the step changed nothing")
    check(kit.everywhere_same(w.tobytes()), f"{description}: the ranks disagree after a step")


def at_construction(cls, good_options, bad, words):
    """Bad in the defaults (every rank), in group 1 on the last rank only."""
    for where, make, where_words in (
            ("defaults, every rank", lambda: cls(params(), world, **{**good_options, **bad}),
             []),
            ("group 1, last rank", lambda: cls(groups(on_last(bad, {})), world, **good_options),
             [f"rank {last}"])):
        description = f"{cls.__name__}({bad}) in the {where}"
        expect_raise(description, make, ValueError, words + where_words)
        still_works(lambda: cls(params(), world, **good_options), description)
    return 2


def expect_raise(description, fn, exc_type, words):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is checked right below
        check(isinstance(exc, exc_type), f"{description}: unexpected {type(exc).__name__}: {exc}")
        missing = [w for w in words if w not in str(exc)]
        check(not missing, f"{description}: message {str(exc)!r} lacks {missing}")
    else:
        raise AssertionError(f"rank {rank}: {description}: no error raised")


def between_steps(cls, good_options, bad, words):
    """Set in param_groups[1] on the last rank after a step: the next step raises on every
    rank, updates nothing, and training goes on once the option is set right again."""
    description = f"{cls.__name__}: param_groups[1] set to {bad} on the last rank"
    opt = cls(groups(), world, **good_options)
    fill(opt, 1)
    opt.step()
    before = kit.snapshot(opt)
    saved = dict(opt.param_groups[1])
    if rank == last:
        opt.param_groups[1].update(bad)
    fill(opt, 2)
    expect_raise(description, opt.step, ValueError, ["param_groups[1]", f"rank {last}", *words])
    check(kit.unchanged(opt, before), f"{description}: the failed step changed the optimizer")
    check(not any(np.any(g != 0) for g in opt.grads.values()),
          f"{description}: the failed step left gradients behind")
    opt.param_groups[1].clear()
    opt.param_groups[1].update(saved)
    fill(opt, 2)
    check(opt.step().step == 2 and not kit.unchanged(opt, before), f"{description}: no recovery")
    check(kit.everywhere_same(opt.params["w"].tobytes()),
          f"{description}: the ranks disagree after recovering")
    return 1


def differing_between_ranks(cls, good_options):
    """Valid options that differ on the last rank: CollectiveError on every rank, at
    construction and in the step after they were set in param_groups."""
    count = 0
    for key, value in OTHER_VALUES.items():
        if key not in good_options:
            continue
        other = {**good_options, key: value}
        description = f"{cls.__name__}: {key}={value!r} on the last rank only"
        expect_raise(f"{description}, at construction",
                     lambda: cls(params(), world, **on_last(other, good_options)),
                     CollectiveError, ["param group options", repr(value), f"rank {last}"])
        still_works(lambda: cls(params(), world, **good_options), description)
        opt = cls(groups(), world, **good_options)
        fill(opt, 1)
        opt.step()
        before = kit.snapshot(opt)
        if rank == last:
            opt.param_groups[0][key] = value
        fill(opt, 2)
        expect_raise(f"{description}, in param_groups", opt.step, CollectiveError,
                     ["options", "differ between ranks", "nothing was updated"])
        check(kit.unchanged(opt, before), f"{description}: the refused step changed the optimizer")
        opt.param_groups[0][key] = good_options[key]
        fill(opt, 2)
        check(opt.step().step == 2, f"{description}: no recovery")
        count += 2
    return count


def sgd_momentum_buffer():
    """The momentum buffer exists when the defaults or a group ask for momentum at
    construction; momentum set later on an SGD built without it is refused on every rank with
    the fix (build it with momentum), nothing updated."""
    with_group = ZeroSGD(groups({"momentum": 0.9}), world, lr=0.1)
    check(with_group.rule.state_names == ("momentum_buffer",), with_group.rule.state_names)
    opt = ZeroSGD(params(), world, lr=0.1)
    check(opt.rule.state_names == () and not kit.shard_arrays(opt)["state"],
          "an SGD without momentum allocated a buffer")
    fill(opt, 1)
    opt.step()
    before = kit.snapshot(opt)
    if rank == last:
        opt.param_groups[0]["momentum"] = 0.9
    fill(opt, 2)
    expect_raise("SGD momentum without a buffer", opt.step, ValueError,
                 ["momentum=0.9 needs a momentum buffer", "at construction", f"rank {last}"])
    check(kit.unchanged(opt, before), "SGD momentum without a buffer: the step changed something")
    return 1


def options():
    count = 0
    for name, entry in kit.registry().items():
        good_options, bad_options = BAD_OPTIONS.get(name, (entry.defaults,
                                                           [({"lr": -1.0}, ["lr=-1.0"])]))
        for bad, words in bad_options:
            count += at_construction(entry.optimizer, good_options, bad, words)
            count += between_steps(entry.optimizer, good_options, bad, words)
        if size > 1:
            count += differing_between_ranks(entry.optimizer, good_options)
        if name == "sgd":
            count += sgd_momentum_buffer()
    cases["options"] = count


# -- overflow ----------------------------------------------------------------------------------

def make_fp16(loss_scale, **options):
    init = {"w": np.linspace(-1, 1, 300, dtype=np.float32), "b": np.ones(7, np.float32)}
    return ZeroAdam(init, world, lr=1e-2, param_dtype="float16", loss_scale=loss_scale,
                    **options)


def fill_scaled(opt, step, bad_rank=None, bad_value=np.inf):
    rng = np.random.default_rng([step, rank])
    for g in opt.grads.values():
        g[...] = rng.standard_normal(g.shape) * opt.loss_scale / 64
    if rank == bad_rank:
        opt.grads["w"][123] = bad_value


def overflow():
    opt = make_fp16(LossScaler.dynamic_scaler(init_scale=1024.0, min_scale=256.0,
                                              growth_interval=1000))
    fill_scaled(opt, 1)
    check(not opt.step().skipped)
    for bad_rank, bad_value, scale_before in ((last, np.inf, 1024.0), (0, np.nan, 512.0)):
        fill_scaled(opt, 2, bad_rank, bad_value)
        before = kit.snapshot(opt)
        info = opt.step()
        check(info.skipped and info.loss_scale == scale_before and info.step == 1, info)
        check(not np.isfinite(info.grad_norm), info)
        check(opt.loss_scale == scale_before / 2 and opt.step_count == 1, opt.loss_scale)
        check(kit.unchanged(opt, before), "a skipped step changed the optimizer")
        check(not any(np.any(g != 0) for g in opt.grads.values()), "gradients left behind")
    # At the minimum scale an overflow cannot be answered by backing off: error everywhere.
    fill_scaled(opt, 3, last)
    before = kit.snapshot(opt)
    kit.raises(FloatingPointError, ["inf or nan", "loss scale 256", "nothing was updated"],
               opt.step)
    check(kit.unchanged(opt, before), "the refused step changed the optimizer")
    fill_scaled(opt, 4)  # and training goes on once the gradients are finite again
    info = opt.step()
    check(not info.skipped and info.step == 2 and not kit.unchanged(opt, before), info)
    for loss_scale in (None, 128.0):  # without dynamic scaling: an error, naming the fix
        opt = make_fp16(loss_scale)
        fill_scaled(opt, 1, last, np.nan)
        before = kit.snapshot(opt)
        kit.raises(FloatingPointError, ["inf or nan", "loss_scale='dynamic'"], opt.step)
        check(kit.unchanged(opt, before) and opt.step_count == 0, "the refused step changed it")
    # Finite fp16 gradients whose fp16 sum overflows: float32 sums are fine, float16 skip.
    for reduce_dtype, overflows in (("float32", False), ("float16", size > 1)):
        opt = make_fp16(LossScaler.dynamic_scaler(init_scale=2.0), reduce_dtype=reduce_dtype)
        opt.grads["w"][...] = 60000.0  # x 2 ranks > 65504, the largest float16
        info = opt.step()
        check(info.skipped is overflows, (reduce_dtype, info))
    cases["overflow"] = 6


if __name__ == "__main__":
    kit.sub_cases({"construction": construction, "options": options, "overflow": overflow})
    if rank == 0:
        print(f"OK bad input on {size} ranks: " +
              ", ".join(f"{n} {name}" for name, n in cases.items()))
