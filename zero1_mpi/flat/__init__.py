"""The flat buffers: where every tensor lives and what the user hands in.

- ``layout.py``: the flat layout (``Layout``, ``Bucket``, ``TensorSlot``): each tensor's range,
  the buckets (the unit of communication) and each rank's shard of them. Pure data.
- ``views.py``: named views of a flat buffer, and the error a closed optimizer's views raise.
- ``inputs.py``: the user's parameters, param groups and hyperparameters, checked and
  normalized (no MPI), with errors that name the value and the fix.

A new way of packing tensors (stage 3's units of the model) goes here.
"""

__all__: list[str] = []
