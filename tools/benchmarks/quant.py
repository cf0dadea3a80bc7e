"""The 8-bit wire format's block size: error, bytes and speed of each candidate, one process.

For each block size (values per fp32 scale): the quantization's relative error on
gradient-like values (heavy-tailed, Student's t with 3 degrees of freedom, in runs of 64K values
whose scales span four decades, as a model's tensors do), the bytes on the wire against 16-bit
values, and the time to encode and to decode one row (``decode_sum``) per million values for the
NumPy and Numba twins. The engine's ``wire.BLOCK`` is marked. Example:
python tools/bench.py quant [--values 4M] [--blocks 64,128,256,512,1024] [--json F]
"""

from __future__ import annotations

import time

import numpy as np

from . import common

RANKS, TIMEOUT = False, None


def options(parser) -> None:
    common.params(parser, "4M", what="values")
    parser.add_argument("--blocks", type=common.comma_list(common.at_least(8)),
                        default=[32, 64, 128, 256, 512, 1024, 4096],
                        help="block sizes to compare (default 32,...,4096)")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeat", type=common.at_least(1), default=5,
                        help="timed calls per twin; the median is shown (default 5)")


def gradient_like(n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    runs = -(-n // 65536)
    scales = np.repeat(10.0 ** rng.uniform(-4, 0, runs), 65536)[:n]
    return (rng.standard_t(3, n) * scales).astype(dtype)


def worker(args) -> dict:
    from zero1_mpi.wire import codec as wire
    from zero1_mpi.kernels.backend import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    x = gradient_like(args.params, dtype)
    exact = x.astype(np.float64)
    rows = []
    for block in args.blocks:
        found = {"block": block, "wire_vs_16bit": wire.packed_bytes(x.size, block) / (2 * x.size)}
        for kind in ("numpy", "numba"):
            codec = wire.codec_for(kind, x.size, block)
            packed = np.zeros(wire.packed_bytes(x.size, block), np.uint8)
            out = np.empty(x.size, np.float32)
            codec.encode(x, packed)  # compiles (Numba), warms the caches
            codec.decode_sum(packed[None], x.size, out)
            found[f"{kind}_encode_ms_per_M"] = median_ms(lambda: codec.encode(x, packed),
                                                         args.repeat) / (x.size / 1e6)
            found[f"{kind}_decode_ms_per_M"] = median_ms(
                lambda: codec.decode_sum(packed[None], x.size, out), args.repeat) / (x.size / 1e6)
        error = out.astype(np.float64) - exact
        found["relative_error"] = float(np.linalg.norm(error) / np.linalg.norm(exact))
        found["max_error_vs_block_max"] = float(max_over_blocks(error, exact, block))
        rows.append(found)
    return {"values": x.size, "dtype": args.dtype, "engine_block": wire.BLOCK, "rows": rows}


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def max_over_blocks(error, exact, block) -> float:
    """The largest error of a block over that block's largest magnitude."""
    n = exact.size // block * block
    amax = np.abs(exact[:n]).reshape(-1, block).max(axis=1)
    worst = np.abs(error[:n]).reshape(-1, block).max(axis=1)
    return float(np.max(worst / np.where(amax > 0, amax, 1)))


def report(args, results: list[dict]) -> dict:
    found = results[0]
    print(f"{found['values']:,} gradient-like {found['dtype']} values; ms per million values "
          f"(median of {args.repeat}); * the engine's block\n")
    print(common.row("block", "rel. error", "bytes vs 16-bit", "numpy enc", "numpy dec",
                     "numba enc", "numba dec"))
    print(common.rule("rrrrrrr"))
    for r in found["rows"]:
        mark = "*" if r["block"] == found["engine_block"] else ""
        print(common.row(f"{r['block']}{mark}", f"{r['relative_error']:.4f}",
                         f"{r['wire_vs_16bit']:.4f}", f"{r['numpy_encode_ms_per_M']:.2f}",
                         f"{r['numpy_decode_ms_per_M']:.2f}", f"{r['numba_encode_ms_per_M']:.2f}",
                         f"{r['numba_decode_ms_per_M']:.2f}"))
    return found
