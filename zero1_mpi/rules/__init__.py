"""Update rules: what an optimizer does to its shard, apart from all that the engine does.

The engine (``zero1_mpi.engine``) owns the buffers, buckets, reductions, gathers, agreement,
loss scaling and clipping, and knows nothing of any rule's math. A rule is a small object with:

- ``name``: recorded in checkpoints and exports (only the same rule loads them);
- ``state_names``: its fp32 state arrays, one element per owned parameter, in order;
- ``options``: the names of its param-group options, and ``check_options(**values)``, which
  returns them normalized or raises ValueError/TypeError naming the value and the fix;
- ``settings()``: rule-wide choices every rank must share (with ``name``);
- ``scalars(step, options, grad_scale)``: the host scalars of one step for one param group;
- ``kernel(kind, largest)``: its fused update for ``"numpy"``, ``"numba"`` or ``"cupy"``,
  called as ``kernel(grad, master, *states, param, scalars)`` on one owned range, with
  ``scratch_bytes``; the three must agree (NumPy and Numba bit for bit).

A rule whose update needs norms of whole tensors (LAMB's trust ratio) declares
``tensor_sums = k`` and runs in two phases instead of one call: ``kernel.tensor_sums(grad,
master, *states, scalars)`` over one piece of one tensor (it may update the state) returns that
piece's ``k`` partial sums; the engine adds them per tensor and over ranks (one ``Allreduce``
per step); ``rule.tensor_scalars(scalars, totals)`` gives each tensor's scalars, and
``kernel.apply(master, *states, param, tensor_scalars)`` updates the piece.

The rules: ``adam`` (Adam, AdamW), ``sgd``, ``lion`` and ``lamb`` (two-phase).
"""
