"""The one helper module of the multi-rank case scripts (``tests/cases``) and of the tests that
build optimizers in one process.

- The world (``world``, ``rank``, ``size``, ``last``) and rank-aware checks: ``check``,
  ``raises`` (assertions that ``python -O`` keeps, naming the rank), ``on_last``.
- Seeded inputs: ``SHAPES`` (awkward ones), ``init_values``, ``grads_of`` (each rank's own,
  which every rank can compute), ``mean_grads`` (their float64 mean, the oracle's input).
- Building and training: ``build`` (the engine running one variant of a rule),
  ``groups_of`` (two param groups), ``train`` and ``hand_over`` (write or hand over the
  gradients, scaled by the loss scale), ``close_to`` and ``near`` (the project's bounds),
  ``state_rows`` and ``rows_by_tensor`` (the sharded state through the public interface).
- The rules of ``zero1_mpi.rules.registry`` as the tests iterate them: ``rule_cases`` (each
  variant with the option sets that make it), ``oracle`` (the rule's float64 reference where
  ``reference.py`` has one, else one process running the engine on the averaged gradients).
- The one place that reads an optimizer's internals: ``shard_arrays`` (its flat arrays),
  ``fail_in`` (a planted failure inside ``step()``), ``pipeline_state``, ``watchdog_thread``,
  ``persistent_requests``, ``host_kernel_scratch``. The engine's private attributes move;
  these follow them, nothing else in the tests names one.
"""

from __future__ import annotations

import hashlib
import sys
import zlib

import numpy as np
from mpi4py import MPI

from reference import (ReferenceAdam, ReferenceLAMB, ReferenceLion, ReferenceSGD,
                       ReferenceSignMomentum, close_to_reference, max_ulp_diff)
from zero1_mpi.kernels.backend import like, resolve_dtype, to_numpy, xp_for

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
last = size - 1
DTYPES = ("float32", "float16", "bfloat16")
#: Awkward shapes: 0-d, empty, sizes no rank count divides, one longer than a bucket quantum.
SHAPES = {"scalar": (), "empty": (0, 3), "vec": (7,), "mat": (5, 13), "long": (700,)}


# -- checks ------------------------------------------------------------------------------------

def check(condition, message="check failed") -> None:
    """An assertion that ``python -O`` keeps; the message names this rank."""
    if not condition:
        raise AssertionError(f"rank {rank} of {size}: {message}")


def raises(kind, text, fn):
    """``fn()`` must raise ``kind`` whose message holds ``text`` (a string, or each of a list
    of strings); returns the exception."""
    try:
        fn()
    except kind as exc:
        missing = [t for t in ([text] if isinstance(text, str) else text) if t not in str(exc)]
        check(not missing, f"{kind.__name__} without {missing}: {exc}")
        return exc
    raise AssertionError(f"rank {rank} of {size}: no {kind.__name__} ({text!r})")


def on_last(bad, ok):
    """``bad`` on the last rank, ``ok`` on the others: a mistake of one rank only."""
    return bad if rank == last else ok


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(to_numpy(a)), np.ascontiguousarray(to_numpy(b))
    return a.shape == b.shape and a.dtype == b.dtype and \
        np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def everywhere_same(value: bytes) -> bool:
    """Whether every rank holds the same ``value`` (all ranks)."""
    return len(set(world.allgather(hashlib.sha256(value).hexdigest()))) == 1


# -- seeded inputs -----------------------------------------------------------------------------

def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def init_values(shapes=SHAPES, seed=5, xp=np, r=0) -> dict:
    """Initial values (fp32); ``r`` != 0 gives another rank's (that rank 0's must win)."""
    return {k: xp.asarray(np.random.default_rng([seed, r, _seed(k)]).standard_normal(s)
                          .astype(np.float32)) for k, s in shapes.items()}


def with_ties(values: dict) -> dict:
    """``values`` with every third element moved onto a tie (its bits: an even bf16 high half
    and exactly half a step more): what bf16's remainder masters keep apart."""
    from zero1_mpi.state.masters import TIE
    out = {}
    for k, v in values.items():
        v = np.array(v, np.float32).reshape(-1)
        bits = v.view(np.uint32)
        bits[::3] = (bits[::3] & 0xFFFE0000) | TIE
        out[k] = v.reshape(values[k].shape)
    return out


