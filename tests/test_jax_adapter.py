"""zero1_mpi.jax: pytrees in and out (skipped where JAX is not installed, failed instead where
``ZERO1_REQUIRE_JAX=1``, as in CI; the Flax test likewise needs flax and optax there).

The multi-rank case (tests/cases/jax_adapter.py) checks parity with the float64 references on
3 ranks, errors raised on every rank, and a Flax model against ``optax.adamw``; the
tests here show that the module's three aliasing rules are needed (what breaks without them
happens on the installed JAX) and that the adapter's own way keeps them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI
from mpirun import ROOT, run_mpi

REQUIRED = os.environ.get("ZERO1_REQUIRE_JAX") == "1"
try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    if REQUIRED:
        raise ImportError("ZERO1_REQUIRE_JAX=1 but JAX does not import: "
                          "pip install '.[jax]'") from exc
    pytest.skip(f"JAX is not installed (pip install '.[jax]'): {exc}", allow_module_level=True)

from zero1_mpi.jax import ZeroOptimizer, leaf_names

NEW_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 5)


@pytest.mark.parametrize("n", [3])
def test_n_ranks_match_one_process_on_the_averaged_gradients(n):
    out = run_mpi(n, "jax_adapter.py", "parity", *(["errors", "stage2"] if n == 3 else []),
                  timeout=180).stdout
    assert f"OK jax adapter parity: 3 configs x 6 steps on {n} ranks" in out, out
    if n == 3:  # shard_gradients=True: the gradients handed over leaf by leaf (stage 2)
        assert "OK jax adapter parity (stage 2): 3 configs x 6 steps on 3 ranks" in out, out
    if n == 3:  # wrong pytrees, shapes, dtypes and arguments raise on every rank
        assert "OK jax adapter errors on 3 ranks" in out, out


def test_the_8bit_wire_through_the_binding():
    out = run_mpi(3, "jax_adapter.py", "int8", timeout=180).stdout
    assert "OK jax adapter int8 wire on 3 ranks" in out, out


def test_a_flax_model_with_a_jit_step_matches_optax_adamw():
    try:
        import flax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as exc:
        if REQUIRED:
            raise ImportError("ZERO1_REQUIRE_JAX=1 but flax does not import: "
                              "pip install flax") from exc
        pytest.skip(f"flax is not installed (pip install flax): {exc}")
    out = run_mpi(2, "jax_adapter.py", "flax", timeout=180).stdout
    assert "OK jax adapter flax: 10 steps on 2 ranks" in out, out


def test_importing_the_package_does_not_import_jax():
    code = "import sys, zero1_mpi; print('jax' in sys.modules, 'zero1_mpi.jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_leaves_are_named_by_path_and_whole_64_byte_leaves_come_first():
    tree = {"b": [np.ones(3, np.float32), (np.ones((4, 4), np.float32),)],
            "a": {"x": np.ones(5, np.float32), "y": np.ones(32, np.float32)}}
    assert leaf_names(tree) == ["a/x", "a/y", "b/0", "b/1/0"]
    opt = ZeroOptimizer(tree, "sgd", MPI.COMM_SELF, lr=0.1)
    assert opt.names == ["a/x", "a/y", "b/0", "b/1/0"]
    # 128 and 64 bytes first (tree order), then 20 and 12: all but the last start aligned
    assert [t.name for t in opt.sharded.layout.tensors] == ["a/y", "b/1/0", "a/x", "b/0"]
    assert opt.zero_copy()["aligned"] == ["a/x", "a/y", "b/1/0"]
    out = opt.params()
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    done = opt.zero_copy()  # JAX 0.4.30 also aliased some unaligned addresses
    assert done["params"] == done["aligned"] if NEW_JAX else set(done["aligned"]) <= \
        set(done["params"])


def aligned(n: int, dtype, offset_bytes: int = 0) -> np.ndarray:
    """``n`` zeros starting ``offset_bytes`` past a multiple of 64 bytes."""
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset_bytes
    return raw[start:start + n * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_what_the_docstring_says_of_device_put_holds_here(dtype):
    """If this fails after a JAX upgrade, ZeroOptimizer's docstring needs the new facts."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    where = f"JAX {jax.__version__}"
    host = aligned(256, dtype)
    view = jax.device_put(host)
    assert view.unsafe_buffer_pointer() == host.ctypes.data and view.dtype == dtype, where
    host[...] = 3
    assert float(view[0]) == 3.0, where  # a view: it shows what NumPy writes
    odd = aligned(256, dtype, offset_bytes=16)
    if NEW_JAX:
        assert jax.device_put(odd).unsafe_buffer_pointer() != odd.ctypes.data, where
    grad = jnp.ones(256, dtype) * 2
    back = np.asarray(grad)
    assert back.ctypes.data == grad.unsafe_buffer_pointer() and not back.flags.writeable, where


