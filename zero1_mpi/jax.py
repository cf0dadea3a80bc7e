"""JAX binding: pytrees in and out of a ZeRO stage 1 optimizer (``ZeroOptimizer``).

``ZeroOptimizer(params, "adamw", lr=...)`` takes a pytree of arrays (leaves named by their tree
paths, e.g. ``"params/Dense_0/kernel"``); ``opt.params()`` gives the same pytree of JAX arrays
viewing the flat parameter buffer; ``opt.step(grads)`` takes the gradients as a like pytree.
``step()`` rewrites what the views show, which JAX assumes never happens; three rules keep that
safe: (1) every computation that reads the views is finished before ``step()`` (``step(grads)``
waits for ``grads``; wait for anything else yourself); (2) call ``params()`` again after each
``step()`` / ``load()`` (an older pytree shows the new values; ``jnp.copy`` keeps a snapshot);
(3) pass the parameters to jit-compiled functions as arguments, never close over them (a
captured array is a constant). Imports JAX, which ``import zero1_mpi`` does not.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from .binding import PassThrough, optimizer_class
from .comm import Communicator
from .engine import ShardedOptimizer, StepInfo

_JAX_MISSING: ImportError | None
try:
    import jax
except ImportError as exc:  # the module still imports (tools, docs); ZeroOptimizer needs JAX
    jax, _JAX_MISSING, _TRACER = None, exc, ()
else:
    _JAX_MISSING, _TRACER = None, getattr(jax.core, "Tracer", ())

__all__ = ["ALIGNMENT", "ZeroOptimizer", "leaf_names"]

#: Bytes: XLA:CPU makes a JAX array of host memory without a copy only at this alignment.
ALIGNMENT = 64


def leaf_names(tree) -> list[str]:
    """The name of each leaf of ``tree``, in ``jax.tree_util.tree_leaves`` order: its path's
    keys joined by ``/`` (dict keys, sequence indices, attribute names: ``"layers/0/w"``)."""
    _require_jax()
    return [_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class ZeroOptimizer(PassThrough):
    """A zero1_mpi sharded optimizer over a pytree of JAX (or NumPy) arrays.

    Args:
        params: a pytree of floating-point arrays (dicts, lists, tuples, Flax's variable
            dicts): the initial values (rank 0's are broadcast). A leaf is named by its path.
        rule: an optimizer class (``zero1_mpi.ZeroAdamW``, ``ZeroAdam``, ``ZeroSGD``,
            ``ZeroLion``, ``ZeroLAMB`` or your own) or one of ``"adamw"``, ``"adam"``,
            ``"sgd"``, ``"lion"``, ``"lamb"``.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None) or a
            ``zero1_mpi.Communicator``.
        groups: param groups, a list of ``{"params": selector, <rule options>}``; a selector
            is ``f(name, leaf) -> bool`` or a collection of leaf names. A leaf joins the first
            group that selects it; the leaves no group selects form a group with the
            optimizer's options. ``[{"params": lambda name, leaf: leaf.ndim < 2,
            "weight_decay": 0.0}]`` exempts biases and norm scales from weight decay.
        **options: the rule's options (``lr``, ``betas``, ``weight_decay``, ...) and the
            engine's (``param_dtype``, ``max_grad_norm``, ``loss_scale``, ...).

    The core ``ShardedOptimizer`` is ``opt.sharded``. In its flat buffer each group's leaves
    whose size is a whole number of 64-byte lines come first (in tree order), then the others,
    so that those start on 64 bytes (in the first group always, in a later one where the
    groups before it fill whole lines) and ``params()`` hands them out without a copy.

    Measured on XLA:CPU (``unsafe_buffer_pointer()`` against ``.ctypes.data``; ``zero_copy()``
    records what happened in a run): ``jax.device_put`` of a NumPy array is a view of it when
    it starts on a multiple of 64 bytes, a copy otherwise (JAX 0.5 to 0.10; 0.4.30 also
    aliased some unaligned ones; ``jnp.from_dlpack`` does the same). That holds for bfloat16
    too, so bfloat16 parameters come out as bfloat16 JAX arrays (NumPy's DLPack export has no
    bfloat16; ``device_put`` needs none).
    ``params()`` costs 40-60 us a leaf (one batched ``device_put``, a loaded 2-core machine);
    ``step(grads)`` adds about 0.1 ms plus 5 us a leaf to the core's step. Gradients: ``np.asarray``
    of a JAX array is a read-only view of its buffer; the copy into the flat gradient buffer is
    the one copy a step makes (XLA writes outputs to buffers it allocates; donating a view as
    an input does not make it receive them). JAX 0.4.30 ran jit calls on the CPU synchronously
    (rule 1 held by itself there); from 0.5 on they run asynchronously.
    """

    def __init__(self, params, rule="adamw", comm=None, *, groups=None, **options):
        _require_jax()
        if not isinstance(comm, Communicator):
            comm = Communicator(comm, cuda_aware=options.pop("cuda_aware", None))
        error = None  # the try binds core_params and cls, or agree() raises on every rank
        try:  # checked on every rank before the core's own checks and collectives
            leaves, self._treedef = jax.tree_util.tree_flatten(params)
            self._names = leaf_names(params)
            arrays = dict(
                zip(self._names, (_host_param(n, x) for n, x in zip(self._names, leaves)))
            )
            if len(arrays) < len(self._names):
                raise ValueError(
                    f"two leaves of params have the same name "
                    f"{_first_duplicate(self._names)!r}: rename one (names join "
                    "the path's keys with '/')"
                )
            cls = optimizer_class(rule)
            core_params = _grouped(arrays, groups, _itemsize(arrays, options))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
        comm.agree(error)
        #: The core optimizer: buffers, layout, param groups, checkpoints.
        self.sharded: ShardedOptimizer = cls(core_params, comm, **options)
        #: The ``StepInfo`` of the last ``step()`` (None before the first).
        self.last_step: StepInfo | None = None
        self._param_views = [self.sharded.params[n] for n in self._names]
        self._grad_views = (
            []
            if self.sharded.grad_shard_dtype is not None
            else [self.sharded.grads[n] for n in self._names]
        )
        self._dtype = self.sharded.param_dtype
        self._problem: str | None = None  # found by accumulate(), raised by step()
        self._accumulated = False  # gradients added since the last step
        self._params_copied: set[str] = set()
        self._grads_copied: set[str] = set()

    # -- pytrees in and out ------------------------------------------------------------------

    def params(self):
        """The parameters as a pytree of ``params``' structure: JAX arrays on the flat buffer
        (views where 64-byte aligned, copies elsewhere), valid until the next ``step()`` or
        ``load()`` (the module's rules). Completes an all-gather in flight first."""
        self.sharded.wait()
        arrays = jax.device_put(self._param_views)
        for name, view, array in zip(self._names, self._param_views, arrays):
            if _pointer(array) != view.ctypes.data:
                self._params_copied.add(name)
        return jax.tree_util.tree_unflatten(self._treedef, arrays)

    def accumulate(self, grads) -> None:
        """Add ``grads`` (a pytree like ``params()``) to the gradient buffer, for gradient
        accumulation over micro-batches; then ``step()``. Waits for JAX to finish computing
        them. Local (no communication): a wrong pytree adds nothing and is raised by the next
        ``step()`` on every rank. 16-bit parameters accumulate in their own dtype. With
        ``shard_gradients`` it hands them over (a micro-batch, reduced as its buckets fill;
        all ranks)."""
        self._take(grads, "accumulate()")

    def step(self, grads=None) -> StepInfo:
        """Average the gradients over ranks, update this rank's shard and gather the
        parameters; all ranks. ``grads``: this step's gradients (a pytree like ``params()``,
        of the parameters' dtype or float32), added to any ``accumulate()`` gave; None: just
        those. Waits for JAX to finish computing ``grads``. A wrong pytree, shape or dtype on
        any rank raises ValueError on every rank, naming the leaf; nothing is updated and the
        gradients are dropped. Returns (and keeps as ``last_step``) the core's ``StepInfo``."""
        if grads is not None:
            self._take(grads, "step()")
        problem, self._problem, self._accumulated = self._problem, None, False
        self.last_step = self.sharded.step(problem=problem)
        return self.last_step

    def zero_copy(self) -> dict[str, list[str]]:
        """What the transfers did so far, as leaf names in tree order: ``"aligned"``, the
        leaves whose view starts on 64 bytes; ``"params"``, those every ``params()`` handed out
        without a copy; ``"grads"``, those whose every gradient was read without a copy."""
        return {
            "aligned": [
                n for n, v in zip(self._names, self._param_views) if v.ctypes.data % ALIGNMENT == 0
            ],
            "params": [n for n in self._names if n not in self._params_copied],
            "grads": [n for n in self._names if n not in self._grads_copied],
        }

    @property
    def names(self) -> list[str]:
        """The leaf names, in tree order."""
        return list(self._names)

    # -- the core's, passed through -----------------------------------------------------------

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (and an error ``accumulate()`` found)."""
        self.sharded.zero_grad()
        self._problem, self._accumulated = None, False

    @property
    def param_groups(self) -> list[dict]:
        """The core's param groups (``"names"`` and the rule's options; set ``lr`` there)."""
        return self.sharded.param_groups

    # -- gradients in ------------------------------------------------------------------------

    def _take(self, grads, where: str) -> None:
        """Check ``grads``, wait for them and add them to the gradient buffer (with
        ``shard_gradients``: hand them over); a problem is kept for ``step()`` (nothing
        added; handed over as zeros, so that every rank reduces the same buckets)."""
        stage2 = self.sharded.grad_shard_dtype is not None
        if self._problem is not None and not stage2:
            return
        try:
            hosts = None if self._problem else self._host_grads(grads)
        except (TypeError, ValueError) as exc:
            self._problem, hosts = f"{where}: {exc}", None
        if stage2:
            hosts = hosts or [np.zeros(v.shape, v.dtype) for v in self._param_views]
            for name, host in zip(self._names, hosts):
                self.sharded.add_grad(name, host)
            return
        if hosts is None:
            return
        for _name, view, host in zip(self._names, self._grad_views, hosts):
            if self._accumulated:
                view += host
            else:
                view[...] = host  # the step's one copy
        self._accumulated = True

    def _host_grads(self, grads) -> list[np.ndarray]:
        """``grads``' leaves as NumPy arrays (views of JAX's buffers), in tree order, once JAX
        has computed them; ValueError naming the first wrong leaf and the fix."""
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        if treedef != self._treedef:
            names = leaf_names(grads)
            if names != self._names:
                raise ValueError(_structure_problem(names, self._names))
        for name, leaf, view in zip(self._names, leaves, self._param_views):
            if isinstance(leaf, _TRACER):
                raise TypeError(
                    f"grads[{name!r}] is a tracer: call step() outside jax.jit "
                    "(return the gradients from the jit-compiled function)"
                )
            shape = np.shape(leaf)
            dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.result_type(leaf)
            if shape != view.shape:
                raise ValueError(
                    f"grads[{name!r}] has shape {shape}, its parameter "
                    f"{view.shape}: pass the gradient of each leaf of params()"
                )
            if dtype != self._dtype and dtype != np.float32:
                raise ValueError(
                    f"grads[{name!r}] has dtype {dtype}: pass the parameters' "
                    f"dtype ({self._dtype.name}) or float32 (cast with .astype)"
                )
        jax.block_until_ready([x for x in leaves if isinstance(x, jax.Array)])
        hosts = []
        for name, leaf in zip(self._names, leaves):
            host = np.asarray(leaf)
            if isinstance(leaf, jax.Array) and _pointer(leaf) != host.ctypes.data:
                self._grads_copied.add(name)
            hosts.append(host)
        return hosts


def _require_jax() -> None:
    if jax is None:
        raise ImportError(f"zero1_mpi.jax needs JAX: pip install 'zero1-mpi[jax]' ({_JAX_MISSING})")


def _path_name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _first_duplicate(names: list[str]) -> str:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    raise ValueError("no two names are the same")  # (called only when two are)


def _pointer(array) -> int | None:
    """The address of a single-device JAX array's buffer (None where it has none)."""
    try:
        return array.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - sharded or deleted arrays: not a view
        return None


