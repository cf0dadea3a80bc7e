#!/usr/bin/env python3
"""Compile every CuPy kernel of zero1_mpi with NVRTC, on a machine with no GPU and no driver.

Usage: ``python tools/gpu_compile_check.py [--arch 80,90] [--only TEXT] [--dump DIR]``. Prints
one line per kernel source (``ok`` or ``FAIL``, the kernel's name and type parameters, where the
package builds it), each compiled to PTX for every ``--arch``, and ends with ``N kernels
compiled, M failed``. Exits 0 when none failed; 1 when one did (NVRTC's log follows its line);
2 when it cannot run here: CuPy >= 14, NVRTC or CUDA headers of NVRTC's version missing
(``pip install "cupy-cuda12x>=14" "cuda-toolkit[cudart,nvrtc]==12.*"``; no driver needed).

Where the sources come from: nothing here holds a kernel's text. The tool drives the package's
own CuPy code (``kernel("cupy")`` of every variant of every rule in ``zero1_mpi.rules.registry``
with fp32 and 16-bit parameters and each gradient dtype the engine hands it, and the engine's
reductions) on ``cupy.ndarray`` objects
over memory that does not exist (CuPy makes them without a device), with
``backend.xp_for("cupy")`` swapped for a recorder: each ``ElementwiseKernel`` /
``ReductionKernel`` the package builds is a real CuPy kernel object, and each launch is
written down instead of run. For each launch, CuPy's own code generation
(``_kernel._get_elementwise_kernel``, ``_reduction._ReductionKernel_get_cached_function``,
``_cub_reduction._SimpleCubReductionKernel_get_cached_function``, unmemoized) writes the
kernel and CuPy's ``compile_with_cache`` adds its headers and options; the step after
(``cupy.cuda.compiler._compile_module_with_cache``, which needs a device to choose the
architecture and to load the result) is intercepted, and the very source and options it gets
are compiled with NVRTC, adding what that step adds (``-ftz=true``, the architecture,
``--device-as-default-execution-space``).

What is modelled, not run (CuPy ``CUPY_MODELLED``'s ``_kernel.pyx``, ``_reduction.pyx``,
``_cub_reduction.pyx``; another CuPy version fails with what to check and update): how CuPy
describes a launch's arguments (``_ArgInfo``: the 1-d arrays the engine passes, scalars of the
declared parameter types, the indexers) and which kernels a full reduction compiles: the generic
one (short arrays, or ``CUPY_ACCELERATORS`` without cub) and, where CuPy's ``_can_use_cub_block_reduction`` says so, CUB's two passes, at the block size
of long arrays (512 threads; 32 to 256 below 2048 elements differ in one ``#define``). A launch
outside the model (n-d arrays, outputs left out, axis, unknown keywords) is a failure, never a
pass. ``--against DIR`` checks the model on a GPU machine: DIR is the ``CUPY_CACHE_DIR`` of a
run with ``CUPY_CACHE_SAVE_CUDA_SOURCE=1``; each ``zero1_`` kernel source CuPy compiled there
must be one this tool produces.

Completeness: each ``ElementwiseKernel`` / ``ReductionKernel`` written in the package (found
with ``ast``) must have been built and launched by ``drive()``, and ``RawKernel``,
``RawModule``, ``fuse`` and ``rawkernel`` fail until this tool learns them, so a new kernel
cannot go unchecked. ``--break NAME`` plants a compile error in kernel NAME's body (the test
that a typo fails uses it).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from zero1_mpi.kernels import backend  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
#: The CuPy (major, minor) whose private code generation ``Generator`` models; CI pins it.
CUPY_MODELLED = (14, 2)
#: Elements per stand-in array: above CuPy's CUB threshold, CUB's largest block (512 threads).
N = 4096
#: The block sizes CuPy gives a CUB reduction (by length); only 512 is compiled (--against
#: compares with all: they differ in one ``#define``).
CUB_BLOCKS = (32, 64, 128, 256, 512)
#: Kernel factories the tool knows how to compile, and the ones it must refuse.
KNOWN = ("ElementwiseKernel", "ReductionKernel")
UNKNOWN = ("RawKernel", "RawModule", "fuse", "rawkernel")
#: What ``cupy.cuda.compiler._compile_with_cache_cuda`` and ``_compile_using_nvrtc_no_warning``
#: add to the options they receive, before the architecture (CuPy 14).
NVRTC_TAIL_BEFORE_ARCH = ("-ftz=true",)
NVRTC_TAIL_AFTER_ARCH = ("--device-as-default-execution-space",)
PLANTED = "zero1_planted_compile_error"  # an undeclared name


class CannotRun(Exception):
    """CuPy, NVRTC or the CUDA headers are missing: the check cannot run on this machine."""


class ModelError(Exception):
    """A launch this tool cannot describe as CuPy would: extend the tool, do not skip it."""


# -- the environment ----------------------------------------------------------------------------

def load_cupy():
    """``cupy``, after checking that NVRTC and the fp16/bf16 headers are there."""
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot run here
        raise CannotRun(f"CuPy does not import ({exc}): pip install 'cupy-cuda12x>=14' "
                        "'cuda-toolkit[cudart,nvrtc]==12.*'") from None
    if int(cupy.__version__.split(".")[0]) < 14:
        raise CannotRun(f"CuPy {cupy.__version__} has no bfloat16 kernels: CuPy >= 14 needed")
    version = tuple(int(part) for part in cupy.__version__.split(".")[:2])
    if version != CUPY_MODELLED:
        raise ModelError(
            f"CuPy {cupy.__version__}: this tool models the private code generation of CuPy "
            f"{'.'.join(map(str, CUPY_MODELLED))} (_kernel._get_elementwise_kernel, "
            "_reduction._ReductionKernel_get_cached_function, _cub_reduction, _TypeMap, "
            "_ArgInfo, compiler._compile_module_with_cache). Compare those in CuPy "
            f"{cupy.__version__}'s cupy/_core/_kernel.pyx, _reduction.pyx and "
            "_cub_reduction.pyx with Generator, update it, set CUPY_MODELLED, and pin that "
            "version in .ci/run (or install cupy-cuda12x=="
            f"{'.'.join(map(str, CUPY_MODELLED))}.* to run this check)")
    try:
        major, minor = nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001
        raise CannotRun(f"NVRTC does not load ({exc}): pip install nvidia-cuda-nvrtc-cu12") \
            from None
    try:
        options = cupy._core.core.assemble_cupy_compiler_options(())
    except Exception as exc:  # noqa: BLE001
        raise CannotRun(f"CuPy finds no CUDA headers ({exc}): pip install "
                        "nvidia-cuda-runtime-cu12") from None
    dirs = [Path(o[2:]) for o in options if o.startswith("-I")]
    found = [d for d in dirs if (d / "cuda_fp16.h").is_file() and (d / "cuda_bf16.h").is_file()]
    if not found:
        raise CannotRun(f"cuda_fp16.h and cuda_bf16.h are on none of CuPy's include paths "
                        f"({', '.join(map(str, dirs))}): pip install nvidia-cuda-runtime-cu{major}")
    # Headers of another CUDA than NVRTC's (a system toolkit found first) break CUB's kernels.
    api = found[0] / "cuda_runtime_api.h"
    version = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", api.read_text(errors="replace")) \
        if api.is_file() else None
    if version and int(version.group(1)) // 1000 != major:
        cuda = int(version.group(1))
        raise CannotRun(f"CuPy's CUDA headers ({found[0]}) are CUDA {cuda // 1000}."
                        f"{cuda % 1000 // 10}, NVRTC is {major}.{minor}: pip install "
                        f"nvidia-cuda-runtime-cu{major} (its headers come first)")
    return cupy


def fake_array(cupy, shape, dtype):
    """A ``cupy.ndarray`` over memory that does not exist (never read: nothing is launched)."""
    dtype = np.dtype(dtype)
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    memory = cupy.cuda.memory.UnownedMemory(1 << 40, nbytes, None, device_id=0)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.memory.MemoryPointer(memory, 0))


# -- recording what the package builds and launches ---------------------------------------------

@dataclass
class Built:
    kernel: object        # the real CuPy kernel object
    site: tuple           # (file relative to the repository, line) where the package builds it
    launches: list = field(default_factory=list)  # (args, kwargs) of each launch


class Recorder:
    """Stands in for a kernel: writes a launch down; a reduction returns a stand-in 0-d array."""

    def __init__(self, cupy, built: Built):
        self._cupy, self._built = cupy, built

    def __call__(self, *args, **kwargs):
        self._built.launches.append((args, kwargs))
        kernel = self._built.kernel
        if isinstance(kernel, self._cupy.ReductionKernel):
            return fake_array(self._cupy, (), kernel.out_params[0].dtype)
        return None


class CupyRecorder:
    """What ``backend.xp_for("cupy")`` returns during the drive: CuPy, with kernels recorded."""

    def __init__(self, cupy, broken: str | None):
        self.cupy, self._broken, self.built = cupy, broken, []

    def _make(self, factory, args, kwargs):
        frame = sys._getframe(2)
        site = (_relative(frame.f_code.co_filename), frame.f_lineno)
        if self._broken:  # plant a compile error into the kernel named by --break
            args, kwargs = _plant(factory, args, kwargs, self._broken)
        built = Built(getattr(self.cupy, factory)(*args, **kwargs), site)
        self.built.append(built)
        return Recorder(self.cupy, built)

    def ElementwiseKernel(self, *args, **kwargs):  # noqa: N802 - CuPy's name
        return self._make("ElementwiseKernel", args, kwargs)

    def ReductionKernel(self, *args, **kwargs):  # noqa: N802 - CuPy's name
        return self._make("ReductionKernel", args, kwargs)

    def stack(self, arrays):
        return fake_array(self.cupy, (len(arrays),) + tuple(arrays[0].shape), np.float64)

    def __getattr__(self, name):
        if name in UNKNOWN:
            raise ModelError(f"the package builds a cupy.{name}: teach tools/gpu_compile_check.py")
        return getattr(self.cupy, name)


def _plant(factory, args, kwargs, name):
    """``args`` with a compile error in the body (operation / map expression) of kernel ``name``."""
    signature = inspect.signature({
        "ElementwiseKernel": lambda in_params, out_params, operation, name="kernel", **kw: None,
        "ReductionKernel": lambda in_params, out_params, map_expr, reduce_expr, post_map_expr,
        identity, name="reduce_kernel", **kw: None}[factory])
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments["name"] != name:
        return args, kwargs
    if factory == "ElementwiseKernel":
        bound.arguments["operation"] += f"\n{PLANTED};\n"
    else:
        bound.arguments["map_expr"] = f"({bound.arguments['map_expr']}) + {PLANTED}"
    values = dict(bound.arguments)
    extra = values.pop("kw", {})
    return (), {**values, **extra}


def _relative(filename) -> str:
    try:
        return Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return filename


def drive(recorder):
    """Run every CuPy code path of the package that launches a kernel, on stand-in arrays;
    yields ``(case, error or None)``.

    Each variant of each registered rule, with its optimizer's default options, with fp32
    parameters (fp32 gradients) and with 16-bit ones (gradients in the parameter dtype, as
    summed over ranks in it or on one rank, or fp32 after a 16-bit exchange summed in fp32);
    and for an elementwise rule its one pass over the other stored forms (``stored_forms``);
    then the engine's reductions on every gradient dtype (LAMB's sums of squares of the fp32
    masters come with it), the 8-bit wire codec on every dtype (with error feedback), and the
    remainder masters' decode and encode, the bf16 state's widening and rounding, and the 8-bit
    state's decoding, scales and quantizing.
    """
    from zero1_mpi.state.masters import _cuda_kernel
    from zero1_mpi.state.encodings import _cuda_kernel as bf16_kernel
    from zero1_mpi.state.int8_blocks import _cuda_kernel8 as int8_kernel
    from zero1_mpi.kernels.local_sums import reductions_for
    from zero1_mpi.rules.registry import builtin_rules
    from zero1_mpi.wire.codec import codec_for, packed_bytes

    cupy = recorder.cupy
    fp32 = np.dtype(np.float32)
    for entry in builtin_rules().values():
        for rule, param_dtype in ((r, d) for r in entry.variants
                                  for d in backend.PARAM_DTYPES.values()):
            mixed = param_dtype != fp32
            for grad_dtype in dict.fromkeys((param_dtype, fp32)):
                case = (f"{entry.optimizer.__name__} ({rule.settings()}), param "
                        f"{param_dtype.name}, grad {grad_dtype.name}")
                try:
                    options = rule.check_options(**entry.defaults)
                    scalars = rule.scalars(1, options, 1.0)
                    kernel = rule.kernel("cupy", N)
                    grad = fake_array(cupy, (N,), grad_dtype)
                    master = fake_array(cupy, (N,), fp32)
                    states = [fake_array(cupy, (N,), fp32) for _ in rule.state_names]
                    param = fake_array(cupy, (N,), param_dtype) if mixed else None
                    if rule.tensor_sums:
                        kernel.tensor_sums(grad, master, *states, scalars)
                        tensor = rule.tensor_scalars(scalars, np.ones(rule.tensor_sums))
                        kernel.apply(master, *states, param, tensor)
                    else:
                        kernel(grad, master, *states, param, scalars)
                except Exception as exc:  # noqa: BLE001 - reported as a failure
                    yield case, exc
                else:
                    yield case, None
                if rule.tensor_sums or not hasattr(kernel, "launch"):
                    continue  # (a rule whose CuPy twin is not a GeneratedCudaKernel)
                # The one pass over each other way of storing the masters and the state.
                for masters, state in stored_forms(param_dtype):
                    try:
                        master_form, state_forms = forms(cupy, rule, masters, state)
                        kernel.launch(grad, master_form, state_forms, param, scalars)
                    except Exception as exc:  # noqa: BLE001
                        yield f"{case}, masters {masters}, state {state}", exc
                    else:
                        yield f"{case}, masters {masters}, state {state}", None
    for dtype in backend.PARAM_DTYPES.values():
        case = f"the engine's reductions, {dtype.name}"
        try:
            reductions_for("cupy", N).sum_of_squares(fake_array(cupy, (N,), dtype))
        except Exception as exc:  # noqa: BLE001
            yield case, exc
        else:
            yield case, None
    for dtype in backend.PARAM_DTYPES.values():
        case = f"the 8-bit wire codec, {dtype.name}"
        try:
            codec, row = codec_for("cupy"), packed_bytes(N)
            values, packed = fake_array(cupy, (N,), dtype), fake_array(cupy, (row,), np.uint8)
            codec.encode(values, packed)
            codec.encode(values, packed, fake_array(cupy, (N,), dtype))  # error feedback
            codec.decode_sum(fake_array(cupy, (3, row), np.uint8), N, fake_array(cupy, (N,), fp32))
            codec.decode_add(packed, fake_array(cupy, (N,), dtype))
        except Exception as exc:  # noqa: BLE001
            yield case, exc
        else:
            yield case, None
    case = "the remainder masters (decode, encode)"
    try:
        _cuda_kernel("decode")(fake_array(cupy, (N,), np.uint16), fake_array(cupy, (N,), np.int16),
                               fake_array(cupy, (N,), np.int32))
        _cuda_kernel("encode")(fake_array(cupy, (N,), np.int32), fake_array(cupy, (N,), np.uint16),
                               fake_array(cupy, (N,), np.int16),
                               fake_array(cupy, (N // 32,), np.uint32),
                               fake_array(cupy, (1,), np.int32))
    except Exception as exc:  # noqa: BLE001
        yield case, exc
    else:
        yield case, None
    case = "the 8-bit state (decode, scales, quantize)"
    try:
        codes, scales = fake_array(cupy, (N,), np.uint8), fake_array(cupy, (N // 256,), fp32)
        table, bounds = fake_array(cupy, (256,), fp32), fake_array(cupy, (255,), fp32)
        values = fake_array(cupy, (N,), fp32)
        int8_kernel("decode")(codes, scales, table, table, 256, values)
        int8_kernel("scales")(values, N, 256, scales)
        int8_kernel("quantize")(values, scales, bounds, bounds, 256, codes)
    except Exception as exc:  # noqa: BLE001
        yield case, exc
    else:
        yield case, None
    case = "the bf16 state (widen, stochastic rounding)"
    try:
        bf16_kernel("widen")(fake_array(cupy, (N,), np.uint16), fake_array(cupy, (N,), np.uint32))
        bf16_kernel("round")(fake_array(cupy, (N,), np.uint32), np.uint32(7),
                             fake_array(cupy, (N,), np.uint16))
    except Exception as exc:  # noqa: BLE001
        yield case, exc
    else:
        yield case, None


def stored_forms(param_dtype):
    """``(masters, state dtype)``: the stored forms of an elementwise rule's one pass
    (``kernels/cuda_generated.py``) beside fp32 masters and state, which the plain launch
    compiles: bf16 and 8-bit state with any masters, and bf16's remainder masters with each
    state."""
    found = [("fp32", "bfloat16"), ("fp32", "int8")]
    if param_dtype == backend.BFLOAT16:
        found += [("remainder", state) for state in ("float32", "bfloat16", "int8")]
    return found


def forms(cupy, rule, masters, state):
    """Stand-in stored forms (``numba_forms``) of the masters and of each of ``rule``'s state
    arrays, on arrays of ``N`` elements."""
    from types import SimpleNamespace

    from zero1_mpi.kernels import cuda_generated
    from zero1_mpi.kernels.numba_forms import master_form, state_form

    fp32 = np.float32
    # The 8-bit maps and bounds the pass reads, as they would be on the device.
    cuda_generated._TABLES[id(backend._cupy())] = (
        fake_array(cupy, (256,), fp32), fake_array(cupy, (256,), fp32),
        fake_array(cupy, (255,), fp32), fake_array(cupy, (255,), fp32))
    if masters == "remainder":
        flags = SimpleNamespace(mask=fake_array(cupy, (N // 32,), np.uint32),
                                count=fake_array(cupy, (1,), np.int32))
        master = master_form(remainder=fake_array(cupy, (N,), np.int16),
                             ties=fake_array(cupy, (0,), np.int64), flagged=flags)
    else:
        master = master_form(fp32=fake_array(cupy, (N,), fp32))
    if state == "float32":
        made = [state_form(fp32=fake_array(cupy, (N,), fp32)) for _ in rule.state_names]
    elif state == "bfloat16":
        made = [state_form(bits=fake_array(cupy, (N,), np.uint16), seed=7)
                for _ in rule.state_names]
    else:
        made = [state_form(codes=fake_array(cupy, (N,), np.uint8),
                           scales=fake_array(cupy, (N // 256,), fp32))
                for _ in rule.state_names]
    return master, tuple(made)


def kernel_sites(package: Path) -> tuple[list, list]:
    """``(known, unknown)``: ``(file, first line, last line, factory)`` of each kernel
    construction (or other use of a kernel factory) written in the package's source."""
    known, unknown = [], []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if name in KNOWN or name in UNKNOWN:
                span = calls.get(id(node), node)  # a call: all its lines
                site = (_relative(path), span.lineno, span.end_lineno, name)
                (known if name in KNOWN else unknown).append(site)
    return known, unknown


