"""examples/jax_mlp.py: a jit-compiled JAX model trained by zero1_mpi (skipped where JAX is not
installed, failed instead where ``ZERO1_REQUIRE_JAX=1``, as in CI).

- On 2 ranks it trains as one process does (float32: the same losses step by step as on 1 rank,
  and the same final loss as examples/train_mlp.py, whose backward pass is NumPy written out by
  hand); in bfloat16 (the default) it learns, and ``--plot`` writes the loss curve.
- Every run reports, per rank, which transfers were zero-copy (pointers compared inside the
  example): the parameters exactly where 64-byte aligned, the gradient views always.
- What zero1_mpi/jax.py's docstring (``ZeroOptimizer``, which the example trains with) says of
  JAX holds for the installed JAX (in this process; device_put in tests/test_jax_adapter.py).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from mpirun import run_mpi

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/jax_mlp.py"
LAUNCH = "mpiexec -n 4 python -m mpi4py examples/jax_mlp.py"
NAMES = ["b1", "b2", "b3", "w1", "w2", "w3"]
STEPS = "60"

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    if os.environ.get("ZERO1_REQUIRE_JAX") == "1":
        raise ImportError("ZERO1_REQUIRE_JAX=1 but JAX does not import: "
                          "pip install '.[jax]'") from exc
    pytest.skip(f"JAX is not installed (pip install '.[jax]'): {exc}", allow_module_level=True)


def run(script: str, n: int, *args: str) -> str:
    return run_mpi(n, script, *args, timeout=180).stdout


def line(out: str, prefix: str) -> str:
    found = [x for x in out.splitlines() if x.startswith(prefix)]
    assert found, out
    return found[-1][len(prefix):]


def losses(out: str) -> list[float]:
    return json.loads(line(out, "losses: "))


def final(out: str) -> tuple[float, float]:
    found = re.fullmatch(r"first_loss=(\S+) last_loss=(\S+)", line(out, "final: "))
    assert found, out
    return float(found.group(1)), float(found.group(2))


def check_zero_copy(out: str, n: int) -> None:
    """The example's own record: gradients viewed without a copy on every rank; parameters
    without a copy exactly where 64-byte aligned, which is all of them or none on each rank
    (every tensor starts at a multiple of 32 elements), all when the flat buffer is aligned."""
    records = json.loads(line(out, "zero-copy: "))
    assert len(records) == n, out
    for record in records:
        assert record["grads_zero_copy"] == NAMES, out
        assert record["params_zero_copy"] == record["aligned"], out
        expected = NAMES if record["flat_buffer_address_mod_64"] == 0 else []
        assert record["aligned"] == expected, out


def test_docstring_opens_with_launch_command():
    doc = ast.get_docstring(ast.parse((ROOT / EXAMPLE).read_text(encoding="utf-8")))
    assert doc.splitlines()[0].strip() == LAUNCH


def test_float32_on_2_ranks_trains_as_one_process_and_as_the_numpy_example():
    """The global batch is the same at any world size: 2 ranks differ from 1 only in the order
    of the sums (the tolerance of the torch DDP comparison, tests/test_example_torch_autograd.py);
    the NumPy example computes the same model with a hand-written backward pass."""
    two = run(EXAMPLE, 2, "--steps", STEPS, "--dtype", "float32")
    one = run(EXAMPLE, 1, "--steps", STEPS, "--dtype", "float32")
    numpy_example = run("examples/train_mlp.py", 1, "--steps", STEPS, "--dtype", "float32")
    assert "jax_mlp: world_size=2 " in two and " dtype=float32 " in two, two
    curve = losses(two)
    assert len(curve) == int(STEPS)
    assert curve[0] == pytest.approx(math.log(10), abs=1e-6), two  # zero output layer
    assert final(two)[1] < 0.5 * curve[0], two
    assert curve == pytest.approx(losses(one), rel=1e-4, abs=1e-7)
    assert final(two)[1] == pytest.approx(final(numpy_example)[1], rel=1e-5), numpy_example
    check_zero_copy(two, 2)
    check_zero_copy(one, 1)


def test_bfloat16_by_default_learns_as_the_numpy_example_and_plots(tmp_path):
    png = tmp_path / "loss.png"
    out = run(EXAMPLE, 2, "--steps", STEPS, "--plot", str(png))
    numpy_example = run("examples/train_mlp.py", 2, "--steps", STEPS, "--dtype", "bfloat16")
    assert " dtype=bfloat16 " in out, out
    first, last = final(out)
    assert first == pytest.approx(math.log(10), abs=1e-6) and last < 0.5 * first, out
    # bfloat16 rounds a few gradients the other way now and then (sums in another order)
    assert last == pytest.approx(final(numpy_example)[1], rel=2e-3), numpy_example
    check_zero_copy(out, 2)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out and not png.exists(), out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out, out


def aligned(n: int, dtype, offset_bytes: int = 0) -> np.ndarray:
    """``n`` zeros starting ``offset_bytes`` past a multiple of 64 bytes."""
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset_bytes
    return raw[start:start + n * dtype.itemsize].view(dtype)


def test_what_the_docstring_says_of_jax_holds_here():
    """If one of these fails after a JAX upgrade, ``zero1_mpi.jax.ZeroOptimizer``'s docstring
    (and maybe its code) needs the new facts."""
    import ml_dtypes

    where = f"JAX {jax.__version__}"
    host = aligned(256, np.float32)
    assert jnp.from_dlpack(host).unsafe_buffer_pointer() == host.ctypes.data, where
    odd = aligned(256, np.float32, offset_bytes=16)  # NumPy's own promise: 16 bytes
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 5):
        assert jnp.from_dlpack(odd).unsafe_buffer_pointer() != odd.ctypes.data, where
    bf16 = aligned(256, ml_dtypes.bfloat16)
    with pytest.raises(BufferError):
        bf16.__dlpack__()  # NumPy's DLPack export has no bfloat16: hence jax.device_put
    bits = jnp.from_dlpack(bf16.view(np.uint16))
    assert bits.unsafe_buffer_pointer() == bf16.ctypes.data, where

    grad = jnp.arange(256, dtype=jnp.bfloat16) * 2
    view = np.asarray(grad)  # JAX -> NumPy: a read-only view
    assert view.ctypes.data == grad.unsafe_buffer_pointer() and not view.flags.writeable, where

    # Donation reuses a buffer JAX owns for the output, never one on NumPy's memory: the
    # gradients cannot be computed straight into opt.grads.
    accumulate = jax.jit(lambda g, w: g + jax.grad(lambda w: (w * w).sum())(w),
                         donate_argnums=0)
    weights = jnp.ones(256)
    owned = jnp.zeros(256)
    pointer = owned.unsafe_buffer_pointer()
    assert accumulate(owned, weights).unsafe_buffer_pointer() == pointer, where
    grads = aligned(256, np.float32)
    on_numpy = jnp.from_dlpack(grads)
    assert on_numpy.unsafe_buffer_pointer() == grads.ctypes.data, where
    assert accumulate(on_numpy, weights).unsafe_buffer_pointer() != grads.ctypes.data, where
    assert not grads.any(), where

    # A view captured by a jit-compiled function is a constant; one passed as an argument is
    # read at each call.
    host[...] = 1.0
    captured = jnp.from_dlpack(host)
    closure = jax.jit(lambda x: (x * captured).sum())
    argument = jax.jit(lambda x, p: (x * p).sum())
    ones = jnp.ones(256)
    assert float(closure(ones)) == float(argument(ones, captured)) == 256.0
    host[...] = 2.0
    assert float(closure(ones)) == 256.0 and float(argument(ones, captured)) == 512.0, where
