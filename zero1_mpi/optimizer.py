"""The optimizers: the sharded engine (``engine.ShardedOptimizer``) driving one rule each.

``ZeroAdam`` / ``ZeroAdamW`` (``rules.adam``), ``ZeroSGD`` (``rules.sgd``), ``ZeroLion``
(``rules.lion``) and ``ZeroLAMB`` (``rules.lamb``), with their state sharded over MPI ranks
(ZeRO stage 1). The result equals one process running ``torch.optim.Adam`` / ``AdamW`` / ``SGD``
(or Lion, LAMB), with ``clip_grad_norm_``, on the gradients averaged over ranks.
"""

from __future__ import annotations

from .engine import ShardedOptimizer, StepInfo  # noqa: F401 (StepInfo: part of this API)
from .layout import DEFAULT_BUCKET_ELEMENTS
from .rules.adam import Adam
from .rules.lamb import Lamb
from .rules.lion import Lion
from .rules.sgd import SGD


class ZeroAdam(ShardedOptimizer):
    """Adam (``torch.optim.Adam`` semantics) with optimizer state sharded over MPI ranks.

    Args:
        params, comm: as for ``ShardedOptimizer``: a mapping name -> NumPy or CuPy array (or
            param groups with ``lr``, ``betas``, ``eps``, ``weight_decay``), and an mpi4py
            intracommunicator (``MPI.COMM_WORLD`` when None) or a ``Communicator``.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``; defaults for the groups.
        decoupled_weight_decay: AdamW's decay (``p *= 1 - lr * wd``) instead of L2.
        param_dtype, loss_scale, max_grad_norm, reduce_dtype, bucket_elements, cuda_aware,
            shard_group_size: see ``ShardedOptimizer``.
    """

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, *, decoupled_weight_decay=False, param_dtype=None,
                 loss_scale=None, max_grad_norm=None, reduce_dtype="float32",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, cuda_aware=None,
                 shard_group_size=None):
        super().__init__(params, comm, Adam(decoupled_weight_decay),
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                         param_dtype=param_dtype, loss_scale=loss_scale,
                         max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
                         bucket_elements=bucket_elements, cuda_aware=cuda_aware,
                         shard_group_size=shard_group_size)

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.rule.decoupled


class ZeroAdamW(ZeroAdam):
    """AdamW (``torch.optim.AdamW`` semantics): ``ZeroAdam`` with decoupled weight decay."""

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, **kwargs):
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, comm, lr, betas, eps, weight_decay, **kwargs)


class ZeroSGD(ShardedOptimizer):
    """SGD (``torch.optim.SGD`` semantics) with its momentum buffer sharded over MPI ranks.

    ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``: as in
    ``torch.optim.SGD``; defaults for the groups (settable per group between steps). The
    momentum buffer (4 bytes per parameter / N) exists only when the default or some group has
    a non-zero momentum at construction. Other arguments: see ``ShardedOptimizer``.
    """

    def __init__(self, params, comm=None, lr=1e-3, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, *, param_dtype=None, loss_scale=None,
                 max_grad_norm=None, reduce_dtype="float32",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, cuda_aware=None,
                 shard_group_size=None):
        super().__init__(params, comm, SGD(_wants_momentum(params, momentum)),
                         {"lr": lr, "momentum": momentum, "dampening": dampening,
                          "weight_decay": weight_decay, "nesterov": nesterov},
                         param_dtype=param_dtype, loss_scale=loss_scale,
                         max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
                         bucket_elements=bucket_elements, cuda_aware=cuda_aware,
                         shard_group_size=shard_group_size)


class ZeroLion(ShardedOptimizer):
    """Lion (Chen et al. 2023) with its ``exp_avg`` sharded over MPI ranks: ``lr``, ``betas``,
    ``weight_decay`` are the groups' defaults. Other arguments: see ``ShardedOptimizer``."""

    def __init__(self, params, comm=None, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 param_dtype=None, loss_scale=None, max_grad_norm=None,
                 reduce_dtype="float32", bucket_elements=DEFAULT_BUCKET_ELEMENTS,
                 cuda_aware=None, shard_group_size=None):
        super().__init__(params, comm, Lion(),
                         {"lr": lr, "betas": betas, "weight_decay": weight_decay},
                         param_dtype=param_dtype, loss_scale=loss_scale,
                         max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
                         bucket_elements=bucket_elements, cuda_aware=cuda_aware,
                         shard_group_size=shard_group_size)


class ZeroLAMB(ShardedOptimizer):
    """LAMB (You et al. 2020) with its ``exp_avg`` and ``exp_avg_sq`` sharded over MPI ranks:
    Adam's bias-corrected direction plus ``weight_decay * p``, scaled per tensor by the trust
    ratio ``||p|| / ||u||`` (norms over whole tensors, from the shards with one ``Allreduce``
    per step). ``lr``, ``betas``, ``eps``, ``weight_decay`` are the groups' defaults. Other
    arguments: see ``ShardedOptimizer``."""

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, *, param_dtype=None, loss_scale=None, max_grad_norm=None,
                 reduce_dtype="float32", bucket_elements=DEFAULT_BUCKET_ELEMENTS,
                 cuda_aware=None, shard_group_size=None):
        super().__init__(params, comm, Lamb(),
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                         param_dtype=param_dtype, loss_scale=loss_scale,
                         max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
                         bucket_elements=bucket_elements, cuda_aware=cuda_aware,
                         shard_group_size=shard_group_size)


def _wants_momentum(params, momentum) -> bool:
    """Whether the default or any group asks for momentum (bad input is reported later)."""
    groups = params if isinstance(params, (list, tuple)) else []
    values = [momentum] + [g.get("momentum", 0) for g in groups if isinstance(g, dict)]
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0
               for v in values)