# -- CuPy's code generation, as a launch would run it ------------------------------------------

@dataclass
class Source:
    label: str            # kernel name and its type parameters
    name: str             # the __global__ function's name
    site: str
    source: str           # what CuPy hands to NVRTC
    options: tuple


class _Captured(Exception):
    def __init__(self, source, options, kwargs):
        super().__init__("captured")
        self.source, self.options, self.kwargs = source, tuple(options), kwargs


def _capture(source, options=(), **kwargs):
    raise _Captured(source, options, kwargs)


class Generator:
    """Turns recorded launches into the sources CuPy would compile for them."""

    def __init__(self, cupy):
        from cupy._core import _carray, _cub_reduction, _kernel, _reduction, _scalar
        self.cupy, self.k, self.r, self.cub = cupy, _kernel, _reduction, _cub_reduction
        self.scalar_type, self.indexer_type = _scalar.CScalar, _carray.Indexer

    # _ArgInfo(kind, type, dtype, ndim, c_contiguous, index_32_bits); kinds from _kernel.pxd
    def array(self, a):
        if a.ndim > 1:
            raise ModelError(f"a {a.ndim}-d argument: the engine passes 1-d ranges")
        return self.k._ArgInfo(1, self.cupy.ndarray, a.dtype, a.ndim, a._c_contiguous,
                               a._index_32_bits)

    def scalar(self, dtype):
        return self.k._ArgInfo(3, self.scalar_type, np.dtype(dtype), 0, True, True)

    def indexer(self, ndim, size):
        return self.k._ArgInfo(2, self.indexer_type, None, ndim, True, size <= 1 << 31)

    def pointer(self):
        return self.k._ArgInfo(4, self.cupy.cuda.memory.MemoryPointer, None, 0, True, True)

    def compiled(self, make):
        """The source and options ``make`` (one of CuPy's kernel getters) sends to NVRTC."""
        compiler = self.cupy.cuda.compiler
        real = compiler._compile_module_with_cache
        compiler._compile_module_with_cache = _capture
        try:
            make()
        except _Captured as captured:
            unexpected = {k: v for k, v in captured.kwargs.items() if k in (
                "backend", "jitify", "name_expressions", "enable_cooperative_groups")
                and v not in ("nvrtc", False, None)}
            if unexpected:
                raise ModelError(f"CuPy compiles this kernel with {unexpected}") from None
            return captured.source, captured.options
        finally:
            compiler._compile_module_with_cache = real
        raise ModelError("CuPy compiled nothing for this launch")

    def sources(self, built: Built, args, kwargs, cub_blocks=(512,)) -> list[Source]:
        """What CuPy compiles for one launch (CUB kernels: for these block sizes; a launch
        compiles the one its length gives, 512 threads from 2048 elements up)."""
        kernel = built.kernel
        site = f"{built.site[0]}:{built.site[1]}"
        if isinstance(kernel, self.cupy.ReductionKernel):
            return self.reduction(kernel, site, args, kwargs, cub_blocks)
        if isinstance(kernel, self.cupy.ElementwiseKernel):
            return self.elementwise(kernel, site, args, kwargs)
        raise ModelError(f"{type(kernel).__name__} at {site}: not a kernel kind this tool knows")

    @staticmethod
    def _label(name, type_map):
        pairs = ", ".join(f"{c}={np.dtype(t).name}" for c, t in type_map._pairs
                          if c not in ("IndexT", "sizeT", "type_in0_raw", "type_out0_raw"))
        return f"{name}({pairs})" if pairs else name

    def _shape(self, arrays, site):
        shapes = {tuple(a.shape) for a in arrays}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ModelError(f"{site}: arguments of shapes {sorted(shapes)}; the model knows "
                             "1-d ranges of one length")
        return next(iter(shapes))[0]

    def elementwise(self, kernel, site, args, kwargs) -> list[Source]:
        if set(kwargs) - {"stream", "block_size"} or len(args) != kernel.nargs:
            raise ModelError(f"{kernel.name} at {site}: launched with {len(args)} arguments "
                             f"(outputs included) and {sorted(kwargs)}; the model wants all "
                             f"{kernel.nargs} given")
        nd = self.cupy.ndarray
        ins, outs = args[:kernel.nin], args[kernel.nin:]
        in_types, _, type_map = kernel._decide_params_type(
            tuple(a.dtype if isinstance(a, nd) else None for a in ins),
            tuple(a.dtype for a in outs))
        # ``raw`` arrays (indexed by the kernel itself) take no part in the launch's size
        raw = [isinstance(a, nd) and p.raw for a, p in zip(args, kernel.params)]
        n = self._shape([a for a, r in zip(args, raw) if isinstance(a, nd) and not r],
                        kernel.name)
        if any(r and a.ndim != 1 for a, r in zip(args, raw)):
            raise ModelError(f"{kernel.name}: a raw argument of more than one dimension; the "
                             "model knows 1-d ones")
        infos = [self.array(a) if isinstance(a, nd) else self.scalar(t)
                 for a, t in zip(ins, in_types)]
        infos += [self.array(a) for a in outs] + [self.indexer(1, n)]
        getter = self.k._get_elementwise_kernel.__wrapped__
        source, options = self.compiled(lambda: getter(
            tuple(infos), type_map, kernel.params, kernel.operation, kernel.name,
            kernel.preamble, **kernel.kwargs))
        return [Source(self._label(kernel.name, type_map), kernel.name, site, source, options)]

    def reduction(self, kernel, site, args, kwargs, cub_blocks) -> list[Source]:
        if kwargs or len(args) != kernel.nin:
            raise ModelError(f"{kernel.name} at {site}: the model knows full reductions with "
                             "no out, axis or keepdims")
        nd, k = self.cupy.ndarray, self.k
        ins = list(args)
        in_types, out_types, type_map = k._decide_params_type(
            kernel.in_params, kernel.out_params,
            tuple(a.dtype.type if isinstance(a, nd) else None for a in ins), ())
        n = self._shape([a for a in ins if isinstance(a, nd)], kernel.name)
        out = fake_array(self.cupy, (), out_types[0])
        label = self._label(kernel.name, type_map)
        type_map = k._TypeMap(type_map._pairs + (
            ("IndexT", "int32" if n <= 0x7fffffff else "int64"),))
        infos = [self.array(a) if isinstance(a, nd) else self.scalar(t)
                 for a, t in zip(ins, in_types)]
        # The generic kernel: _AbstractReductionKernel._call / _launch.
        block_size, _, _ = self.r._get_block_specs(n, 1, 1, -1)
        generic = infos + [self.array(out), self.indexer(1, n), self.indexer(0, 1),
                           self.scalar(np.int32)]
        getter = self.r._ReductionKernel_get_cached_function.__wrapped__
        source, options = self.compiled(lambda: getter(
            kernel.nin, kernel.nout, kernel._params, tuple(generic), type_map, kernel.name,
            block_size, kernel.reduce_type, kernel.identity, kernel.map_expr,
            kernel.reduce_expr, kernel.post_map_expr, kernel.preamble, kernel.options))
        found = [Source(label, kernel.name, site, source, options)]
        # CUB's kernels where CuPy would use them with CUPY_ACCELERATORS=cub (its default).
        if self.cub._can_use_cub_block_reduction(ins, [out], (0,), ()):
            for block_size in cub_blocks:
                found += self.cub_passes(kernel, site, label, ins[0], out, type_map, n,
                                         block_size)
        return found

    def cub_passes(self, kernel, site, label, in0, out, type_map, n, block_size):
        """The two CUB kernels of a full reduction: ``_try_to_call_cub_reduction``,
        ``_launch_cub`` and ``_cub_two_pass_launch`` of CuPy 14's ``_cub_reduction.pyx``."""
        k = self.k
        if n > 0x7fffffff or any(w in kernel.name for w in ("mean", "argmax", "argmin")):
            raise ModelError(f"{kernel.name}: a CUB reduction outside the model")
        type_map = k._TypeMap(type_map._pairs + (("sizeT", "int32"),))
        params = (kernel._params[0:2] + k._get_param_info("int32 _segment_size", True)
                  + k._get_param_info("int32 _array_size", True))
        map_expr, post_map_expr = kernel.map_expr, kernel.post_map_expr
        old_in0, old_out0 = params[0].name, params[1].name
        if old_in0 != "in0" or old_out0 != "out0":
            params = (k._get_param_info("T in0", True) + k._get_param_info("T out0", False)
                      + params[2:])
            map_expr = map_expr.replace(old_in0, "in0")
            post_map_expr = post_map_expr.replace(old_out0, "out0")
            type_map = k._TypeMap(type_map._pairs + (
                ("type_in0_raw", in0.dtype.type), ("type_out0_raw", out.dtype.type)))
        items_per_thread = 4  # _get_cub_block_specs: 4 items, min(512, clp2(n / 4)) threads
        getter = self.cub._SimpleCubReductionKernel_get_cached_function.__wrapped__
        count = self.scalar(np.int32)
        found = []
        for suffix, pre_map, infos, option in (
                ("_pass1", map_expr, (self.array(in0), self.pointer(), count, count),
                 "-DFIRST_PASS=1"),
                ("_pass2", "in0", (self.pointer(), self.array(out), count, count),
                 "-DSECOND_PASS=1")):
            name = kernel.name + suffix
            source, options = self.compiled(lambda: getter(
                pre_map, kernel.reduce_expr, post_map_expr, kernel.reduce_type, params,
                infos, type_map, name, block_size, kernel.identity, kernel.preamble,
                (option,), items_per_thread))
            found.append(Source(f"{label} [CUB {suffix[1:]}, {block_size} threads]", name,
                                site, source, options))
        return found


