"""offload='cpu': the master weights and the rule's state on the host (``zero1_mpi.state.host``),
all of them or the share ``offload_fraction``.

On 3 ranks and with hierarchical sharding the offloaded optimizer (whole and half) equals the
one without, bit for bit, for every rule of the registry and dtype, with stage 2, and with
remainder masters (the device's part), bf16 and 8-bit state; on 3 ranks also at the split's
edges (ranks owning only padding, shares of one piece or all but one), and a partly offloaded
save loads on one rank with another share;
checkpoints and exports load across them, and right after a load the parameters are the saved
ones (tests/cases/offload.py); bad offload options fail on every rank (tests/cases/bad_input.py).
Here too: the threaded host kernel has the one-thread kernel's bits, the copies go one part
ahead, where the host part starts, the memory report's split is what tracemalloc measures
(whole, in part, stage 2), and the defaults of threads.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from casekit import run_twin
from mpirun import SIBLING, run_mpi
from zero1_mpi import ZeroAdam
from zero1_mpi.kernels.backend import PARAM_DTYPES
from zero1_mpi.flat.layout import build_layout
from zero1_mpi.state.placement import ShardRange
from zero1_mpi.state.masters import Fp32Masters
from zero1_mpi.state.host import HostShard, ParamsAsMasters, DeviceHostRow, ThreadedKernel, each_tensor_sums, host_start, resolve_threads
from zero1_mpi.state.encodings import Fp32State
from zero1_mpi.rules.registry import builtin_rules


@pytest.mark.parametrize("n, group", [SIBLING(3, None), (4, 2)])
def test_offloaded_equals_not_offloaded(tmp_path, n, group):
    """3 ranks (uneven shards), 4 in 2 groups of 2 (hierarchical sharding); after a load,
    the parameters of every bucket are the saved ones before any step."""
    args = [str(tmp_path)] + ([] if group is None else ["--group", str(group)])
    out = run_mpi(n, "offload.py", *args, timeout=300).stdout
    cases = 18 if group is None else 12  # in groups: fp32 and bf16 (fp16 takes bf16's path)
    assert f"OK offload: {cases} cases x 5 steps on {n} ranks, shard groups of {group or n}" \
        in out, out
    edges = 12 if group is None else 0  # (Adam and LAMB, 3 layouts, stage 1 and 2)
    assert f"whole and half; stage 2: 8 cases; modes: 3 x 4 rules; edges: {edges} cases" \
        in out, out


VARIANTS = [(name, index) for name, entry in builtin_rules().items()
            for index in range(len(entry.variants))]


@pytest.mark.parametrize("kind", ["numpy", "numba"])
@pytest.mark.parametrize("param_dtype", list(PARAM_DTYPES))
@pytest.mark.parametrize("name, index", VARIANTS)
def test_threaded_kernel_is_bitwise_one_thread(name, index, param_dtype, kind):
    if kind == "numba":
        pytest.importorskip("numba")
    entry = builtin_rules()[name]
    rule = entry.variants[index]
    options = rule.check_options(**entry.defaults)
    n = 3 * ThreadedKernel.MIN_ELEMENTS + 1001  # three threads, uneven ranges
    dtype = PARAM_DTYPES[param_dtype]
    one = run_twin(rule.kernel(kind, n), rule, options, dtype, dtype, n)
    threaded = ThreadedKernel(lambda: rule.kernel(kind, n), 4)
    many = run_twin(threaded, rule, options, dtype, dtype, n)
    assert threaded.scratch_bytes == 4 * rule.kernel(kind, n).scratch_bytes
    for ours, theirs in zip(one, many, strict=True):
        assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))


def test_tensor_sums_each_keeps_each_pieces_bits():
    """A two-phase rule's sums run whole pieces on the threads, in the pieces' order."""
    rule = builtin_rules()["lamb"].variants[0]
    options = rule.check_options(**builtin_rules()["lamb"].defaults)
    s = rule.scalars(1, options, 0.5)
    rng = np.random.default_rng(3)
    sizes = [5, 70_001, 1, 20_000, 333]

    def calls():
        return [(rng.standard_normal(k).astype(np.float32), np.ones(k, np.float32),
                 *(np.zeros(k, np.float32) for _ in rule.state_names), s) for k in sizes]
    rng = np.random.default_rng(3)
    one = [rule.kernel("numpy", 70_001).tensor_sums(*c) for c in calls()]
    rng = np.random.default_rng(3)
    many = each_tensor_sums(ThreadedKernel(lambda: rule.kernel("numpy", 70_001), 3), calls())
    assert [list(a) for a in one] == [list(b) for b in many]


def test_threaded_kernel_raises_a_threads_error():
    class Broken:
        scratch_bytes = 0

        def __call__(self, grad, master, param, s):
            if master.size < 2 * ThreadedKernel.MIN_ELEMENTS:
                raise FloatingPointError(f"range of {master.size}")

    kernel = ThreadedKernel(Broken, 2)
    n = 2 * ThreadedKernel.MIN_ELEMENTS
    with pytest.raises(FloatingPointError, match="range of"):
        kernel(np.zeros(n, np.float32), np.zeros(n, np.float32), None, None)


@pytest.mark.parametrize("start", [0, 67])
def test_host_shard_copies_one_part_ahead_and_pushes_behind(start):
    """The host parts from ``start`` on (67: the second bucket's shard cut after 3 of its 64
    positions): each fetched copy is its part of the reduced shard, each push writes its part
    of this rank's shard and nothing else, and completes the one before."""
    layout = build_layout({"w": (400,), "b": (240,)}, 2, "bfloat16", bucket_elements=128)
    params = np.zeros(layout.total, PARAM_DTYPES["bfloat16"])
    parts = []
    for bucket in layout.buckets:
        a = min(max(start - bucket.state.start, 0), bucket.shard_size)
        if a < bucket.shard_size:
            parts.append(ShardRange(bucket, a, bucket.shard_size, 10 + len(parts), True))
    assert [p.a for p in parts] == ([0] * 5 if start == 0 else [3, 0, 0, 0])
    shard = HostShard(layout, 1, params, True, parts, start)
    assert shard.master.size == layout.shard_total - start
    reduced = [np.arange(b.shard_size, dtype=np.float32) + 100 * b.index
               for b in layout.buckets]
    seen = []
    for part, grads in shard.fetched(reduced):
        source = reduced[part.bucket.index][part.a:part.b]
        assert not np.shares_memory(grads, source) and np.array_equal(grads, source)
        shard.output(part)[...] = part.bucket.index + 1
        seen.append(shard.push(part))
    indices = [p.bucket.index for p in parts]
    assert seen == [[]] + [[i] for i in indices[:-1]]
    assert shard.drain() == indices[-1:]
    for bucket in layout.buckets:
        lo, hi = bucket.shard(1)
        a = next((p.a for p in parts if p.bucket is bucket), hi - lo)
        assert np.all(params[lo + a:hi] == bucket.index + 1)
        assert not params[lo:lo + a].any()  # the device part: the device kernel's
        rest = np.delete(params[bucket.offset:bucket.offset + bucket.size],
                         np.arange(lo - bucket.offset, hi - bucket.offset))
        assert not rest.any()  # only this rank's shard is written; the gather does the rest


