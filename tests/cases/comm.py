"""The communicator's collectives on every dtype, direct and through the staging path.

Run on any number of ranks. ``stage_host=True`` sends host buffers through the same staging
code that CuPy buffers take when MPI is not CUDA-aware. Staging copies bytes, so every
collective gives identical results through it. What may differ is the order in which MPI adds
the ranks' gradients: a staged reduction is a blocking ``Reduce_scatter_block``, a direct one
is started (persistent or nonblocking), and Open MPI 5 runs those with different algorithms
(at 4 ranks ``((0+2)+(1+3))`` blocking, ``((0+1)+(2+3))`` started). Both are exact sums in
some order, which ``check_reduce_scatter_adds_in_some_order`` proves, so the optimizer is
identical through staging for 16-bit gradients (summed locally, in rank order) and within
fp32 rounding of the sum for fp32 ones.
"""

import itertools

import numpy as np
from mpi4py import MPI

from zero1_mpi import CollectiveError, Communicator, ZeroAdam
from zero1_mpi.kernels.backend import PARAM_DTYPES
import casekit as kit
from casekit import check

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def exact_values(n, r, dtype):
    """Small integers: sums of them are exact in every dtype, so results compare bitwise."""
    return ((np.arange(n) % 7) + r).astype(np.float32).astype(dtype)


def check_collectives(comm):
    for name, dtype in PARAM_DTYPES.items():
        block = 5
        n = block * size
        # Alltoall: block j of my send buffer goes to rank j.
        send = exact_values(n, rank, dtype)
        recv = np.empty(n, dtype)
        comm.alltoall(send, recv)
        for src in range(size):
            want = exact_values(n, src, dtype)[rank * block:(rank + 1) * block]
            check(np.array_equal(recv[src * block:(src + 1) * block], want), name)
        # In-place Allgather: each rank fills its own block first.
        buf = np.zeros(n, dtype)
        buf[rank * block:(rank + 1) * block] = exact_values(block, rank, dtype)
        comm.allgather_inplace(buf)
        for src in range(size):
            check(np.array_equal(buf[src * block:(src + 1) * block],
                                 exact_values(block, src, dtype)), name)
        # Bcast from the last rank.
        buf = exact_values(n, rank, dtype)
        comm.bcast(buf, root=size - 1)
        check(np.array_equal(buf, exact_values(n, size - 1, dtype)), name)
        # Reduce-scatter exists for the dtypes MPI can sum.
        if name != "bfloat16":
            buf = send.copy()
            got = comm.reduce_scatter_sum(buf)  # in place: MPI leaves my block at the front
            want = sum(exact_values(n, r, np.float32) for r in range(size))
            mine = want[rank * block:(rank + 1) * block].astype(dtype)
            check(np.shares_memory(got, buf[:block]) and got.size == block, name)
            check(np.array_equal(got, mine), name)
        else:
            try:
                comm.reduce_scatter_sum(send.copy())
            except TypeError as exc:
                check("bfloat16" in str(exc))
            else:
                raise AssertionError("bfloat16 reduction did not raise")


def sums_in_every_order(parts):
    """{bytes of the fp32 result: expression} over every order and bracketing of ``parts``."""
    def trees(items):
        if len(items) == 1:
            yield str(items[0]), parts[items[0]]
            return
        for cut in range(1, len(items)):
            for left, a in trees(items[:cut]):
                for right, b in trees(items[cut:]):
                    yield f"({left}+{right})", a + b
    found = {}
    for order in itertools.permutations(range(len(parts))):
        for expression, total in trees(list(order)):
            found.setdefault(total.tobytes(), expression)
    return found


