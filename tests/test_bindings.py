"""The framework bindings pass the core's whole interface through: every public method and
property of ``ShardedOptimizer`` is on ``zero1_mpi.torch.ZeroOptimizer`` and
``zero1_mpi.jax.ZeroOptimizer`` with the core's signature, but for the few each binding does its
framework's way (``step``, ``zero_grad``); and a call reaches the core."""

import inspect

import numpy as np
import pytest
from mpi4py import MPI

from zero1_mpi import ShardedOptimizer
from zero1_mpi.bindings.common import CORE_INTERFACE, PassThrough

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

#: What each binding does its framework's way, with a signature of its own (torch's
#: clip_grad_norm_ takes torch's arguments and gives a tensor).
OWN = {"torch": {"step", "zero_grad", "clip_grad_norm_"}, "jax": {"step", "zero_grad"}}


def binding(name):
    if name == "torch":
        pytest.importorskip("torch")
        from zero1_mpi.torch import ZeroOptimizer
    else:
        from zero1_mpi.jax import ZeroOptimizer
    return ZeroOptimizer


def test_the_core_interface_is_every_public_member():
    public = {name for name, member in vars(ShardedOptimizer).items()
              if not name.startswith("_") and (callable(member) or isinstance(member, property))}
    assert set(CORE_INTERFACE) == public
    assert {"save", "finish_save", "load", "checkpoint_on_signal", "memory_report", "close",
            "step_count", "loss_scale", "shard_state"} <= public


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_bindings_have_the_core_interface_with_its_signatures(name):
    cls = binding(name)
    for member, core in CORE_INTERFACE.items():
        theirs = inspect.getattr_static(cls, member)
        if isinstance(core, property):
            assert isinstance(theirs, property), member
            assert theirs.__doc__ == core.__doc__, member
        elif member not in OWN[name]:
            assert inspect.signature(theirs) == inspect.signature(core), member
    assert str(inspect.signature(cls.save)) == \
        "(self, path, keep: 'int | None' = None, *, blocking: 'bool' = True)"


def test_a_forwarded_call_reaches_the_core(tmp_path):
    class Binding(PassThrough):
        def __init__(self, sharded):
            self.sharded = sharded

    from zero1_mpi import ZeroSGD
    with Binding(ZeroSGD({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, lr=0.5)) as opt:
        opt.sharded.grads["w"][...] = 1.0
        assert opt.step().step == 1 == opt.step_count
        pending = opt.save(tmp_path, blocking=False)
        assert opt.finish_save() == pending.path and pending.done
        assert opt.memory_report().psi == 3 and opt.state_rows == ("master",)
    assert opt.sharded.closed