def test_the_host_part_starts_at_the_piece_nearest_the_fraction():
    pieces = [(0, 100), (100, 300), (400, 50), (512, 12)]  # 462 real of 576 positions
    assert host_start(pieces, 576, 1.0) == 0 and host_start(pieces, 576, 0.0) == 576
    assert host_start(pieces, 576, 0.5) == 100  # 362 on the host: 131 from 231; 62: 169
    assert host_start(pieces, 576, 0.2) == 400  # 62 of 92.4
    assert host_start(pieces, 576, 0.02) == 512  # 12 of 9.24
    assert host_start(pieces, 576, 0.01) == 576  # 0 of 4.62 (12 is farther)
    assert host_start(pieces, 576, 0.99) == 0  # 462
    assert host_start([], 64, 0.5) == 64  # no real element: nothing to move (ties: earlier)


def test_split_rows_read_and_write_across_the_cut():
    device, host = Fp32State(np.arange(5, dtype=np.float32)), Fp32State(np.zeros(3, np.float32))
    row = DeviceHostRow(device, host, 5, 2)
    assert row.nbytes == 32 and row.real_bytes(6) == 24
    assert np.shares_memory(row.read(slice(1, 4)), device.held)  # one side: a view
    row.write(slice(3, 7), np.array([10, 11, 12, 13], np.float32))
    assert row.held.tolist() == [0, 1, 2, 10, 11, 12, 13, 0]
    assert row.read(slice(4, 8)).tolist() == [11, 12, 13, 0]
    assert row.load(slice(6, 8), 0).base is host.held
    with pytest.raises(ValueError, match="cross the offload cut 5"):
        row.load(slice(4, 6), 0)


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_no_share_offloaded_is_the_optimizer_without_offload(param_dtype):
    """offload_fraction=0: nothing on the host, so the optimizer offload=None builds: its
    masters (bf16: remainders by default), no host state or threads, the same bits."""
    import casekit as kit
    shapes = {"w": (300, 7), "b": (11,)}
    init = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32)
            for k, s in shapes.items()}
    plain = ZeroAdam(dict(init), param_dtype=param_dtype, bucket_elements=512)
    none = ZeroAdam(dict(init), param_dtype=param_dtype, bucket_elements=512, offload="cpu",
                    offload_fraction=0, offload_threads=2)
    assert none.options.masters == plain.options.masters
    assert none.options.masters == ("remainder" if param_dtype == "bfloat16" else "fp32")
    report, want = none.memory_report(), plain.memory_report()
    assert not report.offloaded and report.host_bytes == 0 and report == want
    assert "offload='cpu', offload_fraction=0)" in repr(none)
    kit.train(plain, range(4), shapes)
    kit.train(none, range(4), shapes)
    for k in shapes:
        assert kit.same_bits(kit.params_of(none)[k], kit.params_of(plain)[k]), k