def grads_of(r, step, shapes=SHAPES, dtype=np.float32, seed=13, micro=0, scale=None,
             exact=False) -> dict:
    """Rank ``r``'s gradients of ``step`` in ``dtype``; they grow with the rank (x1, x2, x4 ..
    unless ``scale``), so that the sum over ranks rounds. ``exact``: multiples of 1/64 below
    1/4, whose sums over up to 4 ranks are exact in every dtype and order."""
    rng = np.random.default_rng([seed, step, micro, r])
    if exact:
        return {k: (rng.integers(-16, 16, s) / 64).astype(dtype) for k, s in shapes.items()}
    factor = 2.0 ** r if scale is None else scale
    return {k: (rng.standard_normal(s).astype(np.float32) * factor).astype(dtype)
            for k, s in shapes.items()}


def mean_grads(step, shapes=SHAPES, dtype=np.float32, ranks=None, **kw) -> dict:
    """The float64 mean over ``ranks`` (default: all) of what each handed over in ``dtype``."""
    every = [grads_of(r, step, shapes, dtype, **kw) for r in range(size if ranks is None
                                                                     else ranks)]
    return {k: np.mean([np.asarray(e[k], np.float64) for e in every], axis=0) for k in shapes}


def sum_grads(step, shapes=SHAPES, dtype=np.float32, **kw) -> dict:
    """The float64 sum over all ranks of what each handed over in ``dtype``."""
    every = [grads_of(r, step, shapes, dtype, **kw) for r in range(size)]
    return {k: np.sum([np.asarray(e[k], np.float64) for e in every], axis=0) for k in shapes}


def use_backend(name: str):
    """NumPy, or CuPy with this rank's GPU picked by its place on the node; the array module."""
    xp = xp_for(name)
    if name == "cupy":
        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        xp.cuda.Device(local % xp.cuda.runtime.getDeviceCount()).use()
    return xp


# -- the rules of the registry -----------------------------------------------------------------

