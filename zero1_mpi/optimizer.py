"""``ZeroAdam`` and ``ZeroAdamW``: Adam with its state sharded over MPI ranks (ZeRO stage 1).

Every rank holds the full parameters and gradients (flat buffers; the model sees named views)
and fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` for its own shard only. ``step()``
averages the gradients with a reduce-scatter, runs the fused Adam kernel on the owned shard and
all-gathers the updated parameters. The result equals one process running ``torch.optim.Adam``
(or ``AdamW``) on the gradients averaged over ranks.

The constructor and ``step()`` must be called on all ranks of the communicator. Input errors
are detected before the first collective and raised on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from . import backend
from .comm import CollectiveError, Communicator
from .kernels import AdamScalars, make_adam
from .layout import DEFAULT_BUCKET_ELEMENTS, build_layout
from .memory import MemoryReport

FP32 = np.dtype(np.float32)
REDUCE_DTYPES = ("float32", "float16")


class ZeroAdam:
    """Adam (``torch.optim.Adam`` semantics) with optimizer state sharded over MPI ranks.

    Args:
        params: mapping name -> NumPy or CuPy array (initial values; rank 0's are broadcast).
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None), or a
            ``zero1_mpi.Communicator`` built from one.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``.
        decoupled_weight_decay: AdamW's decay (``p *= 1 - lr * wd``) instead of L2.
        param_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; default: the arrays' dtype.
        reduce_dtype: precision of the gradient sum over ranks. ``"float32"`` (default) sums
            in fp32: fp32 gradients with ``Reduce_scatter_block``, 16-bit ones exchanged with
            ``Alltoall`` and summed locally in fp32 in rank order (exact, deterministic).
            ``"float16"`` (float16 gradients only) sums in MPI's float16 reduction.
        bucket_elements: upper bound of a communication bucket, in elements.
        cuda_aware: whether MPI takes GPU buffers; None asks the environment and MPI.
    """

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, *, decoupled_weight_decay=False, param_dtype=None,
                 reduce_dtype="float32", bucket_elements=DEFAULT_BUCKET_ELEMENTS,
                 cuda_aware=None):
        self.comm = (comm if isinstance(comm, Communicator)
                     else Communicator(comm, cuda_aware=cuda_aware))
        size = self.comm.size

        try:
            dtype, backend_name = _check_params(params, param_dtype)
            group = _check_hyperparameters(lr, betas, eps, weight_decay)
            reduce_dtype = _check_reduce_dtype(reduce_dtype, dtype)
            layout = build_layout({name: tuple(a.shape) for name, a in params.items()}, size,
                                  dtype.name, bucket_elements=bucket_elements)
            error = None
        except (TypeError, ValueError) as exc:
            error, error_type = str(exc), type(exc)
        self.comm.agree(error, error_type if error else ValueError)
        _check_layouts_agree(self.comm, layout)
        self.comm.check_same((backend_name, sorted(group.items()), decoupled_weight_decay,
                              reduce_dtype), "the backend, hyperparameters or reduce_dtype",
                             "construct the optimizer with the same arguments on every rank")

        self.layout = layout
        self.param_dtype = dtype
        self.reduce_dtype = reduce_dtype
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.param_groups = [group]
        self.step_count = 0
        self.backend = backend_name
        xp = self._xp = backend.xp_for(backend_name)

        self._params = xp.zeros(layout.total, dtype)
        self._grads = xp.zeros(layout.total, dtype)
        shard = layout.shard_total
        self._mixed = dtype != FP32
        self._master = xp.zeros(shard, FP32) if self._mixed else None
        self._exp_avg = xp.zeros(shard, FP32)
        self._exp_avg_sq = xp.zeros(shard, FP32)
        self.params = MappingProxyType(self._views(self._params))
        self.grads = MappingProxyType(self._views(self._grads))

        largest_shard = max(b.shard_size for b in layout.buckets)
        self._exchange_16bit = self._mixed and reduce_dtype == "float32"
        reduced_dtype = FP32 if reduce_dtype == "float32" else dtype
        self._reduced = xp.empty(largest_shard, reduced_dtype) if size > 1 else None
        self._received = (xp.empty(max(b.size for b in layout.buckets), dtype)
                          if self._exchange_16bit and size > 1 else None)
        self._adam = make_adam(backend_name, largest_shard)
        self._load_initial_values(params)

    # -- public API --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    def zero_grad(self) -> None:
        """Set every gradient (and the padding) to zero."""
        self._grads.fill(0)

    def step(self) -> None:
        """Average the gradients over ranks, update the owned shard, gather the parameters.

        Must be called on all ranks. The gradient buffers are left as they were (call
        ``zero_grad()`` before the next accumulation).
        """
        self.step_count += 1
        group = self.param_groups[0]
        scalars = AdamScalars.for_step(self.step_count, lr=group["lr"], betas=group["betas"],
                                       eps=group["eps"], weight_decay=group["weight_decay"],
                                       decoupled=self.decoupled_weight_decay,
                                       grad_scale=1.0 / self.world_size)
        for bucket in self.layout.buckets:
            reduced = self._reduce_gradients(bucket)
            lo, hi = bucket.shard(self.rank)
            state = bucket.state
            if self._mixed:
                self._adam(reduced, self._master[state], self._exp_avg[state],
                           self._exp_avg_sq[state], self._params[lo:hi], scalars)
            else:
                self._adam(reduced, self._params[lo:hi], self._exp_avg[state],
                           self._exp_avg_sq[state], None, scalars)
            self.comm.allgather_inplace(self._params[bucket.offset:bucket.offset + bucket.size])

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category, measured from the arrays it allocated."""
        layout, psi = self.layout, self.layout.numel
        owned = layout.owned_real(self.rank)
        state = [self._master, self._exp_avg, self._exp_avg_sq]
        held = self._params.nbytes + self._grads.nbytes + sum(a.nbytes for a in state
                                                              if a is not None)
        real = {"parameters": psi * self.param_dtype.itemsize,
                "gradients": psi * self.param_dtype.itemsize,
                "master_weights": owned * FP32.itemsize if self._mixed else 0,
                "exp_avg": owned * FP32.itemsize,
                "exp_avg_sq": owned * FP32.itemsize}
        scratch = [self._reduced, self._received]
        scratch_bytes = (sum(a.nbytes for a in scratch if a is not None)
                         + self.comm.staging_bytes + self._adam.scratch_bytes)
        return MemoryReport(**real, padding=held - sum(real.values()),
                            comm_scratch=scratch_bytes, psi=psi, world_size=self.world_size,
                            rank=self.rank, param_dtype=self.param_dtype.name)

    # -- internals ---------------------------------------------------------------------------

    def _views(self, flat) -> dict:
        return {t.name: flat[t.offset:t.offset + t.numel].reshape(t.shape)
                for t in self.layout.tensors}

    def _load_initial_values(self, params) -> None:
        """Broadcast rank 0's values bucket by bucket; fp32 masters keep their full precision."""
        xp, layout = self._xp, self.layout
        staging = xp.zeros(max(b.size for b in layout.buckets), FP32) if self._mixed else None
        for bucket in layout.buckets:
            span = slice(bucket.offset, bucket.offset + bucket.size)
            target = staging[:bucket.size] if self._mixed else self._params[span]
            if self.rank == 0:
                for t, lo, hi in layout.pieces(bucket.offset, bucket.offset + bucket.size):
                    values = xp.asarray(params[t.name]).reshape(-1)
                    target[lo - bucket.offset:hi - bucket.offset] = values[lo - t.offset:
                                                                           hi - t.offset]
            self.comm.bcast(target)
            if self._mixed:
                self._params[span] = target.astype(self.param_dtype)
                lo, hi = bucket.shard(self.rank)
                self._master[bucket.state] = target[lo - bucket.offset:hi - bucket.offset]

    def _reduce_gradients(self, bucket):
        """This rank's shard of the bucket's gradients, summed over ranks."""
        grads = self._grads[bucket.offset:bucket.offset + bucket.size]
        if self.world_size == 1:
            return grads
        reduced = self._reduced[:bucket.shard_size]
        if not self._exchange_16bit:
            self.comm.reduce_scatter_sum(grads, reduced)
            return reduced
        received = self._received[:bucket.size]
        self.comm.alltoall(grads, received)
        blocks = received.reshape(self.world_size, bucket.shard_size)
        reduced[...] = blocks[0]
        for block in blocks[1:]:
            self._xp.add(reduced, block, out=reduced, dtype=FP32)
        return reduced