def test_bfloat16_parameters_come_out_as_bfloat16_views():
    """``jax.device_put`` aliases an aligned NumPy bfloat16 array (DLPack would refuse it)."""
    opt = ZeroOptimizer({"w": jnp.ones((8, 8))}, "adamw", MPI.COMM_SELF, param_dtype="bfloat16")
    w = opt.params()["w"]
    assert w.dtype == jnp.bfloat16
    assert w.unsafe_buffer_pointer() == opt.sharded.params["w"].ctypes.data
    info = opt.step({"w": jnp.ones((8, 8), jnp.bfloat16)})
    assert info.step == 1 and opt.zero_copy()["grads"] == ["w"]


def test_the_aliasing_rules_are_needed_and_the_adapter_keeps_them():
    """What the module docstring's rules prevent, shown on the installed JAX: (3) a jit
    function that closes over the parameters keeps their first values; (2) a pytree taken
    before ``step()`` shows the values after it; (1) a computation still running when the
    buffer is rewritten reads the new values. The adapter's way has none of these."""
    n = 1 << 18
    make = lambda: ZeroOptimizer({"w": np.ones(n, np.float32)}, "sgd",
                                 MPI.COMM_SELF, lr=0.5)
    opt = make()
    ones = jnp.ones(n)
    before = opt.params()
    closure = jax.jit(lambda x: (x * before["w"]).sum())
    argument = jax.jit(lambda p, x: (x * p["w"]).sum())
    assert float(closure(ones)) == float(argument(before, ones)) == n
    snapshot = jax.tree.map(jnp.copy, before)
    opt.step({"w": ones})                                  # w: 1 -> 0.5
    after = opt.params()
    assert float(argument(after, ones)) == n / 2           # the adapter's way: an argument
    assert float(closure(ones)) == n                       # (3) broken: a stale constant
    assert float(before["w"][0]) == 0.5                    # (2) the old pytree changed
    assert float(snapshot["w"][0]) == 1.0                  # ... a copy did not

    @jax.jit
    def slow(p):  # about 0.1 s of work that reads the parameters at every iteration
        x = jax.lax.fori_loop(0, 100, lambda i, x: jnp.sin(x) + p["w"], jnp.zeros(n))
        return x.sum(), {"w": jnp.ones(n)}

    racing, waiting = make(), make()
    expected = float(slow(racing.params())[0])
    value, grads = slow(racing.params())
    running = not value.is_ready()  # JAX 0.4.30 ran jit calls on the CPU synchronously
    racing.sharded.grads["w"][...] = 1.0
    racing.sharded.step()                                  # while slow() still reads w
    assert (float(value) != expected) == running           # (1) broken: it read new values
    assert running or not NEW_JAX
    value, grads = slow(waiting.params())
    waiting.step(grads)                                    # waits for slow() first
    assert float(value) == expected
    assert np.array_equal(racing.params()["w"], waiting.params()["w"])
