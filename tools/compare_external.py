"""python tools/compare_external.py [--require]

Runs ``ZeroLion`` and ``ZeroLAMB`` beside the other libraries' Lion and LAMB and prints how far
apart their parameters end up: one process (``MPI.COMM_SELF``), fp32, 20 steps on three tensors
(one of them all zeros, so its trust ratio is 1), with weight decay 0 and non-zero, the same
initial values and gradients for both sides. One line per comparison: bitwise equal or not, the
largest relative error (per tensor ``max|ours - theirs| / max|theirs|``, the largest over the
tensors), and the verdict: "equal" when bitwise equal or within 1e-6 relative, else "differs".
Then the packages' versions.

The other libraries (none is a dependency of this project; CI installs none of them):

    lion-pytorch       lion_pytorch.Lion
    optax (with jax)   optax.lion, optax.lamb; float64 under jax_enable_x64, and float32
    timm               timm.optim.lamb.Lamb, its defaults and the paper's algorithm
    pytorch_optimizer  pytorch_optimizer.Lamb

A comparison whose package is not importable is reported as skipped and the tool still exits 0;
with ``--require`` a missing package is an error (exit status 2). The docs' figures
(docs/update-rules.md) come from this tool; tests/test_compare_external.py asserts its verdicts
where the packages are installed. timm, lion-pytorch and pytorch_optimizer install with
``pip install --no-deps`` (timm otherwise pulls torchvision, and pip may replace torch with it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from zero1_mpi import ZeroLAMB, ZeroLion

SHAPES = {"w": (37, 29), "b": (29,), "z": (13,)}  # "z" starts all zeros
STEPS = 20
TOLERANCE = 1e-6  # relative; "equal" = bitwise equal or within it
LION = {"lr": 1e-3, "betas": (0.9, 0.99)}
LAMB = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6}
LION_DECAYS = (0.0, 0.1)
LAMB_DECAYS = (0.0, 0.01)
# Distribution names, for the versions line and the "not installed" messages.
PACKAGES = ("lion-pytorch", "optax", "timm", "pytorch_optimizer")
ALSO = ("torch", "jax", "numpy")

Params = dict[str, np.ndarray]


def initial() -> Params:
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    params["z"][:] = 0  # a zero tensor: trust ratio 1
    return params


def gradients(step: int) -> Params:
    rng = np.random.default_rng(100 + step)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@functools.lru_cache(maxsize=None)  # each of ours runs once, for all its comparisons
def ours(cls, **options) -> Params:
    opt = cls(initial(), MPI.COMM_SELF, **options)
    for step in range(1, STEPS + 1):
        for k, g in gradients(step).items():
            opt.grads[k][...] = g
        opt.step()
    return {k: np.array(opt.params[k]) for k in SHAPES}


def torch_run(make: Callable, dtype_name: str = "float32") -> Params:
    """``make(list_of_parameters)`` is a torch optimizer; the same steps as ``ours``."""
    import torch
    dtype = getattr(torch, dtype_name)
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for k, v in initial().items()}
    opt = make(list(params.values()))
    for step in range(1, STEPS + 1):
        for k, g in gradients(step).items():
            params[k].grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return {k: p.detach().numpy() for k, p in params.items()}


def optax_run(make: Callable, x64: bool) -> Params:
    """``make()`` is an optax transformation, its ``update`` jitted (as it is usually run; the
    same figures as eager), in float64 under ``jax_enable_x64`` when ``x64``, else in float32 as
    optax runs by default (its scalars, such as LAMB's bias corrections, then in float32 too)."""
    import jax
    import jax.numpy as jnp
    import optax
    enable_x64 = getattr(jax, "enable_x64", None)  # a context manager in newer jax
    if enable_x64 is None:  # older jax (0.4.30)
        from jax.experimental import enable_x64
    with enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        tx = make()
        params = {k: jnp.asarray(v, dtype) for k, v in initial().items()}
        state = tx.init(params)
        update = jax.jit(tx.update)
        for step in range(1, STEPS + 1):
            g = {k: jnp.asarray(v, dtype) for k, v in gradients(step).items()}
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
        return {k: np.asarray(v) for k, v in params.items()}


def load_timm_lamb():
    """timm's ``lamb`` module, without importing the ``timm`` package.

    ``import timm.optim.lamb`` runs ``timm/__init__.py`` first, which imports ``timm.layers``,
    and that needs torchvision: not a dependency here, and ``pip install timm`` would bring it
    with a torch of its own in place of the installed one. ``timm/optim/lamb.py`` itself needs
    only torch and two sibling files (``_helpers.py``, ``_types.py``) that it imports
    relatively. So: find the installed timm without running it (``find_spec`` of a top-level
    package does not execute it), make an empty package ``_timm_optim`` whose search path is
    timm's ``optim`` directory (its ``__init__.py``, which imports every optimizer, is not run),
    and load ``lamb.py`` from that directory as its submodule.
    """
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'timm'")
    optim_dir = Path(list(spec.submodule_search_locations)[0]) / "optim"
    package = "_timm_optim"
    if package not in sys.modules:
        package_spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        package_spec.submodule_search_locations = [str(optim_dir)]
        sys.modules[package] = importlib.util.module_from_spec(package_spec)
    lamb_spec = importlib.util.spec_from_file_location(f"{package}.lamb", optim_dir / "lamb.py")
    if lamb_spec is None:
        raise ImportError(f"no {optim_dir / 'lamb.py'}")
    module = importlib.util.module_from_spec(lamb_spec)
    sys.modules[lamb_spec.name] = module
    try:
        lamb_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[lamb_spec.name]
        raise
    return module


def import_optax():
    import jax  # noqa: F401
    import optax
    return optax


@dataclass
class Comparison:
    name: str  # "ZeroLion vs lion_pytorch.Lion fp32"
    weight_decay: float
    ours: Callable[[], Params]
    theirs: Callable[[], Params]


def comparisons(modules: dict) -> list[Comparison]:
    """Every comparison whose package imported (``modules``: distribution name -> module).
    Each closure takes what it uses as default arguments: no loop variable is bound late."""
    lion_pytorch, optax = modules.get("lion-pytorch"), modules.get("optax")
    timm_lamb, pytorch_optimizer = modules.get("timm"), modules.get("pytorch_optimizer")
    paper = {"always_adapt": True, "max_grad_norm": None}  # timm Lamb as in the paper
    out = []
    for wd in LION_DECAYS:
        def zero_lion(wd=wd):
            return ours(ZeroLion, weight_decay=wd, **LION)
        if lion_pytorch:
            out.append(Comparison(
                "ZeroLion vs lion_pytorch.Lion fp32", wd, zero_lion,
                lambda wd=wd: torch_run(lambda p: lion_pytorch.Lion(p, weight_decay=wd, **LION))))
        if optax:
            out.append(Comparison(
                "ZeroLion vs optax.lion f64 (x64)", wd, zero_lion,
                lambda wd=wd: optax_run(lambda: optax.lion(
                    LION["lr"], *LION["betas"], weight_decay=wd), x64=True)))
    for wd in LAMB_DECAYS:
        def zero_lamb(wd=wd):
            return ours(ZeroLAMB, weight_decay=wd, **LAMB)
        if optax:
            for x64, label in ((True, "f64 (x64)"), (False, "f32")):
                out.append(Comparison(
                    f"ZeroLAMB vs optax.lamb {label}", wd, zero_lamb,
                    lambda wd=wd, x64=x64: optax_run(lambda: optax.lamb(
                        LAMB["lr"], *LAMB["betas"], LAMB["eps"], weight_decay=wd), x64=x64)))
        if timm_lamb:
            for dtype, label in (("float32", "fp32"), ("float64", "f64")):
                out.append(Comparison(
                    f"ZeroLAMB vs timm Lamb(always_adapt=True, max_grad_norm=None) {label}",
                    wd, zero_lamb,
                    lambda wd=wd, dtype=dtype: torch_run(
                        lambda p: timm_lamb.Lamb(p, weight_decay=wd, **paper, **LAMB), dtype)))
            out.append(Comparison(
                "ZeroLAMB vs timm Lamb defaults fp32", wd, zero_lamb,
                lambda wd=wd: torch_run(lambda p: timm_lamb.Lamb(p, weight_decay=wd, **LAMB))))
        if pytorch_optimizer:
            out.append(Comparison(
                "ZeroLAMB vs pytorch_optimizer.Lamb defaults fp32", wd, zero_lamb,
                lambda wd=wd: torch_run(
                    lambda p: pytorch_optimizer.Lamb(p, weight_decay=wd, **LAMB))))
    return out


def bitwise_equal(a: Params, b: Params) -> bool:
    return all(a[k].dtype == b[k].dtype == np.float32 and
               np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in SHAPES)


def max_relative_error(a: Params, b: Params) -> float:
    def rel(x, y):
        x, y = x.astype(np.float64), y.astype(np.float64)
        return float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30))
    return max(rel(a[k], b[k]) for k in SHAPES)


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--require", action="store_true",
                        help="a package that is not importable is an error (exit status 2)")
    args = parser.parse_args(argv)

    importers = {"lion-pytorch": lambda: __import__("lion_pytorch"), "optax": import_optax,
                 "timm": load_timm_lamb,
                 "pytorch_optimizer": lambda: __import__("pytorch_optimizer")}
    modules, missing = {}, {}
    for distribution in PACKAGES:
        try:
            modules[distribution] = importers[distribution]()
        except ImportError as e:
            missing[distribution] = str(e)
    if args.require and missing:
        for distribution, why in missing.items():
            print(f"compare_external.py: {distribution} is not importable ({why})",
                  file=sys.stderr)
        return 2

    print(f"1 process (MPI.COMM_SELF), fp32 parameters, {STEPS} steps, tensors "
          f"{', '.join(str(s) for s in SHAPES.values())} (the last all zeros); "
          f"equal = bitwise, or max relative error <= {TOLERANCE:g}")
    for comparison in comparisons(modules):
        a, b = comparison.ours(), comparison.theirs()
        bitwise = bitwise_equal(a, b)
        err = max_relative_error(a, b)
        verdict = "equal" if bitwise or err <= TOLERANCE else "differs"
        print(f"{comparison.name:66s} wd={comparison.weight_decay:<5g} "
              f"bitwise={'yes' if bitwise else 'no ':3s} max_rel_err={err:.2e}  {verdict}")
    for distribution, why in missing.items():
        print(f"skipped: {distribution} comparisons ({distribution} is not importable: {why})")
    print("versions: " + ", ".join(f"{d} {version(d)}" for d in PACKAGES + ALSO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