# -- NVRTC ---------------------------------------------------------------------------------------

def nvrtc_compile(source: Source, arch: str) -> str | None:
    """None, or NVRTC's log of why ``source`` does not compile for ``compute_<arch>``."""
    from cupy_backends.cuda.libs import nvrtc
    options = source.options + NVRTC_TAIL_BEFORE_ARCH + (f"-arch=compute_{arch}",) \
        + NVRTC_TAIL_AFTER_ARCH
    program = nvrtc.createProgram(source.source, source.name + ".cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            return (nvrtc.getProgramLog(program) or str(exc)).strip() or str(exc)
        if not nvrtc.getPTX(program):
            return "NVRTC returned no PTX"
        return None
    finally:
        nvrtc.destroyProgram(program)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90",
                        help="compute capabilities, comma separated (default: 80,90)")
    parser.add_argument("--only", metavar="TEXT",
                        help="compile only the kernels whose label contains TEXT")
    parser.add_argument("--dump", type=Path, metavar="DIR",
                        help="write each kernel's source (as NVRTC gets it) into DIR")
    parser.add_argument("--break", dest="broken", metavar="NAME",
                        help="plant a compile error in kernel NAME (shows that failures fail)")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="on a GPU machine: CUPY_CACHE_DIR of a run with "
                        "CUPY_CACHE_SAVE_CUDA_SOURCE=1; fails for each zero1_ kernel source "
                        "there that this tool does not produce")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    started = time.perf_counter()
    try:
        cupy = load_cupy()
    except CannotRun as exc:
        print(f"gpu_compile_check: cannot run: {exc}", flush=True)
        return EXIT_CANNOT_RUN
    except ModelError as exc:
        print(f"FAIL {exc}", flush=True)
        return EXIT_FAILED

    problems = []  # failures that are not one kernel's compile error
    recorder = CupyRecorder(cupy, args.broken)
    real_cupy = backend._cupy
    backend._cupy = lambda: recorder
    try:
        for case, error in drive(recorder):
            if error is not None:
                problems.append(f"{case}: {type(error).__name__}: {error}")
    finally:
        backend._cupy = real_cupy

    known, unknown = kernel_sites(ROOT / "zero1_mpi")
    for file, line, _, name in unknown:
        problems.append(f"{file}:{line}: cupy.{name} is not compiled by this tool: teach it")
    for file, first, last, name in known:
        hits = [b for b in recorder.built if b.site[0] == file and first <= b.site[1] <= last]
        if not hits:
            problems.append(f"{file}:{first}: this {name} is never built by drive() in "
                            "tools/gpu_compile_check.py: add the code path that builds it")
        elif not any(b.launches for b in hits):
            problems.append(f"{file}:{first}: this {name} is built but never launched")
    if args.broken and not any(b.kernel.name == args.broken for b in recorder.built):
        problems.append(f"--break {args.broken}: the package builds no kernel of that name")

    generator = Generator(cupy)
    sources, every, seen = [], set(), set()
    for built in recorder.built:
        for launch_args, launch_kwargs in built.launches:
            try:
                found = generator.sources(built, launch_args, launch_kwargs)
                if args.against:  # CUB kernels of every length, to compare
                    every.update(s.source for s in generator.sources(
                        built, launch_args, launch_kwargs, CUB_BLOCKS))
            except Exception as exc:  # noqa: BLE001 - a launch CuPy would refuse, or the model
                problems.append(f"{built.kernel.name} ({built.site[0]}:{built.site[1]}): "
                                f"{type(exc).__name__}: {exc}")
                continue
            for source in found:
                key = (source.name, source.source, source.options)
                if key not in seen and (not args.only or args.only in source.label):
                    seen.add(key)
                    sources.append(source)

    sources.sort(key=lambda s: s.site)  # stable: by file and line, launch order within
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    ok = failed = 0
    for index, source in enumerate(sources):
        if args.dump:
            (args.dump / f"{index:03d}_{source.name}.cu").write_text(source.source)
        errors = {arch: nvrtc_compile(source, arch) for arch in archs}
        bad = {arch: log for arch, log in errors.items() if log}
        print(f"{'FAIL' if bad else 'ok  '} {source.label}  compute_{','.join(archs)}  "
              f"{source.site}", flush=True)
        for log in dict.fromkeys(bad.values()):  # each distinct log once
            where = ",".join(arch for arch, other in bad.items() if other == log)
            print(f"     compute_{where}: " + log.replace("\n", "\n     "), flush=True)
        failed += bool(bad)
        ok += not bad

    if args.against:
        for path in sorted(args.against.rglob("*.cu")):
            text = path.read_text(errors="replace")
            names = re.findall(r"__global__\s+void\s+(zero1_\w+)", text)
            if names and text not in every:
                problems.append(f"{path}: CuPy compiled {names[0]} from a source this tool "
                                "does not produce (the model in Generator is off)")
    for problem in problems:
        print(f"FAIL {problem}", flush=True)
    print(f"({time.perf_counter() - started:.1f} s; CuPy {cupy.__version__}, "
          f"NVRTC {'.'.join(map(str, _nvrtc_version()))})")
    print(f"{ok} kernels compiled, {failed + len(problems)} failed")
    return EXIT_FAILED if failed or problems else EXIT_OK


def _nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc.getVersion()


if __name__ == "__main__":
    sys.exit(main())
