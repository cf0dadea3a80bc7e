"""Bad options of the rules beside Adam raise the same clear error on every rank, never hang,
and change nothing: at construction, when set in ``param_groups`` between steps (the next
``step()`` raises), and when valid options differ between ranks.

    mpiexec -n N python -m mpi4py tests/cases/bad_input_rules.py RULE [RULE ...]

Each RULES entry names the optimizer, good options, and bad options with the words the error
must hold (the value and the fix); a rule whose optimizer the package lacks is refused. Bad
values are planted on every rank and on the last rank only (the others must raise too). After
every failure a good optimizer of that rule must still step alike on every rank, which shows
no collective was left half-done.
"""

import sys

import numpy as np
from mpi4py import MPI

import zero1_mpi
from expect import check
from zero1_mpi import CollectiveError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
last = size - 1

# name: (optimizer class name, good options, [(bad options, words the message must hold)]).
# The good options are valid between steps too (SGD: with momentum, so the buffer exists).
RULES = {
    "sgd": ("ZeroSGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01,
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
    "lion": ("ZeroLion", {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}, [
        ({"betas": (0.9, 1.0)}, ["betas[1]=1.0", "must be in [0, 1)"]),
        ({"betas": (-0.1, 0.99)}, ["betas[0]=-0.1", "must be in [0, 1)"]),
        ({"betas": (1.5, 0.99)}, ["betas[0]=1.5", "must be in [0, 1)"]),
        ({"betas": 0.9}, ["betas=0.9", "must be a pair"]),
        ({"lr": -1e-4}, ["lr=-0.0001", "must be >= 0"]),
        ({"weight_decay": -0.1}, ["weight_decay=-0.1", "must be >= 0"]),
    ]),
    "lamb": ("ZeroLAMB", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}, [
        ({"betas": (0.9, 1.0)}, ["betas[1]=1.0", "[0, 1)"]),
        ({"betas": (-0.1, 0.999)}, ["betas[0]=-0.1", "[0, 1)"]),
        ({"eps": -1e-6}, ["eps=-1e-06", ">= 0"]),
        ({"lr": -1.0}, ["lr=-1.0", ">= 0"]),
        ({"weight_decay": -0.1}, ["weight_decay=-0.1", ">= 0"]),
    ]),
}
# A valid value that differs from the good one, per option: set on the last rank only.
OTHER_VALUES = {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "weight_decay": 0.02,
                "nesterov": True, "betas": (0.8, 0.95), "eps": 1e-7}


def params():
    return {"w": np.linspace(-1, 1, 60, dtype=np.float32).reshape(5, 12),
            "b": np.ones(7, np.float32), "s": np.float32(0.5)}


def groups(second=None):
    """Two groups (so that messages must name the right one): ``second`` overrides group 1."""
    p = params()
    return [{"params": {"w": p["w"]}}, {"params": {"b": p["b"], "s": p["s"]}, **(second or {})}]


def on_last(bad, ok):
    return bad if rank == last else ok


def expect(description, fn, exc_type, words):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is checked right below
        check(isinstance(exc, exc_type),
              f"{description}: unexpected {type(exc).__name__} on rank {rank}: {exc}")
        missing = [w for w in words if w not in str(exc)]
        check(not missing, f"{description}: message {str(exc)!r} lacks {missing} on rank {rank}")
    else:
        raise AssertionError(f"{description}: no error raised on rank {rank}")


def snapshot(opt):
    arrays = [opt.state.flat, *opt.state.state.values()] + ([opt.state.master] if opt.state.mixed else [])
    return [a.copy() for a in arrays], opt.step_count


def unchanged(opt, before):
    arrays, steps = snapshot(opt)
    return steps == before[1] and all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                      for a, b in zip(arrays, before[0]))


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
    check(all(np.array_equal(w, other) for other in comm.allgather(w)),
          f"{description}: the ranks disagree after a good step")


