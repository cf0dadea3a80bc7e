"""Tests made from the declaration of every engine option (``zero1_mpi.config.options.OPTIONS``, its
``Values``): a new option gets them by being declared.

    mpiexec -n 4 python -m mpi4py tests/cases/declared_options.py   (an even N >= 4)

For each option, with the options its ``needs`` names set on every rank:
- every value outside what it takes (``bad_values``: the wrong type, bools for numbers, nan,
  inf, either side of its bounds, near-miss strings, None where None is not taken) raises on
  every rank, naming the option, and a good optimizer still steps alike afterwards;
- the values at its edges (``edge_values``: the default, ``other``, its bounds, NumPy scalars)
  are taken, as the value the check returns, the same on every rank;
- ``other`` without its ``needs`` is refused, naming the option (unless ``alone``): a value
  that would mean nothing is not taken silently;
- ``other`` on the last rank only (the default on the others) ends with the agreement's
  ``CollectiveError`` naming the option on every rank; for a ``local`` option it is taken, each
  rank keeping its own.
Each construction runs on every rank, so a check that communicates on some ranks only would
hang here (the test's timeout), not pass.
"""

import math

import numpy as np

from casekit import check, last, rank, size, world
from zero1_mpi import CollectiveError, ZeroAdamW
from zero1_mpi.config.options import OPTIONS

counts = {"bad": 0, "edge": 0, "alone": 0, "differs": 0}
problems = []  # every failure, reported together at the end


def trying(what, run):
    """``run()``, its AssertionError (or an unexpected exception) noted, not raised."""
    try:
        run()
    except AssertionError as exc:
        problems.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problems.append(f"{what}: {type(exc).__name__}: {exc}")


def bad_values(option) -> list:
    """Values outside ``option.values``, each with what makes it bad."""
    v = option.values
    found = [] if v.none else [(None, "None")]
    if v.kind in ("number", "integer"):
        found += [(True, "a bool"), ("1", "a string"), (math.nan, "nan"),
                  (math.inf, "inf"), (-math.inf, "-inf")]
        if v.low is not None:
            below = v.low if v.low_open else (v.low - 1 if v.kind == "integer" else
                                              v.low - 1e-9)
            found += [(below, "below the least"), (-1, "negative")] if below != -1 else \
                [(below, "below the least")]
        if v.high is not None:
            found.append((v.high + 1e-9, "above the most"))
        if v.kind == "integer":
            found += [(float(v.other), "a float"), (1.5, "not whole")]
    elif v.kind == "choice":
        first = v.choices[0]
        found += [("nonsense", "unknown"), (first.upper(), "another case"),
                  (first + " ", "a space"), (first[:-1], "a prefix"), (1, "a number"),
                  (True, "a bool")]
    elif v.kind == "units":  # build()'s tensors are "w" and "b"
        found += [("w", "a string"), (["w", "b"], "a list"), ({}, "empty"),
                  ({"u": ["w"]}, "a tensor in no unit"), ({"u": ["w", "b", "x"]}, "unknown"),
                  ({"u": ["w"], "v": ["w", "b"]}, "a tensor in two units"),
                  ({"u": [], "v": ["w", "b"]}, "an empty unit"), ({1: ["w", "b"]}, "a number")]
    else:  # flag
        found += [(1, "an int"), (0, "zero"), ("True", "a string")]
    return [(value, why) for value, why in found if value not in v.also]


def edge_values(option) -> list:
    """Values ``option`` takes: its default, ``other``, its bounds, NumPy scalars."""
    v = option.values
    found = [option.default, v.other]
    if v.kind in ("number", "integer"):
        if v.low is not None:
            found.append(v.low + (1e-6 if v.low_open else 0))
        if v.high is not None:
            found.append(v.high)
        found.append(np.int64(v.other) if v.kind == "integer" else np.float32(v.other))
    elif v.kind == "flag":
        found.append(np.bool_(v.other))
    return found


def build(**options):
    return ZeroAdamW({"w": np.ones((3, 40), np.float32), "b": np.zeros(40, np.float32)},
                     world, lr=1e-2, **options)


def still_steps():
    """A good optimizer after a refused one: the same bits on every rank after a step."""
    opt = build()
    opt.grads["w"][...] = rank + 1
    opt.step()
    bits = opt.params["w"].tobytes()
    check(all(b == bits for b in world.allgather(bits)), "ranks differ after a refusal")
    opt.close()


def refused(option, options, what):
    try:
        opt = build(**options)
    except (ValueError, TypeError) as exc:
        check(f"{option.name}=" in str(exc) or f"{option.name} " in str(exc),
              f"{what}: the error does not name {option.name}: {exc}")
        return
    opt.close()
    raise AssertionError(f"rank {rank}: {what}: taken")


def one_option(option):
    v, needs = option.values, dict(option.values.needs)
    for value, why in bad_values(option):
        what = f"{option.name}={value!r} ({why})"
        trying(what, lambda: refused(option, {**needs, option.name: value}, what))
        counts["bad"] += 1
    still_steps()
    for value in edge_values(option):
        def taken():
            opt = build(**{**needs, option.name: value})
            mine = repr(getattr(opt.options, option.name))
            check(len(set(world.allgather(mine))) == 1 or option.local,
                  f"{option.name}={value!r}: checked differently on the ranks")
            opt.close()
        trying(f"{option.name}={value!r} (an edge)", taken)
        counts["edge"] += 1
    if needs and not v.alone:
        what = f"{option.name}={v.other!r} without {needs}"
        trying(what, lambda: refused(option, {option.name: v.other}, what))
        counts["alone"] += 1
    if size > 1:
        def differing():
            mine = v.other if rank == last else option.default
            if option.local:  # a value of each rank's own
                mine = v.other + rank
            try:
                opt = build(**{**needs, option.name: mine})
            except CollectiveError as exc:
                check(not option.local, f"{option.name} is local, yet the ranks must agree")
                check(option.name in str(exc), f"the agreement does not name {option.name}")
            else:
                check(option.local, f"{option.name}={v.other!r} on rank {last} only: taken")
                check(getattr(opt.options, option.name) == mine,
                      f"{option.name}={mine!r} on rank {rank}: not kept")
                opt.close()
        trying(f"{option.name} differing", differing)
        counts["differs"] += 1


def main():
    check(size >= 4 and size % 2 == 0, "run on 4 ranks (or an even number beyond): an 'other' "
          "value is shard groups of 2, fewer ranks than all")
    for option in OPTIONS:
        one_option(option)
    still_steps()
    check(not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems))
    if rank == 0:
        print(f"OK declared options on {size} ranks: {len(OPTIONS)} options, "
              f"{counts['bad']} bad values, {counts['edge']} edge values, "
              f"{counts['alone']} without their needs, {counts['differs']} differing on a rank",
              flush=True)


if __name__ == "__main__":
    main()
