"""Overflow and bad options inside ``step()`` are agreed on by all ranks: no rank hangs, nothing
is updated anywhere, and the dynamic loss scale backs off (or the error is raised everywhere).

Run on any number of ranks. Bad values are planted on one rank only.
"""

import numpy as np
from mpi4py import MPI

from zero1_mpi import CollectiveError, LossScaler, ZeroAdam
from expect import check

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
last = size - 1


def make(loss_scale, **kwargs):
    init = {"w": np.linspace(-1, 1, 300, dtype=np.float32), "b": np.ones(7, np.float32)}
    return ZeroAdam(init, comm, lr=1e-2, param_dtype="float16", loss_scale=loss_scale, **kwargs)


def fill(opt, step, bad_rank=None, bad_value=np.inf):
    rng = np.random.default_rng([step, rank])
    for g in opt.grads.values():
        g[...] = rng.standard_normal(g.shape) * opt.loss_scale / 64
    if rank == bad_rank:
        opt.grads["w"][123] = bad_value


def snapshot(opt):
    return [a.copy() for a in (opt.state.flat, opt.state.master, *opt.state.state.values())]


def unchanged(opt, before):
    return all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip(snapshot(opt), before))


def expect_raise(exc_type, words, fn):
    try:
        fn()
    except exc_type as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            raise AssertionError(f"message {str(exc)!r} lacks {missing}") from None
    else:
        raise AssertionError(f"{exc_type.__name__} not raised on rank {rank}")


def dynamic_scaling():
    opt = make(LossScaler.dynamic_scaler(init_scale=1024.0, min_scale=256.0,
                                         growth_interval=1000))
    fill(opt, 1)
    check(not opt.step().skipped)
    for bad_rank, bad_value, scale_before in ((last, np.inf, 1024.0), (0, np.nan, 512.0)):
        fill(opt, 2, bad_rank, bad_value)
        before = snapshot(opt)
        info = opt.step()
        check(info.skipped and info.loss_scale == scale_before and info.step == 1, info)
        check(not np.isfinite(info.grad_norm))
        check(opt.loss_scale == scale_before / 2 and opt.step_count == 1)
        check(unchanged(opt, before), "a skipped step changed the optimizer")
        check(not any(np.any(g != 0) for g in opt.grads.values()))
    # At the minimum scale an overflow cannot be answered by backing off: error everywhere.
    fill(opt, 3, last)
    before = snapshot(opt)
    expect_raise(FloatingPointError, ["inf or nan", "loss scale 256", "nothing was updated"],
                 opt.step)
    check(unchanged(opt, before))
    fill(opt, 4)  # and training goes on once the gradients are finite again
    info = opt.step()
    check(not info.skipped and info.step == 2 and not unchanged(opt, before))


def without_dynamic_scaling():
    for loss_scale in (None, 128.0):
        opt = make(loss_scale)
        fill(opt, 1, last, np.nan)
        before = snapshot(opt)
        expect_raise(FloatingPointError, ["inf or nan", "loss_scale='dynamic'"], opt.step)
        check(unchanged(opt, before) and opt.step_count == 0)


def float16_sum_overflows_in_mpi():
    """Finite fp16 gradients whose fp16 sum overflows: float32 sums are fine, float16 skip."""
    for reduce_dtype, overflows in (("float32", False), ("float16", size > 1)):
        opt = make(LossScaler.dynamic_scaler(init_scale=2.0), reduce_dtype=reduce_dtype)
        opt.grads["w"][...] = 60000.0  # x 2 ranks > 65504, the largest float16
        info = opt.step()
        check(info.skipped is overflows, (reduce_dtype, info))


def bad_group_option_on_one_rank():
    opt = make(None)
    fill(opt, 1)
    opt.step()
    before = snapshot(opt)
    if rank == last:
        opt.param_groups[0]["lr"] = -0.5
    fill(opt, 2)
    expect_raise(ValueError, ["param_groups[0]", "lr=-0.5", f"rank {last}"], opt.step)
    check(unchanged(opt, before) and opt.step_count == 1)
    opt.param_groups[0]["lr"] = 1e-2
    fill(opt, 2)
    check(opt.step().step == 2)


def different_lr_on_one_rank():
    opt = make(None)
    fill(opt, 1)
    opt.step()
    before = snapshot(opt)
    if rank == last:
        opt.param_groups[0]["lr"] = 0.5  # valid, but not what the other ranks use
    fill(opt, 2)
    if size > 1:
        expect_raise(CollectiveError, ["param_groups options", "differ between ranks"], opt.step)
        check(unchanged(opt, before) and opt.step_count == 1)
    else:
        check(opt.step().step == 2)


def main():
    dynamic_scaling()
    without_dynamic_scaling()
    float16_sum_overflows_in_mpi()
    bad_group_option_on_one_rank()
    different_lr_on_one_rank()
    if rank == 0:
        print(f"OK overflow on {size} ranks")


if __name__ == "__main__":
    main()