@pytest.mark.parametrize("mode", [{"state_dtype": "bfloat16"}, {"state_dtype": "int8"}])
def test_a_side_that_keeps_nothing_holds_no_buffers(mode, monkeypatch):
    """Offloaded whole, the device keeps no state, so no decoding buffers (the same device
    scratch as fp32 state); with a share too small for any tensor piece the host keeps nothing,
    and holds no buffers and no threads for it. (NumPy kernels: the plain state with Numba's
    one-pass kernel needs no decoding buffers at all, which the offloaded device side keeps.)"""
    monkeypatch.setenv("ZERO1_MPI_KERNEL", "numpy")
    params = {f"w{i}": np.ones(20_000, np.float32) for i in range(4)}
    engine = dict(param_dtype="bfloat16", offload="cpu", offload_threads=2)
    whole = ZeroAdam(dict(params), **engine, **mode).memory_report()
    fp32 = ZeroAdam(dict(params), **engine).memory_report()
    assert whole.comm_scratch == fp32.comm_scratch and whole.host_scratch > fp32.host_scratch
    tiny = ZeroAdam(dict(params), **engine, **mode, offload_fraction=0.01)
    plain = ZeroAdam(dict(params), param_dtype="bfloat16", masters="fp32", **mode)
    r = tiny.memory_report()
    assert r.offloaded and r.host_state == 0 and r.offload_fraction == 0
    assert r.comm_scratch == plain.memory_report().comm_scratch
    assert r.host_scratch <= 64  # no slot or buffer of a shard's size: the kernel's scalars
    assert tiny.state.place.host_kernel.threads == 1


def test_memory_report_is_what_tracemalloc_measures():
    """NumPy parameters: the host and the device are one; everything built is reported."""
    psi = 1_000_000
    params = {"w": np.ones((1000, 1000), np.float32)}
    ZeroAdam({"w": np.ones(10, np.float32)}, param_dtype="bfloat16", offload="cpu",
             offload_threads=2).step()  # imports the host kernel (Numba) outside the count
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        opt = ZeroAdam(params, param_dtype="bfloat16", offload="cpu", offload_threads=2)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    report = opt.memory_report()
    assert report.offloaded and report.psi == psi
    assert report.device_formula_bytes == 4 * psi and report.host_formula_bytes == 12 * psi
    assert report.device_bytes - report.padding - report.comm_scratch == 4 * psi
    assert report.host_bytes - report.host_padding - report.host_scratch == 12 * psi
    assert report.total <= measured < report.total + 256 * 1024, (measured, report.total)
    assert "device formula" in str(report) and "host 12Ψ/N" in str(report)


@pytest.mark.parametrize("param_dtype, stage2", [("bfloat16", False), ("float32", False),
                                                 ("bfloat16", True)])
def test_partial_offload_memory_is_what_tracemalloc_measures(param_dtype, stage2):
    """offload_fraction=0.3 of ten equal tensors: three on the host, seven on the device, each
    side's bytes as the formula says, and all of it what tracemalloc measures."""
    params = {f"w{i}": np.ones(100_000, np.float32) for i in range(10)}
    engine = dict(param_dtype=param_dtype, offload="cpu", offload_threads=2, masters="fp32",
                  offload_fraction=0.3, shard_gradients=stage2)
    ZeroAdam({"w": np.ones(10, np.float32)}, **engine).step()  # imports outside the count
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        opt = ZeroAdam(params, **engine)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    r = opt.memory_report()
    psi, device_k = 1_000_000, 12 if param_dtype == "bfloat16" else 8
    assert r.offload_fraction == 0.3 and r.host_state == 12 * 300_000
    assert r.optimizer_state - r.host_state == device_k * 700_000
    replicated = r.parameters + r.gradients
    byte = {"rel": 0, "abs": 0.5}  # (the formulas are floats: psi times a share)
    assert r.device_formula_bytes == pytest.approx(replicated + device_k * 700_000, **byte)
    assert r.host_formula_bytes == pytest.approx(12 * 300_000, **byte)
    assert r.device_bytes - r.padding - r.comm_scratch == pytest.approx(r.device_formula_bytes,
                                                                        **byte)
    assert r.host_bytes - r.host_padding - r.host_scratch == pytest.approx(r.host_formula_bytes,
                                                                           **byte)
    assert r.total <= measured < r.total + 256 * 1024, (measured, r.total)
    assert r.gradients == psi * (2 if param_dtype == "bfloat16" else 4)
    assert "offload_fraction=0.3" in repr(opt)