#: Per rule name: option sets that together make every variant of the rule (each is run on
#: the variants that accept it), and the float64 reference (``reference.py``) whose options
#: they are. A rule of the registry not named here is run with its optimizer's defaults
#: against one process running the engine.
RULE_OPTIONS = {
    "adam": [{"lr": 1e-2, "weight_decay": 0.0},
             {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}],
    "sgd": [{"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
            {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
            {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.05}],
    "lion": [{"lr": 1e-3, "weight_decay": 0.0},
             {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.1}],
    "lamb": [{"lr": 1e-2, "weight_decay": 0.0},
             {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-4, "weight_decay": 0.1}],
    "sign_momentum": [{"lr": 1e-2, "beta": 0.8}],  # the docs' example rule (update-rules.md)
}
REFERENCES = {
    "adam": lambda variant, **kw: ReferenceAdam(decoupled=variant.decoupled, **kw),
    "sgd": lambda variant, **kw: ReferenceSGD(**kw),
    "lion": lambda variant, **kw: ReferenceLion(**kw),
    "lamb": lambda variant, **kw: ReferenceLAMB(**kw),
    "sign_momentum": lambda variant, **kw: ReferenceSignMomentum(**kw),
}


def registry(only=None) -> dict:
    """``zero1_mpi.rules.registry.builtin_rules()``, or its entries named in ``only``."""
    from zero1_mpi.rules.registry import builtin_rules
    rules = builtin_rules()
    return {k: v for k, v in rules.items() if only is None or k in only}


def rule_cases(entry):
    """``(variant, options)`` for each variant of the registry entry and each option set of
    ``RULE_OPTIONS`` it accepts (its optimizer's defaults for a rule not named there); every
    variant gets at least one."""
    cases = []
    for variant in entry.variants:
        mine = []
        for options in RULE_OPTIONS.get(entry.name, [{}]):
            try:
                mine.append((variant, variant.check_options(**{**entry.defaults, **options})))
            except ValueError:
                continue
        check(mine, f"{entry.name} {variant.settings()}: no option set of RULE_OPTIONS fits")
        cases += mine
    return cases


def variant_cases(entry):
    """``(variant, options)`` once per variant of the registry entry: the last option set of
    ``rule_cases`` it accepts."""
    found = {}
    for variant, options in rule_cases(entry):
        found[id(variant)] = (variant, options)
    return list(found.values())


def run_twin(kernel, rule, options, param_dtype, grad_dtype, n, steps=3, grad_scale=0.5):
    """One owned range of ``n`` elements through ``kernel`` (a twin of ``rule``) for ``steps``
    steps, both phases for a two-phase rule (the range is one whole tensor): ``[master,
    *states, param]`` (no ``param`` for fp32 parameters)."""
    master = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    states = [np.zeros(n, np.float32) for _ in rule.state_names]
    param = None if np.dtype(param_dtype) == np.float32 else master.astype(param_dtype)
    for step in range(1, steps + 1):
        grad = np.random.default_rng(step).standard_normal(n).astype(grad_dtype)
        s = rule.scalars(step, options, grad_scale)
        if rule.tensor_sums:
            sums = kernel.tensor_sums(grad, master, *states, s)
            kernel.apply(master, *states, param, rule.tensor_scalars(s, sums))
        else:
            kernel(grad, master, *states, param, s)
    return [master, *states] + ([] if param is None else [param])


def build(variant, params, comm=world, options=None, **engine):
    """The engine running ``variant`` (a ``Rule``) with group ``options`` (checked)."""
    from zero1_mpi import ShardedOptimizer
    return ShardedOptimizer(params, comm, variant, options, **engine)


def groups_of(params: dict, options: dict, second=None) -> list:
    """Two param groups: the tensors of two or more dimensions, and the rest with options of
    their own (``second``: half the learning rate, and no weight decay where the rule has
    it)."""
    if second is None:
        second = {"lr": options["lr"] / 2}
        if "weight_decay" in options:
            second["weight_decay"] = 0.0
    flat = [k for k, v in params.items() if np.ndim(v) < 2]
    return [{"params": {k: v for k, v in params.items() if k not in flat}},
            {"params": {k: params[k] for k in flat}, **second}]


def oracle(variant, options, init, *, groups=None, max_grad_norm=None, engine=None,
           use_engine=False):
    """One process on the averaged gradients, from ``init`` (rank 0's values) with the
    optimizer's param ``groups`` (their names and options): the rule's float64 reference
    (``REFERENCES``; ``step(means)``, ``params`` in float64), or for a rule without one (or
    ``use_engine``) the engine alone on ``COMM_SELF`` (``EngineOracle``)."""
    if groups is not None:  # as the references take them: names, and the group's options
        groups = [{"names": list(g["params"]), **{o: v for o, v in g.items() if o != "params"}}
                  for g in groups]
    make_ref = REFERENCES.get(variant.name)
    if make_ref is not None and not use_engine:
        return make_ref(variant, **{**options, "groups": groups}, max_grad_norm=max_grad_norm,
                        params={k: to_numpy(v) for k, v in init.items()})
    return EngineOracle(variant, options, init, groups, max_grad_norm, engine or {})


class EngineOracle:
    """The engine alone (one rank) as an oracle: ``step_sum(sums)`` takes the exact sums over
    the N ranks of what each handed over (``sum_grads(..., exact=True)``), written with a loss
    scale N times theirs, so that it scales them by the same fp32 factor as the N ranks do
    (bitwise the same for an elementwise rule while clipping does not apply). It runs on
    ``init``'s backend: a CuPy kernel and its NumPy twin may round differently (FMA)."""

    def __init__(self, variant, options, init, groups, max_grad_norm, engine):
        params = dict(init)
        if groups:
            params = [{"params": {k: params[k] for k in g["names"]},
                       **{o: v for o, v in g.items() if o != "names"}} for g in groups]
        engine = dict(engine)
        self.scale = float(engine.pop("loss_scale", None) or 1.0)
        self.opt = build(variant, params, MPI.COMM_SELF, options, max_grad_norm=max_grad_norm,
                         loss_scale=self.scale * size, **engine)

    def step_sum(self, sums):
        for k, g in sums.items():
            grad = self.opt.grads[k]
            grad[...] = like(grad, (np.asarray(g) * self.scale).astype(self.opt.param_dtype))
        return self.opt.step()

    @property
    def params(self):
        return self.opt.params


# -- building and training ---------------------------------------------------------------------

def hand_over(opt, grads: dict, order=None, accumulate=False) -> None:
    """Write ``grads`` (stage 1; added with ``accumulate``) or hand them over with
    ``add_grad`` (stage 2, in backward's order: the reverse of the layout unless ``order``),
    multiplied by the loss scale, in the parameters' dtype."""
    xp = xp_for(opt.backend)
    names = order or list(grads)[::-1]
    for k in names:
        g = xp.asarray((np.asarray(grads[k], np.float32) * opt.loss_scale)
                       .astype(opt.param_dtype))
        if opt.grad_shard_dtype is not None:
            opt.add_grad(k, g)
        elif accumulate:
            opt.grads[k][...] += g
        else:
            opt.grads[k][...] = g


def train(opt, steps, shapes=None, *, wait=True, **grads_kw):
    """``opt.step()`` for each step of ``steps``, on this rank's ``grads_of`` (``shapes``: the
    optimizer's by default; in the parameters' dtype, scaled by the loss scale); returns the
    last ``StepInfo``."""
    shapes = shapes or {t.name: t.shape for t in opt.layout.tensors}
    info = None
    for step in steps:
        hand_over(opt, grads_of(rank, step, shapes, opt.param_dtype, **grads_kw))
        info = opt.step(wait=wait)
    return info


def params_of(opt) -> dict:
    """Copies of every parameter, as NumPy arrays."""
    return {k: to_numpy(v).copy() for k, v in opt.params.items()}


def close_to(opt_params: dict, want: dict, dtype, where: str) -> None:
    """Every tensor within the project's bound (``reference.close_to_reference``)."""
    for k, w in want.items():
        ok, err = close_to_reference(to_numpy(opt_params[k]), w, resolve_dtype(dtype))
        check(ok, f"{where}: {k!r} off by {err}")


def near(a, b, bitwise: bool, what: str) -> None:
    """Bitwise, or (a two-phase rule's norms summed in another order) within float32
    rounding; 16-bit arrays within one unit in the last place."""
    a, b = np.asarray(to_numpy(a)).reshape(-1), np.asarray(to_numpy(b)).reshape(-1)
    if bitwise:
        check(same_bits(a, b), f"{what}: differs")
    elif a.dtype == np.float32:
        err = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3), initial=0))
        check(err <= 1e-5, f"{what}: off by {err}")
    else:
        check(max_ulp_diff(a, b) <= 1, f"{what}: {max_ulp_diff(a, b)} ulps off")


