"""The bucket pipeline through its interface, in one process: readiness starts buckets last to
first, only once every later bucket has started; usage errors come before any collective;
``reduce_all`` returns each bucket's shard and begins a new round; ``discard`` forgets a round;
gathers are counted until waited for. And on 3 ranks (tests/cases/overlap.py): the overlapped
step, the reductions started from ``grads_ready`` in a different order on every rank and the
gathers left in flight, gives the plain step's bits."""

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import run_mpi
from zero1_mpi import Communicator, build_layout
from zero1_mpi.gradients.stage1 import BucketPipeline
from zero1_mpi.wire.param_gathers import ParamGathers
from zero1_mpi.comm.topology import Topology
from zero1_mpi.comm.watchdog import Watchdog

one_process = pytest.mark.mpi_independent  # (conftest.py)

# Three buckets of 64: "a" in the first, "b" across the first two, "c" in the last.
SHAPES = {"a": (40,), "b": (60,), "c": (50,)}


def pipeline():
    layout = build_layout(SHAPES, 1, "float32", bucket_elements=64)
    topology = Topology(Communicator(MPI.COMM_SELF), 1, owns_comm=True)
    buckets = BucketPipeline(layout, np, np.float32, topology, None, None, Watchdog(None))
    return buckets, buckets.buffer


@one_process
def test_buckets_start_last_to_first_once_their_tensors_are_ready():
    buckets, _ = pipeline()
    assert len(buckets.layout.buckets) == 3 and buckets.started == ()
    buckets.mark_ready(buckets.check_ready("a"))  # bucket 0 is ready, 1 and 2 are not
    assert buckets.started == ()
    buckets.mark_ready(buckets.check_ready(["c"]))  # bucket 2 ("c" and padding)
    assert buckets.started == (2,)
    buckets.mark_ready(buckets.check_ready(["b"]))  # buckets 1, then 0 (waiting for 1)
    assert buckets.started == (2, 1, 0)


@one_process
def test_usage_errors_come_first_and_change_nothing():
    buckets, _ = pipeline()
    buckets.mark_ready(buckets.check_ready("c"))
    with pytest.raises(KeyError, match="no parameter of that name"):
        buckets.check_ready(["a", "nope"])
    with pytest.raises(ValueError, match="again before step"):
        buckets.check_ready("c")
    assert buckets.started == (2,)


@one_process
def test_reduce_all_returns_every_shard_and_begins_a_new_round():
    buckets, grads = pipeline()
    grads[:] = np.arange(grads.size)
    buckets.mark_ready(buckets.check_ready("c"))
    reduced = buckets.reduce_all()
    assert [r.size for r in reduced] == [64, 64, 64]
    assert np.array_equal(np.concatenate(reduced), np.arange(grads.size))  # one rank: a view
    assert buckets.started == ()
    buckets.mark_ready(buckets.check_ready("c"))  # ready again in the new round
    assert buckets.started == (2,)
    buckets.discard()
    assert buckets.started == ()


@one_process
def test_gathers_are_counted_until_waited_for():
    buckets, _ = pipeline()
    gathers = ParamGathers(buckets.layout, np.zeros(buckets.layout.total, np.float32),
                           Communicator(MPI.COMM_SELF), Watchdog(None))
    for index in (2, 1, 0):
        gathers.start(index)
    assert gathers.in_flight == 3
    gathers.wait()
    assert gathers.in_flight == 0
    assert buckets.scratch_bytes == 0  # no 16-bit exchange: no receive slots


def test_overlapped_communication_gives_the_same_bits():
    """Every MPI's pass: what MPI does with started collectives is the library's own."""
    assert "OK overlap on 3 ranks" in run_mpi(3, "overlap.py", timeout=120).stdout
