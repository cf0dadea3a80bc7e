"""What the framework bindings (``zero1_mpi.torch``, ``zero1_mpi.jax``,
``zero1_mpi.transformers``) share and need, apart from their public entry points.

- ``common.py``: the rule argument resolved to an optimizer class, and the core's public
  interface passed through.
- ``torch_compat.py``: torch's terms (param groups, ``torch.optim`` arguments, gradient
  clipping) to and from the core.
- ``torch_binding.py``: the torch binding's checks (before binding and at each step) and its
  autograd and module hooks.
- ``torch_units.py``: stage 3's units of a module tree and the hooks that gather and free them.
- ``jax_params.py``: a pytree of parameters made into the core's named groups.
- ``optax_names.py``: optax's names of the rules' options.
- ``schedules.py``: learning-rate schedules kept beside the core's param groups.
"""

__all__: list[str] = []