def at_construction(cls, good, bad, words):
    """Bad in the defaults (every rank), in group 1 on the last rank only."""
    cases = 0
    for where, make, where_words in (
            ("defaults, every rank", lambda: cls(params(), comm, **{**good, **bad}), []),
            ("group 1, last rank", lambda: cls(groups(on_last(bad, {})), comm, **good),
             [f"rank {last}"])):
        description = f"{cls.__name__}({bad}) in the {where}"
        expect(description, make, ValueError, words + where_words)
        still_works(lambda: cls(params(), comm, **good), description)
        cases += 1
    return cases


def between_steps(cls, good, bad, words):
    """Set in param_groups[1] on the last rank after a step: the next step raises on every
    rank, updates nothing, and training goes on once the option is set right again."""
    description = f"{cls.__name__}: param_groups[1] set to {bad} on the last rank"
    opt = cls(groups(), comm, **good)
    fill(opt, 1)
    opt.step()
    before = snapshot(opt)
    saved = dict(opt.param_groups[1])
    if rank == last:
        opt.param_groups[1].update(bad)
    fill(opt, 2)
    expect(description, opt.step, ValueError, ["param_groups[1]", f"rank {last}", *words])
    check(unchanged(opt, before), f"{description}: the failed step changed the optimizer")
    check(not any(np.any(g != 0) for g in opt.grads.values()),
          f"{description}: the failed step left gradients behind")
    opt.param_groups[1].clear()
    opt.param_groups[1].update(saved)
    fill(opt, 2)
    check(opt.step().step == 2 and not unchanged(opt, before), f"{description}: no recovery")
    w = opt.params["w"].copy()
    check(all(np.array_equal(w, other) for other in comm.allgather(w)),
          f"{description}: the ranks disagree after recovering")
    return 1


def differing_between_ranks(cls, good):
    """Valid options that differ on the last rank: CollectiveError on every rank, at
    construction and in the step after they were set in param_groups."""
    cases = 0
    for key, value in OTHER_VALUES.items():
        if key not in good:
            continue
        other = {**good, key: value}
        description = f"{cls.__name__}: {key}={value!r} on the last rank only"
        expect(f"{description}, at construction",
               lambda: cls(params(), comm, **on_last(other, good)), CollectiveError,
               ["param group options", repr(value), f"rank {last}"])
        still_works(lambda: cls(params(), comm, **good), description)
        opt = cls(groups(), comm, **good)
        fill(opt, 1)
        opt.step()
        before = snapshot(opt)
        if rank == last:
            opt.param_groups[0][key] = value
        fill(opt, 2)
        expect(f"{description}, in param_groups", opt.step, CollectiveError,
               ["options", "differ between ranks", "nothing was updated"])
        check(unchanged(opt, before), f"{description}: the refused step changed the optimizer")
        opt.param_groups[0][key] = good[key]
        fill(opt, 2)
        check(opt.step().step == 2, f"{description}: no recovery")
        cases += 2
    return cases


def sgd_momentum_without_buffer():
    """Momentum set between steps on an SGD built without it: refused on every rank with the
    fix (build it with momentum), nothing updated."""
    opt = zero1_mpi.ZeroSGD(params(), comm, lr=0.1)
    fill(opt, 1)
    opt.step()
    before = snapshot(opt)
    if rank == last:
        opt.param_groups[0]["momentum"] = 0.9
    fill(opt, 2)
    expect("SGD momentum without a buffer", opt.step, ValueError,
           ["momentum=0.9 needs a momentum buffer", "at construction", f"rank {last}"])
    check(unchanged(opt, before), "SGD momentum without a buffer: the step changed something")
    return 1


def main(rules):
    cases = 0
    for name in rules:
        class_name, good, bad_options = RULES[name]
        check(hasattr(zero1_mpi, class_name), f"zero1_mpi has no {class_name}")
        cls = getattr(zero1_mpi, class_name)
        for bad, words in bad_options:
            cases += at_construction(cls, good, bad, words)
            cases += between_steps(cls, good, bad, words)
        if size > 1:
            cases += differing_between_ranks(cls, good)
        if name == "sgd":
            cases += sgd_momentum_without_buffer()
    if rank == 0:
        print(f"OK bad rule options: {'+'.join(rules)}, {cases} cases on {size} ranks")


if __name__ == "__main__":
    main(sys.argv[1:])
