"""The CuPy twins' one pass per range: a rule's fp32 math on one element (CUDA statements,
``GeneratedCudaKernel.element``) composed with how the gradient, the masters and each state array
are stored (``numba_forms``' forms, which the Numba pass reads too) into one ``ElementwiseKernel``
per combination: each element read in its stored form, updated in fp32 registers and written
back so; no fp32 scratch. Remainder masters: an old tie (``-TIE``, its position in the range's
ties) is found by a binary search where the remainder is ``-TIE``; a new one sets its bit in a
mask (``TieFlags``), read back after. The 8-bit state: a thread per block, two passes over it
(the new values' largest magnitude and sign, then the same math again, written encoded with the
new scale), so that nothing is kept between them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..state.int8_blocks import BOUNDS, CODES, STATE_BLOCK
from . import backend
from .numba_forms import (
    BF16_FORM,
    FP32_FORM,
    INT8_FORM,
    NONE_FORM,
    REMAINDER_FORM,
    master_form,
    state_form,
)

__all__ = ["GeneratedCudaKernel", "TieFlags", "source"]

#: The stochastic rounding's multiplier of an element's place and its hash (``encodings``).
_ROUND = (
    "unsigned int z_x = seed{k} + (unsigned int)({at}) * 0x9E3779B1u;"
    " z_x ^= z_x >> 16; z_x *= 0x7FEB352Du; z_x ^= z_x >> 15; z_x *= 0x846CA68Bu;"
    " z_x ^= z_x >> 16; unsigned int z_u = __float_as_uint({name}),"
    " z_a = z_u & 0x7FFFFFFFu, z_top = z_u >> 16;"
    " {ref} = (unsigned short)(z_a > 0x7F800000u ? (z_top | 0x40u)"
    " : z_a == 0x7F800000u ? z_top : (z_u + (z_x & 0xFFFFu)) >> 16);"
)
#: A remainder master: decoded (a tie, ``-TIE`` listed in ``ties``, moved half a step up) ...
_DECODE_REMAINDER = """\
unsigned int z_bits = ((unsigned int){param} << 16) + (unsigned int)(int){rem};
if ({rem} == (short)-32768) {{  // a tie? (binary search over the range's few ties)
    long long z_lo = 0, z_hi = n_ties;
    while (z_lo < z_hi) {{
        long long z_mid = (z_lo + z_hi) / 2;
        if (ties[z_mid] < {at}) z_lo = z_mid + 1; else z_hi = z_mid;
    }}
    if (z_lo < n_ties && ties[z_lo] == {at}) z_bits += 0x10000u;
}}
float p = __uint_as_float(z_bits);"""
#: ... and encoded: the parameter rounded to nearest even (NaN: quiet), the remainder below it,
#: a new tie flagged.
_ENCODE_REMAINDER = """\
{{
    unsigned int z_u = __float_as_uint(p), z_top = z_u >> 16;
    unsigned int z_q = (z_u & 0x7FFFFFFFu) > 0x7F800000u ? (z_top | 0x40u)
                                                        : (z_u + 0x7FFFu + (z_top & 1u)) >> 16;
    {param} = (unsigned short)z_q;
    int z_r = (int)(z_u - (z_q << 16));
    {rem} = (short)z_r;
    if (z_r == 0x8000) {{
        atomicOr(&tie_mask[({at}) >> 5], 1u << (({at}) & 31));
        atomicAdd(&tie_count[0], 1);
    }}
}}"""
#: An 8-bit code's value: the map of the block's (old) scale, times its magnitude.
_DECODE_INT8 = (
    "__fmul_rn(signbit(old{k}) ? signed_map[st{k}[z_j]] : unsigned_map[st{k}[z_j]], fabsf(old{k}))"
)
#: A value's code: how many bounds of its block's map lie below it over the new scale.
_ENCODE_INT8 = """\
{{
    int z_code = 0;
    if (!bad{k} && top{k} != 0u) {{
        float z_v = __fdiv_rn({name}, amax{k});
        int z_hi = 255;
        while (z_code < z_hi) {{
            int z_mid = (z_code + z_hi) / 2;
            if ((up{k} ? unsigned_bounds[z_mid] : signed_bounds[z_mid]) < z_v)
                z_code = z_mid + 1;
            else
                z_hi = z_mid;
        }}
    }}
    st{k}[z_j] = (unsigned char)z_code;
}}"""
_INT8_PASSES = """\
const long long z_first = i * {block}, z_last = min(n, z_first + {block});
{old}
{tops}
for (long long z_j = z_first; z_j < z_last; ++z_j) {{  // the new values' largest magnitude
{loads}
{element}
{measure}
}}
{scales}
for (long long z_j = z_first; z_j < z_last; ++z_j) {{  // the same values, written
{loads}
{element}
{stores}
}}
{keep_scales}"""


def _name(base: str, master: str, state_kinds) -> str:
    """``base`` with ``{master}`` filled (``fp32``: fp32 parameters, ``mixed``: fp32 masters,
    ``remainder``), and ``_bf16state``/``_int8state`` where the state is kept so."""
    kinds = {k for k in state_kinds if k not in (FP32_FORM, NONE_FORM)}
    suffix = {BF16_FORM: "_bf16state", INT8_FORM: "_int8state"}
    return base.format(master=master) + "".join(suffix[k] for k in sorted(kinds))


def source(
    base: str, element: str, scalar_params: str, state_names, master: str, state_kinds
) -> tuple[str, str, str, str]:
    """``(name, in_params, out_params, operation)`` of the ``ElementwiseKernel`` that runs
    ``element`` (CUDA statements on ``float`` locals: ``g_in``, the gradient; ``p``, the master;
    one per ``state_names``; and the rule's ``scalar_params``) over one range with masters
    ``master`` (``"fp32"``: fp32 parameters are the masters, ``"mixed"``: fp32 masters and a
    16-bit ``P param``, ``"remainder"``: bf16 parameters' int16 remainders) and each state array
    kept as its ``state_kinds`` (``numba_forms``' kinds)."""
    k = range(len(state_kinds))
    int8 = INT8_FORM in state_kinds
    raw = "raw " if int8 else ""
    at = "z_j" if int8 else "i"

    def ref(name: str) -> str:  # an array's element ``at``
        return f"{name}[z_j]" if int8 else name

    ins = [f"{raw}G grad", scalar_params] + (["int64 n"] if int8 else [])
    outs = []
    if master == "remainder":
        ins += ["int64 n_ties", "raw int64 ties"]
        outs += [f"{raw}uint16 param", f"{raw}int16 rem", "raw uint32 tie_mask",
                 "raw int32 tie_count"]  # fmt: skip
        load_master = _DECODE_REMAINDER.format(param=ref("param"), rem=ref("rem"), at=at)
        store_master = _ENCODE_REMAINDER.format(param=ref("param"), rem=ref("rem"), at=at)
    else:
        outs.append(f"{raw}float32 master")
        load_master = f"float p = {ref('master')};"
        store_master = f"{ref('master')} = p;"
        if master == "mixed":
            outs.append(f"{raw}P param")
            store_master += f" {ref('param')} = (P)p;  // rounded to 16 bits"
    loads, stores = [f"float g_in = (float){ref('grad')};", load_master], []
    for i, (name, kind) in zip(k, zip(state_names, state_kinds)):
        if kind == NONE_FORM:
            continue
        if kind == FP32_FORM:
            outs.append(f"{raw}float32 st{i}")
            loads.append(f"float {name} = {ref(f'st{i}')};")
            stores.append(f"{ref(f'st{i}')} = {name};")
        elif kind == BF16_FORM:
            ins.append(f"uint32 seed{i}")
            outs.append(f"{raw}uint16 st{i}")
            loads.append(f"float {name} = __uint_as_float((unsigned int){ref(f'st{i}')} << 16);")
            stores.append("{ " + _ROUND.format(k=i, at=at, name=name, ref=ref(f"st{i}")) + " }")
        else:
            outs += [f"raw uint8 st{i}", f"float32 sc{i}"]
            loads.append(f"float {name} = {_DECODE_INT8.format(k=i)};")
            stores.append(_ENCODE_INT8.format(k=i, name=name))
    stores.append(store_master)
    if int8:
        ins += ["raw float32 unsigned_map", "raw float32 signed_map",
                "raw float32 unsigned_bounds", "raw float32 signed_bounds"]  # fmt: skip
    body_loads = "\n".join(loads)
    if not int8:
        operation = "\n".join([body_loads, element, *stores])
    else:
        quantized = [i for i in k if state_kinds[i] == INT8_FORM]
        names = list(state_names)
        operation = _INT8_PASSES.format(
            block=STATE_BLOCK,
            old="\n".join(f"const float old{i} = sc{i};" for i in quantized),
            tops="\n".join(f"unsigned int top{i} = 0u, neg{i} = 0u;" for i in quantized),
            loads=body_loads,
            element=element,
            measure="\n".join(
                f"{{ unsigned int z_u = __float_as_uint({names[i]}), z_m = z_u & 0x7FFFFFFFu;"
                f" top{i} = z_m > top{i} ? z_m : top{i}; neg{i} |= z_u > 0x80000000u; }}"
                for i in quantized
            ),
            scales="\n".join(
                f"const bool bad{i} = top{i} >= 0x7F800000u, up{i} = neg{i} == 0u;"
                f" const float amax{i} = __uint_as_float(top{i});"
                for i in quantized
            ),
            stores="\n".join(stores),
            keep_scales="\n".join(
                f"sc{i} = bad{i} ? __int_as_float(0x7fc00000) : (up{i} ? amax{i} : -amax{i});"
                for i in quantized
            ),
        )
    name = _name(base, master, state_kinds)
    return name, ", ".join(ins), ", ".join(outs), operation


class TieFlags:
    """The new ties of one range, on the device: a bit per element (``mask``, all clear between
    calls) and how many are set (``count``); ``taken()`` reads them back and clears them."""

    def __init__(self, xp, largest: int):
        self.mask = xp.zeros((largest + 31) // 32, np.uint32)
        self.count = xp.zeros(1, np.int32)

    @property
    def nbytes(self) -> int:
        return self.mask.nbytes + self.count.nbytes

    def taken(self) -> np.ndarray:
        """The sorted positions flagged (from the range's start), the flags cleared after."""
        if int(backend.to_numpy(self.count)[0]) == 0:  # (one small read: usually none)
            return np.zeros(0, np.int64)
        xp = backend.xp_of(self.mask)
        words = xp.flatnonzero(self.mask)
        bits = backend.to_numpy(self.mask[words]).astype(np.uint64)
        at = backend.to_numpy(words).astype(np.int64) * 32
        found = np.concatenate([at[(bits >> np.uint64(b)) & np.uint64(1) == 1] + b
                                for b in range(32)])  # fmt: skip
        self.mask[words] = 0
        self.count[...] = 0
        return np.sort(found)


_TABLES: dict[int, tuple] = {}
_NO_TIES: dict[int, Any] = {}  # an empty array of ties on each array module's device


def _tables(xp) -> tuple:
    """The 8-bit state's maps and bounds (unsigned, signed) on ``xp``'s device, once."""
    key = id(xp)
    if key not in _TABLES:
        _TABLES[key] = tuple(
            xp.asarray(t) for t in (CODES[False], CODES[True], BOUNDS[False], BOUNDS[True])
        )
    return _TABLES[key]


def _ties_on(xp, ties):
    """The host positions ``ties`` on ``xp``'s device; none (usually) an empty array kept."""
    if xp is np or backend.is_device_array(ties):
        return ties
    if ties.size:
        return xp.asarray(ties)
    if id(xp) not in _NO_TIES:
        _NO_TIES[id(xp)] = xp.zeros(0, np.int64)
    return _NO_TIES[id(xp)]


class GeneratedCudaKernel:
    """Base of a rule's CuPy twin: ``base`` (the kernels' name, ``{master}`` in it),
    ``element`` (CUDA statements, ``source``), ``scalar_params`` (their declarations) and
    ``scalars`` (the host scalars as that tuple of values) are the rule's; ``state_names``
    the locals ``element`` uses. The kernel of each combination of stored forms is generated
    (``source``) and built once. No scratch: each element is decoded, updated and encoded in
    registers."""

    scratch_bytes = 0
    base = ""
    element = ""
    scalar_params = ""
    state_names: tuple[str, ...] = ()

    def scalars(self, s) -> tuple:
        raise NotImplementedError

    def __call__(self, grad, master, *rest) -> None:
        """The rule's kernel protocol on fp32 arrays: ``(grad, master, *states, param, s)``."""
        *states, param, s = rest
        self.launch(grad, master_form(fp32=master), tuple(state_form(fp32=x) for x in states),
                    param, s)  # fmt: skip

    def fused(self, grad, master: tuple, states: tuple, param, s) -> np.ndarray:
        """The update over one range of the stored forms (``numba_forms``: ``master``, whose
        ``flagged`` is a ``TieFlags`` for remainders, and one form per state array) as they
        are; returns the masters' new ties (sorted positions from the range's start)."""
        self.launch(grad, master, states, param, s)
        if master[0] != REMAINDER_FORM:
            return np.zeros(0, np.int64)
        return master[4].taken()

    def launch(self, grad, master: tuple, states: tuple, param, s) -> None:
        """Queue the kernel of ``fused`` (nothing read back)."""
        kind, fp32, rem, ties, flagged = master
        if kind == REMAINDER_FORM:
            masters = "remainder"
        else:
            masters = "fp32" if param is None else "mixed"
        state_kinds = tuple(form[0] for form in states)
        kernel = self._kernel(masters, state_kinds)
        xp = backend.xp_of(grad)
        int8 = INT8_FORM in state_kinds
        args: list[Any] = [grad, *self.scalars(s)]
        if int8:
            args.append(np.int64(grad.size))
        if kind == REMAINDER_FORM:
            args += [np.int64(ties.size), _ties_on(xp, ties)]
        for form in states:
            if form[0] == BF16_FORM:
                args.append(np.uint32(form[2]))
        if int8:
            args += list(_tables(xp))
        if kind == REMAINDER_FORM:
            args += [param.view(np.uint16), rem, flagged.mask, flagged.count]
        else:
            args.append(fp32)
            if param is not None:
                args.append(param)
        for form in states:
            if form[0] in (FP32_FORM, BF16_FORM):
                args.append(form[1])
            elif form[0] == INT8_FORM:
                args += [form[1], form[3][: -(-grad.size // STATE_BLOCK)]]
        kernel(*args)

    def _kernel(self, masters: str, state_kinds: tuple):
        """The kernel of one combination, its source generated at its first use."""
        kernels = self.__dict__.setdefault("_kernels", {})
        if (masters, state_kinds) not in kernels:
            generated = source(self.base, self.element, self.scalar_params, self.state_names,
                               masters, state_kinds)  # fmt: skip
            kernels[masters, state_kinds] = backend.elementwise_kernel(*generated)
        return kernels[masters, state_kinds]
