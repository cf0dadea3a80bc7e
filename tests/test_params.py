"""Param groups as the user writes them, normalized; and the decay_groups helper."""

import numpy as np
import pytest

from zero1_mpi import decay_groups
from zero1_mpi.flat.inputs import normalize_groups
from zero1_mpi.rules.adam import Adam

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
ADAM = Adam(decoupled=False)


def arrays():
    return {"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32),
            "gain": np.ones((), np.float32)}


def test_a_mapping_is_one_group_with_the_defaults():
    groups, flat = normalize_groups(arrays(), DEFAULTS, ADAM)
    assert groups == [{"names": ("w", "b", "gain"), **DEFAULTS}]
    assert list(flat) == ["w", "b", "gain"]


def test_groups_take_their_own_options_and_keep_order():
    a = arrays()
    groups, flat = normalize_groups([{"params": {"b": a["b"]}, "lr": 0.5},
                                     {"params": {"w": a["w"], "gain": a["gain"]},
                                      "betas": [0.8, 0.9], "weight_decay": 0.1}], DEFAULTS, ADAM)
    assert list(flat) == ["b", "w", "gain"]
    assert groups[0] == {"names": ("b",), **DEFAULTS, "lr": 0.5}
    assert groups[1]["betas"] == (0.8, 0.9) and groups[1]["weight_decay"] == 0.1


def test_decay_groups_exempt_vectors_and_scalars():
    groups = decay_groups(arrays(), weight_decay=0.05)
    assert [sorted(g["params"]) for g in groups] == [["w"], ["b", "gain"]]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    custom = decay_groups(arrays(), no_decay=lambda name, a: name == "gain")
    assert [sorted(g["params"]) for g in custom] == [["b", "w"], ["gain"]]
    assert len(decay_groups({"b": np.ones(3)})) == 1  # no empty group


@pytest.mark.parametrize("params, exc, words", [
    ([], TypeError, "non-empty list"),
    ("w", TypeError, "mapping"),
    ([{"params": {"w": np.ones(2)}, "momentum": 0.9}], ValueError, "['momentum']"),
    ([{"params": [np.ones(2)]}], TypeError, "params[0]['params']"),
    ([{"params": {"w": np.ones(2)}}, {"params": {"w": np.ones(2)}}], ValueError,
     "'w' appears in more than one group"),
    ([{"params": {"w": np.ones(2)}, "lr": -1.0}], ValueError, "lr=-1.0"),
    ([{"params": {}}], ValueError, "empty"),
])
def test_bad_groups_name_the_problem(params, exc, words):
    with pytest.raises(exc) as info:
        normalize_groups(params, DEFAULTS, ADAM)
    assert words in str(info.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flat_host_buffers_start_on_64_bytes(dtype):
    """So that JAX (XLA:CPU) can alias the parameters through DLPack instead of copying."""
    from mpi4py import MPI
    from zero1_mpi import ZeroAdam
    for _ in range(8):  # NumPy alone gives 16-byte alignment: some of these would miss
        opt = ZeroAdam({"w": np.ones(37, np.float32)}, MPI.COMM_SELF, param_dtype=dtype)
        assert opt.params["w"].ctypes.data % 64 == 0 and opt.grads["w"].ctypes.data % 64 == 0
