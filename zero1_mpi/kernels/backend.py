"""Array backends: NumPy on the host, CuPy on the GPU.

The only module that imports CuPy, and only when it is handed a CuPy array or asked for the
``cupy`` backend, so the package imports on machines with no GPU and no CuPy. Also the one
place that knows the supported dtypes (``float32``, ``float16`` and ``ml_dtypes.bfloat16``).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

__all__ = [
    "BFLOAT16",
    "PARAM_DTYPES",
    "HOST_ALIGN",
    "resolve_dtype",
    "is_device_array",
    "backend_name",
    "host_dtype",
    "xp_for",
    "xp_of",
    "use_device",
    "synchronize",
    "zeros",
    "pinned_empty",
    "copy_to_host",
    "copy_from_host",
    "to_numpy",
    "like",
    "missing_header_error",
    "ExplainedKernel",
    "elementwise_kernel",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
PARAM_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
}


def resolve_dtype(dtype, what: str = "param_dtype") -> np.dtype:
    """``dtype`` as one of the supported NumPy dtypes, or a ValueError naming the choices."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in PARAM_DTYPES.values():
        raise ValueError(f"{what}={dtype!r} is not supported: use one of {', '.join(PARAM_DTYPES)}")
    return resolved


def is_device_array(array) -> bool:
    return type(array).__module__.split(".")[0] in ("cupy", "cupyx")


def backend_name(array) -> str | None:
    """``"numpy"`` (NumPy arrays and scalars), ``"cupy"``, or None for anything else."""
    if isinstance(array, (np.ndarray, np.generic)):
        return "numpy"
    if is_device_array(array) and hasattr(array, "__cuda_array_interface__"):
        return "cupy"
    return None


def host_dtype(array) -> np.dtype:
    """The NumPy dtype of ``array``'s elements (a CuPy array's bfloat16 is ml_dtypes')."""
    return PARAM_DTYPES.get(array.dtype.name, np.dtype(array.dtype))


def xp_for(name: str):
    """The array module of backend ``name``."""
    if name == "numpy":
        return np
    if name == "cupy":
        return _cupy()
    raise ValueError(f"backend={name!r} is not known: use 'numpy' or 'cupy'")


def xp_of(array):
    """The array module of ``array`` (CuPy for a device array, else NumPy)."""
    return _cupy() if is_device_array(array) else np


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the cupy backend needs CuPy: pip install 'zero1-mpi[cuda12]' (or [cuda13])"
        ) from exc
    return cupy


def use_device(local_rank: int) -> int:
    """Make GPU ``local_rank % count`` the current CuPy device and return its index: ranks
    share a node's GPUs round-robin by node-local rank (``Communicator.node_rank()``). Several
    ranks per GPU work through MPI (staged or CUDA-aware); NCCL needs a GPU per rank."""
    cupy = _cupy()
    count = cupy.cuda.runtime.getDeviceCount()
    index = local_rank % count
    cupy.cuda.Device(index).use()
    return index


def synchronize(array) -> None:
    """Wait until the work queued on the current stream (which may write ``array``) is done."""
    if is_device_array(array):
        _cupy().cuda.get_current_stream().synchronize()


#: Byte alignment of the flat host buffers: XLA:CPU (JAX) aliases NumPy memory through DLPack
#: only at 64-byte boundaries (else it copies), and it suits SIMD loads.
HOST_ALIGN = 64


def zeros(xp, n: int, dtype):
    """``xp.zeros(n, dtype)``; for NumPy, starting on a ``HOST_ALIGN``-byte boundary (NumPy
    itself promises 16)."""
    if xp is not np:
        return xp.zeros(n, dtype)
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + HOST_ALIGN, np.uint8)
    skip = -raw.ctypes.data % HOST_ALIGN
    return raw[skip : skip + n * dtype.itemsize].view(dtype)


def pinned_empty(nbytes: int, device: bool) -> np.ndarray:
    """A flat uint8 host buffer, page-locked when it is to stage device memory."""
    if device:
        import cupyx

        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    return np.empty(nbytes, dtype=np.uint8)


def copy_to_host(array, host: np.ndarray) -> None:
    if is_device_array(array):
        array.reshape(-1).get(out=host)
    else:
        np.copyto(host, array.reshape(-1))


def copy_from_host(host: np.ndarray, array) -> None:
    if is_device_array(array):
        array.reshape(-1).set(host)
    else:
        np.copyto(array.reshape(-1), host)


def to_numpy(array) -> np.ndarray:
    return array.get() if is_device_array(array) else np.asarray(array)


def like(target, values):
    """``values`` (NumPy or CuPy) on ``target``'s backend, for ``target[...] = ...``."""
    if is_device_array(target):
        return values if is_device_array(values) else _cupy().asarray(values)
    return to_numpy(values)


_MISSING_HEADER = re.compile(r'could not open source file "([\w.]+)"')


def missing_header_error(error: BaseException) -> ImportError | None:
    """An ImportError naming the extra to install when ``error`` is NVRTC failing to find a
    CUDA header (``cuda_fp16.h``, ``cuda_bf16.h``: CuPy's 16-bit types need them); else None."""
    found = _MISSING_HEADER.search(str(error))
    if found is None:
        return None
    return ImportError(
        f"CuPy could not compile a zero1_mpi kernel: NVRTC found no {found.group(1)} (CUDA's "
        "headers, which CuPy's float16/bfloat16 types include). Install them with "
        "pip install 'zero1-mpi[cuda12]' (or [cuda13], matching your CuPy), which brings "
        "NVRTC and the CUDA runtime headers of one version, or point CUDA_PATH at a CUDA "
        "toolkit of CuPy's CUDA version"
    )


class ExplainedKernel:
    """A CuPy kernel whose compile failure for a missing CUDA header says what to install."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args, **kwargs):
        try:
            return self.kernel(*args, **kwargs)
        except Exception as exc:
            better = missing_header_error(exc)
            if better is None:
                raise
            raise better from exc


_ELEMENTWISE: dict[str, ExplainedKernel] = {}


def elementwise_kernel(name: str, in_params: str, out_params: str, operation: str):
    """CuPy's ``ElementwiseKernel`` ``name`` (an ``ExplainedKernel``), built at its first use
    and kept by name for the process."""
    if name not in _ELEMENTWISE:
        kernel = xp_for("cupy").ElementwiseKernel(in_params, out_params, operation, name)
        _ELEMENTWISE[name] = ExplainedKernel(kernel)
    return _ELEMENTWISE[name]