def _host_param(name: str, leaf) -> np.ndarray:
    if isinstance(leaf, _TRACER):
        raise TypeError(f"params[{name!r}] is a tracer: build ZeroOptimizer outside jax.jit")
    return np.asarray(leaf)  # a read-only view of a JAX array; the core copies it


def _itemsize(arrays: dict, options: dict) -> int:
    """The bytes of one parameter element in the flat buffer, as far as known here (the core
    checks ``param_dtype`` and the leaves' dtypes)."""
    from .backend import resolve_dtype

    try:
        if options.get("param_dtype") is not None:
            return np.dtype(resolve_dtype(options["param_dtype"])).itemsize
        return max(a.dtype.itemsize for a in arrays.values())
    except Exception:  # noqa: BLE001 - the core raises the real error
        return 1


def _grouped(arrays: dict, groups, itemsize: int):
    """The core's ``params``: one mapping, or a list of groups (the leaves no group selects
    first), each ordered whole-64-byte leaves first."""
    if groups is None:
        return _aligned_first(arrays, itemsize)
    if isinstance(groups, Mapping) or not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"groups must be a list of {{'params': selector, <options>}} dicts, got "
            f"{type(groups).__name__}"
        )
    chosen: list[dict] = [{} for _ in groups]
    rest: dict = {}
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise TypeError(
                f"groups[{index}] must be a dict with a 'params' selector (a "
                "function (name, leaf) -> bool or a collection of names)"
            )
        selector = group["params"]
        if isinstance(selector, str) or not (
            callable(selector) or isinstance(selector, Collection)
        ):
            raise TypeError(
                f"groups[{index}]['params'] must be a function (name, leaf) -> bool "
                f"or a collection of leaf names, got {selector!r}"
            )
        if not callable(selector):
            unknown = sorted(set(selector) - set(arrays))
            if unknown:
                raise ValueError(
                    f"groups[{index}]['params'] names leaves that params lacks: "
                    f"{unknown}; the names are {list(arrays)}"
                )
    for name, array in arrays.items():
        for index, group in enumerate(groups):
            selector = group["params"]
            if selector(name, array) if callable(selector) else name in selector:
                chosen[index][name] = array
                break
        else:
            rest[name] = array
    found = [{"params": _aligned_first(rest, itemsize)}] if rest else []
    return found + [
        {**group, "params": _aligned_first(members, itemsize)}
        for group, members in zip(groups, chosen)
        if members
    ]


def _aligned_first(arrays: dict, itemsize: int) -> dict:
    """``arrays`` with those of a whole number of 64-byte lines first, each part in order."""
    whole = {n: a for n, a in arrays.items() if a.size * itemsize % ALIGNMENT == 0}
    return {**whole, **{n: a for n, a in arrays.items() if n not in whole}}


def _structure_problem(got: list[str], want: list[str]) -> str:
    missing = [n for n in want if n not in set(got)]
    extra = [n for n in got if n not in set(want)]
    if missing or extra:
        what = "; ".join(
            part
            for part in (
                missing and f"it lacks {missing[:3]}",
                extra and f"it has {extra[:3]} that params lacks",
            )
            if part
        )
    else:
        what = "its leaves come in another order"
    return (
        f"grads is not a pytree like the parameters: {what}: pass jax.grad's result for "
        "opt.params() (same structure, one gradient per leaf)"
    )