def state_rows(opt) -> dict:
    """This rank's sharded state through the public ``shard_state``: row name -> the
    concatenation of its owned ranges (copies)."""
    rows = {row: [] for row in opt.state_rows}
    for lo, hi, state in opt.layout.owned(opt.shard_rank):
        views = opt.shard_state(lo, hi, state)
        for row in opt.state_rows:
            rows[row].append(to_numpy(views[row]).reshape(-1).copy())
    return {row: np.concatenate(parts) if parts else np.zeros(0, np.float32)
            for row, parts in rows.items()}


def rows_by_tensor(opt, comm=world) -> dict:
    """Every row of ``shard_state`` as fp32, by row and tensor name: the whole state, on every
    rank of ``comm`` (the optimizer's)."""
    full = {row: np.zeros(opt.layout.total, np.float32) for row in opt.state_rows}
    mine = [(lo, hi, {row: np.asarray(to_numpy(v), np.float32)
                      for row, v in opt.shard_state(lo, hi, st).items()})
            for lo, hi, st in opt.layout.owned(opt.shard_rank)]
    for pieces in comm.allgather(mine):
        for lo, hi, rows in pieces:
            for row, values in rows.items():
                full[row][lo:hi] = values
    return {row: {t.name: full[row][t.offset : t.offset + t.numel] for t in opt.layout.tensors}
            for row in full}


