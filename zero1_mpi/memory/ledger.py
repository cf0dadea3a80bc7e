"""What one rank holds, by category: the ``MemoryReport`` of an optimizer's parts.

``memory_report(state, gradients, reductions, persistence, backend)`` measures the arrays the
parts allocated (``nbytes``, not formulas) and splits them so that every byte is counted once:
the real elements of the parameters (stage 3: this rank's shard), the gradients (the full
buffer, or stage 2's shard), the masters and each state array of this rank's shard; their
padding; the scratch a step holds (communication slots, kernels', MPI staging, stage 3's
working buffers); and, where the state is offloaded (in part or
whole) or the parameters live on a GPU, what of it the host holds. Local: no collectives.
"""

from __future__ import annotations

from .report import MemoryReport

__all__ = ["memory_report"]


def memory_report(state, gradients, reductions, persistence, backend: str) -> MemoryReport:
    """The bytes this rank holds in ``state`` (``state.ShardedState``), ``gradients`` (a
    ``gradients.GradientSource``), the engine's ``reductions`` and ``persistence``'s host copy;
    ``backend``: the parameters' (``"cupy"``: MPI's staging buffers are the host's)."""
    layout = state.layout
    psi, owned = layout.numel, layout.owned_real(state.shard_rank)
    grads, masters = gradients.buffer, state.masters
    real = {
        "parameters": (owned if state.params_sharded else psi) * state.dtype.itemsize,
        "gradients": (owned if gradients.sharded else psi) * grads.dtype.itemsize,
        "master_weights": 0 if masters is None else masters.real_bytes(owned),
    }
    state_bytes = {name: kept.real_bytes(owned) for name, kept in state.stored.items()}
    sharded_real = real["master_weights"] + sum(state_bytes.values())
    held = sum(k.nbytes for k in state.stored.values()) + (0 if masters is None else masters.nbytes)
    host_held, host_real, host_share = state.host_bytes(owned)
    device = state.flat.nbytes + grads.nbytes + held - host_held
    padding = device - real["parameters"] - real["gradients"] - (sharded_real - host_real)
    device_scratch, host_scratch = state.scratch_bytes()
    routes = [c.routes for c in state.topology.communicators]  # each group's own too
    staging = sum(r.staging_bytes for r in routes)  # page-locked for CuPy parameters: the host's
    staged_on_host = staging if backend == "cupy" else 0
    return MemoryReport(
        **real,
        state=state_bytes,
        padding=padding,
        comm_scratch=gradients.scratch_bytes
        + reductions.scratch_bytes
        + device_scratch
        + staging
        - staged_on_host
        + sum(r.block_bytes for r in routes),
        psi=psi,
        group_size=layout.group_size,
        rank=state.shard_rank,
        param_dtype=state.dtype.name,
        rule=state.rule.name,
        offloaded=state.on_host,
        offload_fraction=host_share if state.on_host else 1.0,
        host_state=host_real,
        host_padding=host_held - host_real,
        host_scratch=host_scratch + staged_on_host,
        grad_shard_dtype=grads.dtype.name if gradients.sharded else None,
        checkpoint_buffer=persistence.snapshot_bytes,
        error_feedback=gradients.feedback_bytes,
        masters="fp32" if masters is None else masters.kind,
        state_dtype=state.state_dtype,
        params_sharded=state.params_sharded,
    )
