"""0.1.0's module paths, importable for one more minor version (until 0.2.0).

``MOVED`` maps each module path of 0.1.0's API reference that the package's layout replaced to
the modules that hold its names now, in the order they are searched. ``import zero1_mpi`` calls
``install()``, which puts a finder on ``sys.meta_path``: importing an old path gives a module
holding the names of its new homes, with a ``DeprecationWarning`` naming them. The old paths that
are packages now (``zero1_mpi.state``, ``zero1_mpi.step``, ...) import as they are; their 0.1.0
names resolve through ``old_names(package)``, the package's ``__getattr__``, with the same
warning. Nothing else is kept here: a path not in ``MOVED`` is not an old one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings

__all__ = ["MOVED", "REMOVED_IN", "install", "old_names", "warn_deprecated"]

#: The version that drops these paths.
REMOVED_IN = "0.2.0"

#: 0.1.0's module path -> the modules that hold its names now (searched in this order).
MOVED: dict[str, tuple[str, ...]] = {
    "zero1_mpi.backend": ("zero1_mpi.kernels.backend",),
    "zero1_mpi.binding": ("zero1_mpi.bindings.common",),
    "zero1_mpi.buckets": ("zero1_mpi.gradients.stage1",),
    "zero1_mpi.checkpoint": (
        "zero1_mpi.persistence.checkpoint",
        "zero1_mpi.persistence.manifest",
        "zero1_mpi.persistence.publish",
        "zero1_mpi.persistence.consolidated",
    ),
    "zero1_mpi.configure": ("zero1_mpi.config.configure",),
    "zero1_mpi.exchange": ("zero1_mpi.wire.gradient_exchange",),
    "zero1_mpi.export": ("zero1_mpi.persistence.consolidated",),
    "zero1_mpi.gathers": ("zero1_mpi.wire.param_gathers",),
    "zero1_mpi.grad_shards": ("zero1_mpi.gradients.stage2",),
    "zero1_mpi.jax_params": ("zero1_mpi.bindings.jax_params",),
    "zero1_mpi.kernels_numba": ("zero1_mpi.kernels.numba_shared",),
    "zero1_mpi.ledger": ("zero1_mpi.memory.ledger",),
    "zero1_mpi.masters": ("zero1_mpi.state.masters",),
    "zero1_mpi.memory_tool": ("zero1_mpi.cli.memory",),
    "zero1_mpi.nccl": ("zero1_mpi.comm.nccl",),
    "zero1_mpi.offload": ("zero1_mpi.state.host", "zero1_mpi.state.placement"),
    "zero1_mpi.options": ("zero1_mpi.config.options", "zero1_mpi.config.generated"),
    "zero1_mpi.params": ("zero1_mpi.flat.inputs",),
    "zero1_mpi.preemption": ("zero1_mpi.persistence.preemption",),
    "zero1_mpi.reductions": ("zero1_mpi.kernels.local_sums",),
    "zero1_mpi.rule": ("zero1_mpi.rules.protocol",),
    "zero1_mpi.schedules": ("zero1_mpi.bindings.schedules",),
    "zero1_mpi.spellings": ("zero1_mpi.bindings.optax_names",),
    "zero1_mpi.state_dtypes": ("zero1_mpi.state.encodings", "zero1_mpi.state.int8_blocks"),
    "zero1_mpi.topology": ("zero1_mpi.comm.topology",),
    "zero1_mpi.torch_compat": ("zero1_mpi.bindings.torch_compat",),
    "zero1_mpi.views": ("zero1_mpi.flat.views",),
    "zero1_mpi.watchdog": ("zero1_mpi.comm.watchdog",),
    # 0.1.0's modules that are packages of the same name now: their old names
    "zero1_mpi.comm": ("zero1_mpi.comm.communicator", "zero1_mpi.comm.capabilities"),
    "zero1_mpi.gradients": ("zero1_mpi.gradients.source",),
    "zero1_mpi.persistence": ("zero1_mpi.persistence.on_disk",),
    "zero1_mpi.state": ("zero1_mpi.state.sharded",),
    "zero1_mpi.step": ("zero1_mpi.step.pipeline", "zero1_mpi.step.records"),
    "zero1_mpi.wire": ("zero1_mpi.wire.codec", "zero1_mpi.wire.sizes"),
}


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside zero1_mpi (the user's
    line, which Python's default filters show when it is ``__main__``'s; import machinery
    frames are passed over, as ``warnings`` passes over them)."""
    frame: types.FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and (_internal(frame) or _ours(frame)):
        frame = frame.f_back
        if frame is not None and not _internal(frame):
            level += 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _ours(frame) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def _internal(frame) -> bool:  # as warnings' own test of an import machinery frame
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn(what: str, homes: str) -> None:
    warn_deprecated(f"{what} is 0.1.0's path, kept until {REMOVED_IN}: import it from {homes}")


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds 0.1.0's module paths and loads each as a module of its new homes' names."""

    def find_spec(self, fullname, path=None, target=None):
        # (asked last, after the path finders: the old paths that are packages now, which
        # they find, never reach it)
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"0.1.0's {spec.name}: now {MOVED[spec.name]}")
        for home in map(importlib.import_module, MOVED[spec.name]):
            for name, value in vars(home).items():
                if not name.startswith("__"):
                    module.__dict__.setdefault(name, value)
        _warn(spec.name, ", ".join(MOVED[spec.name]))
        return module

    def exec_module(self, module):
        pass


def old_names(package: str):
    """The ``__getattr__`` of ``package`` (an old module path that is a package now): a name
    0.1.0's module held, from its new home, with a ``DeprecationWarning``."""

    def __getattr__(name: str):
        if not name.startswith("_"):
            for home in MOVED[package]:
                value = getattr(importlib.import_module(home), name, None)
                if value is not None and not isinstance(value, types.ModuleType):
                    _warn(f"{package}.{name}", home)
                    return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    """Put the finder of 0.1.0's paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _OldPath) for finder in sys.meta_path):
        sys.meta_path.append(_OldPath())