def sub_cases(table: dict, argv=None) -> list:
    """The sub-cases named on the command line (all of ``table`` when none), each run in
    order; returns their names."""
    names = (sys.argv[1:] if argv is None else argv) or list(table)
    for name in names:
        check(name in table, f"unknown sub-case {name!r}; known: {', '.join(table)}")
        table[name]()
    return names


# -- the one place that reads an optimizer's internals -----------------------------------------

def shard_arrays(opt) -> dict:
    """The flat arrays ``opt`` holds (views, not copies): ``params`` (the whole parameter
    buffer; with ``shard_params`` this rank's shard), ``grads`` (the whole gradient buffer; None with ``shard_gradients``), ``master``
    (the masters' array: fp32, or remainders; None where the parameters are their own master)
    and ``state`` (name -> array)."""
    state, gradients = opt.state, opt.gradients
    return {"params": getattr(state.flat, "local", state.flat), "grads": None if gradients.sharded else gradients.buffer,
            "master": None if state.masters is None else state.masters.held,
            "state": {name: kept.held for name, kept in state.stored.items()}}


def snapshot(opt) -> tuple:
    """Copies of everything a step may change on this rank: the arrays, and the step count."""
    arrays = shard_arrays(opt)
    held = [arrays["params"], arrays["master"], *arrays["state"].values()]
    return [to_numpy(a).copy() for a in held if a is not None], opt.step_count


def unchanged(opt, before) -> bool:
    arrays, steps = snapshot(opt)
    return steps == before[1] and len(arrays) == len(before[0]) and \
        all(same_bits(a, b) for a, b in zip(arrays, before[0]))


def digest(opt) -> tuple:
    """This rank's state (``snapshot``) as a sha256, with the step count."""
    arrays, steps = snapshot(opt)
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest(), steps


def fail_in(opt, phase: str, fn) -> None:
    """From now on, this rank's ``opt.step()`` calls ``fn`` at ``phase`` instead of the engine:
    ``"update"``, the rule's kernel on the shard (after the reductions, before the gathers);
    ``"agree"``, the sum of squares before the step's agreement."""
    if phase == "update":
        opt.state._update_part = fn
    elif phase == "agree":
        opt._reductions.sum_of_squares = fn
    else:
        raise ValueError(f"phase={phase!r}: 'update' or 'agree'")


def param_gathers(opt):
    """The parameters' gathers: ``in_flight``, ``scratch_bytes``; with ``shard_params`` the
    ``UnitGathers`` (``order``: the last step's units by index)."""
    return opt.state.gathers


def pipeline_state(opt) -> tuple:
    """``(the buckets whose reduction started this round, the all-gathers in flight)``."""
    return tuple(opt.gradients.started), opt.state.gathers.in_flight


def watchdog_thread(opt):
    """The thread of ``opt``'s step watchdog (None without ``step_timeout``)."""
    return opt.watchdog._thread


def persistent_requests(comm) -> int:
    """How many persistent requests a ``zero1_mpi.Communicator`` holds."""
    return len(comm.started)


def host_kernel_scratch(opt) -> int:
    """The scratch bytes of ``opt``'s update kernel (with offload, the host kernel's)."""
    state = opt.state
    return getattr(state.place, "host_kernel", state.place.kernel).scratch_bytes


def reduce_now(opt) -> np.ndarray:
    """Complete this step's reductions as ``step()`` would and return this rank's reduced
    gradient shards (every bucket's, concatenated, as float64), then zero the gradients."""
    shards = opt.gradients.reduce_all()
    got = np.concatenate([np.asarray(to_numpy(s), np.float64) for s in shards])
    opt.gradients.zero()
    return got


def feedback_residuals(opt) -> list:
    """The error-feedback residuals of ``opt``'s 8-bit wire (within the group, across the
    groups), as NumPy copies; empty without ``error_feedback``."""
    gradients = opt.gradients
    parts = (gradients.wire.exchange, gradients.wire.across)
    return [to_numpy(p.quantizer.residual).copy() for p in parts
            if p is not None and p.quantizer is not None and p.quantizer.residual is not None]
