"""``ZeroAdam`` and ``ZeroAdamW``: Adam with its state sharded over MPI ranks (ZeRO stage 1).

The sharded engine (``engine.ShardedOptimizer``) driving the Adam rule (``rules.adam``). The
result equals one process running ``torch.optim.Adam`` (or ``AdamW``), with
``clip_grad_norm_``, on the gradients averaged over ranks.
"""

from __future__ import annotations

from .engine import ShardedOptimizer, StepInfo  # noqa: F401 (StepInfo: part of this API)
from .layout import DEFAULT_BUCKET_ELEMENTS
from .rules.adam import Adam


class ZeroAdam(ShardedOptimizer):
    """Adam (``torch.optim.Adam`` semantics) with optimizer state sharded over MPI ranks.

    Args:
        params, comm: as for ``ShardedOptimizer``: a mapping name -> NumPy or CuPy array (or
            param groups with ``lr``, ``betas``, ``eps``, ``weight_decay``), and an mpi4py
            intracommunicator (``MPI.COMM_WORLD`` when None) or a ``Communicator``.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``; defaults for the groups.
        decoupled_weight_decay: AdamW's decay (``p *= 1 - lr * wd``) instead of L2.
        param_dtype, loss_scale, max_grad_norm, reduce_dtype, bucket_elements, cuda_aware: see
            ``ShardedOptimizer``.
    """

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, *, decoupled_weight_decay=False, param_dtype=None,
                 loss_scale=None, max_grad_norm=None, reduce_dtype="float32",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, cuda_aware=None):
        super().__init__(params, comm, Adam(decoupled_weight_decay),
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                         param_dtype=param_dtype, loss_scale=loss_scale,
                         max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
                         bucket_elements=bucket_elements, cuda_aware=cuda_aware)

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.rule.decoupled


class ZeroAdamW(ZeroAdam):
    """AdamW (``torch.optim.AdamW`` semantics): ``ZeroAdam`` with decoupled weight decay."""

    def __init__(self, params, comm=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, **kwargs):
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, comm, lr, betas, eps, weight_decay, **kwargs)