class ZeroAdamW(ZeroAdam):
    """AdamW (``torch.optim.AdamW`` semantics): ``ZeroAdam`` with decoupled weight decay."""

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, **kwargs):
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, comm, lr, betas, eps, weight_decay, **kwargs)


def _check_params(params, param_dtype):
    """``(param dtype, backend name)`` for valid ``params``; TypeError/ValueError otherwise."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of name -> array, got "
                        f"{type(params).__name__}: pass e.g. {{'w': w, 'b': b}}")
    if not params:
        raise ValueError("params is empty: pass at least one named array")
    backends, dtypes = set(), set()
    for name, array in params.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter name {name!r} must be a str")
        kind = backend.backend_name(array)
        if kind is None:
            raise TypeError(f"params[{name!r}] is a {type(array).__name__}: pass a NumPy or "
                            "CuPy array (convert other frameworks' tensors with np.asarray or "
                            "cupy.from_dlpack)")
        if array.dtype.kind != "f" and array.dtype != backend.BFLOAT16:
            raise TypeError(f"params[{name!r}] has dtype {array.dtype}: parameters must be "
                            "floating point (float32, float16 or bfloat16)")
        if array.size and not bool(backend.xp_for(kind).isfinite(array).all()):
            raise ValueError(f"params[{name!r}] holds non-finite values (inf or nan): "
                             "initialize it with finite numbers")
        backends.add(kind)
        dtypes.add(np.dtype(array.dtype))
    if len(backends) > 1:
        raise TypeError("params mixes NumPy and CuPy arrays: put all of them on the host or "
                        "all on the GPU")
    if param_dtype is None:
        if len(dtypes) > 1:
            names = ", ".join(sorted(d.name for d in dtypes))
            raise ValueError(f"params have several dtypes ({names}): pass "
                             "param_dtype='float32', 'float16' or 'bfloat16'")
        (param_dtype,) = dtypes
        if param_dtype.name not in backend.PARAM_DTYPES:
            raise ValueError(f"params have dtype {param_dtype.name}, which is not a parameter "
                             "dtype: pass param_dtype='float32', 'float16' or 'bfloat16'")
    return backend.resolve_dtype(param_dtype), backends.pop()


def _check_hyperparameters(lr, betas, eps, weight_decay) -> dict:
    def number(value, name):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")
        return float(value)

    lr, eps, weight_decay = number(lr, "lr"), number(eps, "eps"), number(weight_decay,
                                                                         "weight_decay")
    if lr < 0:
        raise ValueError(f"lr={lr!r} must be >= 0")
    if eps < 0:
        raise ValueError(f"eps={eps!r} must be >= 0 (torch's default is 1e-8)")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas={betas!r} must be a pair such as (0.9, 0.999)") from None
    for i, beta in enumerate((number(beta1, "betas[0]"), number(beta2, "betas[1]"))):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta!r} must be in [0, 1)")
    return {"lr": lr, "betas": (float(beta1), float(beta2)), "eps": eps,
            "weight_decay": weight_decay}


def _check_reduce_dtype(reduce_dtype, dtype) -> str:
    name = np.dtype(reduce_dtype).name if not isinstance(reduce_dtype, str) else reduce_dtype
    if name not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} is not supported: use 'float32' "
                         "(default) or 'float16' (float16 parameters only)")
    if name == "float16" and dtype != np.float16:
        raise ValueError(f"reduce_dtype='float16' needs float16 gradients, but param_dtype is "
                         f"{dtype.name}: use reduce_dtype='float32'")
    return name


def _check_layouts_agree(comm: Communicator, layout) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built one layout."""
    try:
        comm.check_same(layout.fingerprint, "the parameter layout", "")
    except CollectiveError:
        described = comm.comm.allgather(([(t.name, t.shape) for t in layout.tensors],
                                         ("param_dtype", layout.dtype)))
        mine = described[0]
        for other, theirs in enumerate(described):
            if theirs == mine:
                continue
            if len(theirs[0]) != len(mine[0]):
                diff = (f"{len(mine[0])} tensors", f"{len(theirs[0])} tensors")
            else:
                diff = next((a, b) for a, b in zip(mine[0] + [mine[1]], theirs[0] + [theirs[1]])
                            if a != b)
            raise CollectiveError(
                f"ranks passed different parameters: rank 0 has {diff[0]}, rank {other} "
                f"has {diff[1]}: every rank must pass the same names, shapes and dtypes "
                "in the same order") from None
        raise
