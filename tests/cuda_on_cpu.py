"""CuPy's ``ElementwiseKernel`` run on the CPU: the very CUDA source a kernel is built from,
compiled with the host's C++ compiler as a loop over ``i``, on NumPy arrays. For tests of the
logic of GPU kernels on machines with no GPU (``CpuCupy`` stands in for ``cupy`` where
``backend.xp_for("cupy")`` is asked for one; the arrays stay NumPy's).

What it models: CuPy's parameters (``raw`` arrays indexed by the kernel, the others the element
``i`` of arrays of one length, scalars of their declared type, type placeholders from the
arrays' dtypes), float16/bfloat16 as their round-to-nearest-even conversions, and the CUDA
intrinsics the package's kernels use (``__uint_as_float``, ``__fmul_rn``, ``atomicOr``, ...).
Elements run one after another, so what it cannot show is a race between threads, and floating
point is compiled with ``-ffp-contract=off``: NVRTC contracts ``a * b + c`` into one rounding,
so a GPU's bits may differ from these in the last place (its own tests bound that).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

C_TYPES = {
    "float32": "float", "float64": "double", "float16": "z_half", "bfloat16": "z_bf16",
    "uint8": "unsigned char", "int8": "signed char", "uint16": "unsigned short",
    "int16": "short", "uint32": "unsigned int", "int32": "int", "uint64": "unsigned long long",
    "int64": "long long", "bool": "bool",
}
PRELUDE = r"""
#include <cmath>
#include <cstring>
#include <algorithm>
using namespace std;
struct z_bf16 {
    unsigned short bits;
    z_bf16(float f) {
        unsigned int u; memcpy(&u, &f, 4);
        unsigned int top = u >> 16;
        bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? (top | 0x40u) : (u + 0x7FFFu + (top & 1u)) >> 16;
    }
    operator float() const { unsigned int u = (unsigned int)bits << 16; float f; memcpy(&f, &u, 4); return f; }
};
struct z_half {
    _Float16 h;
    z_half(float f) : h((_Float16)f) {}
    operator float() const { return (float)h; }
};
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline unsigned int atomicOr(unsigned int* p, unsigned int v) { unsigned int o = *p; *p = o | v; return o; }
static inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
template <class T> struct z_raw { T* p; T& operator[](long long k) const { return p[k]; } };
"""
_PARAM = re.compile(r"^(raw\s+)?(\w+)\s+(\w+)$")
_DIR = Path(tempfile.gettempdir()) / "zero1_cuda_on_cpu"


def available() -> str | None:
    """None where kernels can run here, else why not."""
    return None if shutil.which("g++") else "no g++ on this machine"


def _params(text: str) -> list[tuple[bool, str, str]]:
    found = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            match = _PARAM.match(part)
            assert match, f"a CuPy parameter this model does not read: {part!r}"
            found.append((bool(match.group(1)), match.group(2), match.group(3)))
    return found


class ElementwiseKernel:
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name, preamble="")``."""

    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **kwargs):
        self.ins, self.outs = _params(in_params), _params(out_params)
        self.operation, self.name, self.preamble = operation, name, preamble
        self._built: dict[str, object] = {}

    def __call__(self, *args, size=None):
        params = self.ins + self.outs
        assert len(args) == len(params), f"{self.name}: {len(args)} arguments for {len(params)}"
        types, n = {}, None
        for (raw, type_, name), arg in zip(params, args):
            if isinstance(arg, np.ndarray):
                if type_ not in C_TYPES:  # a placeholder: the array's dtype
                    assert types.get(type_, arg.dtype.name) == arg.dtype.name, name
                    types[type_] = arg.dtype.name
                else:
                    assert arg.dtype.name == type_, f"{self.name}: {name} is {arg.dtype}"
                if not raw:
                    assert n in (None, arg.size), f"{self.name}: {name} has {arg.size} elements"
                    n = arg.size
        n = size if n is None else n
        assert n is not None, f"{self.name}: no array gives the size"
        lines, keep, pointers = [], [], []
        for k, ((raw, type_, name), arg) in enumerate(zip(params, args)):
            c = C_TYPES[types.get(type_, type_)]
            const = "const " if k < len(self.ins) else ""
            if isinstance(arg, np.ndarray):
                assert arg.ndim <= 1 and (arg.flags.c_contiguous or arg.size <= 1), name
                pointers.append(arg.ctypes.data)
                if raw:
                    lines.append(f"    z_raw<{c}> {name}{{({c}*)z_args[{k}]}};")
                else:
                    lines.append(f"    {c}* z_arr_{name} = ({c}*)z_args[{k}];")
            else:
                dtype = types.get(type_, type_)
                box = np.array([arg], dtype=np.dtype(dtype) if dtype in C_TYPES else None)
                keep.append(box)
                pointers.append(box.ctypes.data)
                lines.append(f"    const {c} {name} = *({c}*)z_args[{k}];")
        refs = [
            f"        {'const ' if k < len(self.ins) else ''}{C_TYPES[types.get(t, t)]}& {name}"
            f" = z_arr_{name}[i];"
            for k, ((raw, t, name), arg) in enumerate(zip(params, args))
            if isinstance(arg, np.ndarray) and not raw
        ]
        typedefs = "".join(f"typedef {C_TYPES[d]} {t};\n" for t, d in types.items())
        code = (PRELUDE + typedefs + self.preamble + '\nextern "C" void run(void** z_args, '
                "long long z_n) {\n" + "\n".join(lines) + "\n    for (long long i = 0; i < z_n;"
                " ++i) {\n" + "\n".join(refs) + "\n" + self.operation + "\n    }\n}\n")
        function = self._compiled(code)
        array = (ctypes.c_void_p * len(pointers))(*pointers)
        function(array, ctypes.c_longlong(n))

    def _compiled(self, code: str):
        if code not in self._built:
            digest = hashlib.sha256(code.encode()).hexdigest()[:24]
            _DIR.mkdir(exist_ok=True)
            library = _DIR / f"{self.name}_{digest}.so"
            if not library.exists():
                src = _DIR / f"{self.name}_{digest}.cpp"
                src.write_text(code)
                tmp = library.with_suffix(f".{id(self)}.tmp")
                result = subprocess.run(
                    ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off",
                     "-o", str(tmp), str(src)], capture_output=True, text=True)
                assert result.returncode == 0, f"{self.name} does not compile:\n{result.stderr}"
                tmp.replace(library)
            function = ctypes.CDLL(str(library)).run
            function.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_longlong)
            self._built[code] = function
        return self._built[code]


class CpuCupy:
    """What ``backend.xp_for("cupy")`` gives under this model: its ``ElementwiseKernel``."""

    ElementwiseKernel = ElementwiseKernel