@pytest.mark.parametrize("mode", [{"state_dtype": "bfloat16"}, {"state_dtype": "int8"},
                                  {"masters": "remainder"}])
def test_offloaded_modes_memory_is_what_tracemalloc_measures(mode):
    """Each way of keeping the state, a third offloaded: every byte on one side or the other,
    the codecs' buffers too, is what tracemalloc measures; the host's K' is the mode's."""
    params = {f"w{i}": np.ones(100_000, np.float32) for i in range(9)}
    engine = dict(param_dtype="bfloat16", offload="cpu", offload_threads=2,
                  offload_fraction=1 / 3, **mode)
    ZeroAdam({"w": np.ones(5000, np.float32)}, **engine).step()  # imports outside the count
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        opt = ZeroAdam(params, **engine)
        opt.step()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    r = opt.memory_report()
    assert r.offload_fraction == pytest.approx(1 / 3) and r.device_bytes + r.host_bytes == r.total
    state = {"bfloat16": 2, "int8": 1 + 4 / 256}.get(mode.get("state_dtype"), 4)
    assert r.host_bytes_per_param == 4 + 2 * state
    assert r.total <= measured < r.total + 256 * 1024, (measured, r.total)


def test_threads_default_to_the_cores_the_rank_may_use(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert resolve_threads(None, 4) == 4  # not bound: the node's cores shared
    assert resolve_threads(None, 32) == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3, 4}, raising=False)
    assert resolve_threads(None, 4) == 3  # bound by the launcher: its cores
    assert resolve_threads(5, 4) == 5
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="offload_threads="):
            resolve_threads(bad, 1)


@pytest.mark.mpi_independent  # the tool's report; the MPI calls: test_offloaded_equals_not_offloaded's
@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_offload_bench_tool_reports_every_setting(tmp_path, rule):
    """`tools/bench.py offload` on NumPy parameters (the device script runs it on a GPU): the
    device holds 16-bit params and grads only when offloaded whole, the host the rest; half
    offloaded, half of the state on each side."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "bench.json"
    tool = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
    result = subprocess.run([sys.executable, str(tool), "offload", "--backend", "numpy", "--params", "1M",
                             "--steps", "1", "--rule", rule, "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plain, half, offloaded = json.loads(out.read_text())["rows"]
    k = {"adam": 12, "sgd": 4}[rule]  # SGD by default has no momentum: the master only
    assert half["fraction"] == 0.5  # 4 of the 8 tensors, fp32 masters on both sides
    assert half["device_formula_per_param"] == pytest.approx(4 + k / 2)
    assert half["host_formula_per_param"] == pytest.approx(k / 2)
    # not offloaded, bf16 masters are remainders (2 bytes); offloaded, fp32 on the host
    assert plain["device_formula_per_param"] == 4 + k - 2
    assert plain["host_formula_per_param"] == 0
    assert offloaded["device_formula_per_param"] == 4
    assert offloaded["host_formula_per_param"] == k
    assert 4 <= offloaded["device_report_per_param"] < 4.5  # + padding and scratch
    assert offloaded["host_report_per_param"] >= k
    assert "offloaded step / device step" in result.stdout


def test_importing_the_package_starts_no_thread_pool_machinery():
    """concurrent.futures is imported only when an offloaded optimizer uses threads: its
    shutdown hook made a JAX process abort at exit now and then (tests/test_example_jax_mlp.py)."""
    import subprocess
    import sys
    code = ("import sys, zero1_mpi, zero1_mpi.state.host; "
            "print(sorted(m for m in sys.modules if m.startswith('concurrent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_fp32_parameters_are_their_own_masters_on_the_device_side():
    """A partly offloaded row of fp32 parameters' masters: the device side holds no byte (the
    parameters are the masters), the host side its fp32 array; read across the cut, the
    parameters then the host's masters; written, each side its part."""
    host = Fp32Masters(np.zeros(6, np.float32))
    row = DeviceHostRow(ParamsAsMasters(), host, 4, 6)
    assert row.nbytes == host.nbytes == 24 and row.real_bytes(10) == 24
    assert ParamsAsMasters().scratch_bytes == 0 and row.chunk == host.chunk
    param = np.arange(10, dtype=np.float32)
    row.write(slice(0, 10), param + 0.5, param)
    assert np.array_equal(param[:4], np.arange(4) + 0.5)  # the device side: the parameters
    assert np.array_equal(host.held, np.arange(4, 10) + 0.5)
    assert np.array_equal(row.read(slice(2, 8), param[2:8]), np.arange(2, 8) + 0.5)