def check_reduce_scatter_adds_in_some_order():
    """Random fp32 gradients: every way the communicator reduces them (blocking or started,
    direct or staged) gives, on every rank, the fp32 sum of the ranks' values in some order."""
    if size > 4:
        return  # (2n-2)!/(n-1)! orders: enough to check up to 4 ranks
    block = 999
    values = [np.random.default_rng([11, r]).standard_normal(block * size).astype(np.float32)
              * 2.0 ** r for r in range(size)]
    orders = sums_in_every_order([v[rank * block:(rank + 1) * block] for v in values])
    for stage_host in (False, True):
        comm = Communicator(world, stage_host=stage_host)
        for how in ("blocking", "started"):
            buf = values[rank].copy()
            if how == "blocking":
                got = comm.reduce_scatter_sum(buf)
            else:
                comm.start_reduce_scatter(buf).wait()
                got = comm.reduced_block(buf)
            check(got.tobytes() in orders, (how, stage_host, "not a sum of the ranks' values"))
        comm.close()


def check_allreduce_sum(comm):
    totals = comm.allreduce_sum([rank, 1.0, np.inf if rank == size - 1 else 0.0])
    check(list(totals) == [size * (size - 1) / 2, size, np.inf])


def check_agreement(comm):
    comm.agree(None)
    try:
        comm.agree("bad value on the last rank" if rank == size - 1 else None)
    except ValueError as exc:
        check(f"bad value on the last rank [detected on rank {size - 1}" in str(exc))
    else:
        raise AssertionError("agree did not raise")
    comm.check_same("same", "a value", "fix it")
    if size > 1:
        try:
            comm.check_same(rank == 0, "the flag", "pass the same flag")
        except CollectiveError as exc:
            check("the flag differs between ranks" in str(exc))
        else:
            raise AssertionError("check_same did not raise")


def check_optimizer_through_staging():
    """The whole optimizer through staged buffers equals it without: bit for bit for 16-bit
    gradients, within fp32 rounding of the sum over ranks for fp32 ones (see the docstring)."""
    results = []
    for stage_host in (False, True):
        for dtype in ("float32", "float16", "bfloat16"):
            comm = Communicator(world, stage_host=stage_host)
            opt = ZeroAdam({"a": np.linspace(-1, 1, 301, dtype=np.float32), "b": np.ones(3)},
                           comm, lr=0.1, param_dtype=dtype, bucket_elements=200)
            for step in range(3):
                rng = np.random.default_rng([step, rank])
                for k, g in opt.grads.items():
                    g[...] = rng.standard_normal(g.shape)
                opt.step()
            results.append(kit.shard_arrays(opt)["params"].copy())
            if stage_host:
                check(comm.routes.staging_bytes > 0)
    half = len(results) // 2
    for dtype, direct, staged in zip(("float32", "float16", "bfloat16"), results[:half],
                                     results[half:]):
        if dtype == "float32":
            check(np.allclose(direct, staged, rtol=1e-6, atol=1e-7), dtype)
        else:
            check(np.array_equal(direct.view(np.uint8), staged.view(np.uint8)), dtype)


def check_float16_reduction_in_mpi():
    """reduce_dtype="float16" sums in MPI's fp16; with sums exact in fp16 it equals float32."""
    results = []
    for reduce_dtype in ("float32", "float16"):
        opt = ZeroAdam({"w": np.linspace(-1, 1, 333, dtype=np.float32)}, world, lr=0.1,
                       param_dtype="float16", reduce_dtype=reduce_dtype, bucket_elements=100)
        for step in range(3):
            opt.grads["w"][...] = exact_values(333, rank + step, np.float16)
            opt.step()
        results.append(kit.shard_arrays(opt)["params"].copy())
    check(np.array_equal(results[0].view(np.uint16), results[1].view(np.uint16)))


def check_steady_state_allocations():
    """A step in steady state allocates no memory that grows with the model: a few KB of
    Python objects, the same at two sizes with the same buckets (so per-element allocations,
    even a bit per element, show as the difference)."""
    import tracemalloc
    for dtype in ("float32", "bfloat16"):
        peaks = []
        for rows in (500, 2000):
            opt = ZeroAdam({"w": np.zeros((rows, 400), np.float32),
                            "b": np.zeros(400, np.float32)}, world, param_dtype=dtype,
                           bucket_elements=rows * 128, max_grad_norm=1.0)
            for _ in range(3):
                opt.grads["w"][...] = 1e-3
                opt.step()
            opt.grads["w"][...] = 1e-3
            tracemalloc.start()
            opt.step()
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        # The Python objects of a step (MPI requests, views, the kernels' arguments) vary by a
        # few hundred bytes between MPI libraries. The NumPy kernel's 16-bit casts use NumPy's
        # cast buffers instead, which grow with the chunk up to a fixed size.
        if opt.kernel == "numba" or dtype == "float32":
            check(max(peaks) < 12 * 1024, f"{dtype}/{opt.kernel}: a step allocated {peaks} B")
            check(peaks[1] - peaks[0] < 2048,
                  f"{dtype}/{opt.kernel}: 4x the elements allocated {peaks} bytes per step")
        else:
            check(max(peaks) < 96 * 1024, f"{dtype}/{opt.kernel}: a step allocated {peaks} B")


def check_started_out_of_place():
    """``reduce_out_of_place`` (what device buffers handed to MPI take): two reduce-scatters
    in flight, started persistent (where the library is proven) or nonblocking, each fills a
    block of its own and lands at the front of its buffer on ``wait``, for every step; the
    blocks are counted (``block_bytes``) and ``close`` frees them; the optimizer is the same
    as with in-place ones (exact sums)."""
    block, n = 6, 6 * size
    want = sum(exact_values(n, r, np.float32) for r in range(size))[rank * block:][:block]
    for persistent in (None, False):
        comm = Communicator(world, persistent=persistent, reduce_out_of_place=True)
        bufs = [np.empty(n, np.float32) for _ in range(2)]
        for step in range(3):
            for i, buf in enumerate(bufs):
                buf[...] = exact_values(n, rank, np.float32) * (step + i + 1)
            requests = [comm.start_reduce_scatter(buf) for buf in bufs]
            for i, request in enumerate(requests[::-1]):
                request.wait()
            for i, buf in enumerate(bufs):
                check(np.array_equal(buf[:block], want * (step + i + 1)),
                      f"out of place, persistent={comm.persistent}, step {step}, buffer {i}")
        check(comm.routes.block_bytes == 2 * block * 4, f"block_bytes {comm.routes.block_bytes}")
        comm.close(bufs[:1])
        check(comm.routes.block_bytes == block * 4,
              f"after close: block_bytes {comm.routes.block_bytes}")
        comm.free()
        check(comm.routes.block_bytes == 0, "free() kept the blocks")
    results = []
    for out_of_place in (False, True):
        comm = Communicator(world, reduce_out_of_place=out_of_place)
        opt = ZeroAdam({"w": np.linspace(-1, 1, 333, dtype=np.float32)}, comm, lr=0.1,
                       bucket_elements=100)
        for step in range(3):
            opt.grads["w"][...] = exact_values(333, rank + step, np.float32)
            opt.step()
        results.append(kit.shard_arrays(opt)["params"].copy())
        if out_of_place:
            check(opt.memory_report().comm_scratch >= comm.routes.block_bytes > 0,
                  "the out-of-place blocks are not in the memory report")
    check(np.array_equal(results[0], results[1]), "out of place differs from in place")


def main():
    check_steady_state_allocations()
    check_float16_reduction_in_mpi()
    for settings in ({"stage_host": False}, {"stage_host": True}, {"reduce_out_of_place": True}):
        comm = Communicator(world, **settings)
        check_collectives(comm)
        check_allreduce_sum(comm)
        check_agreement(comm)
    check_started_out_of_place()
    check_reduce_scatter_adds_in_some_order()
    check_optimizer_through_staging()
    if rank == 0:
        print(f"OK comm on {size} ranks")


if __name__ == "__main__":
    main()
