"""How the communicator decides whether MPI takes GPU buffers (and in which collectives),
what it refuses, and how a failing collective call of another library reaches every rank."""

import pytest
from mpi4py import MPI

from mpirun import run_mpi
from zero1_mpi.comm import capabilities
from zero1_mpi.comm.capabilities import (CUDA_AWARE_ENV, DEVICE_STARTED_ENV, mpi_library,
                                          query_cuda_support, resolve_cuda_aware,
                                          resolve_device_started)
from zero1_mpi.comm.communicator import Communicator

MPICH = ("MPICH", (5, 0, 2))
INTEL = ("Intel MPI", (2021, 18))


def never_asked():
    raise AssertionError("the MPI query must not run when the answer is already known")


def test_explicit_setting_wins_over_environment_and_query():
    assert resolve_cuda_aware(True, {CUDA_AWARE_ENV: "0"}, never_asked) == (True, "argument")
    assert resolve_cuda_aware(False, {CUDA_AWARE_ENV: "1"}, never_asked) == (False, "argument")


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("ON", True),
                                             ("0", False), ("false", False), ("off", False)])
def test_environment_wins_over_query(value, expected):
    aware, source = resolve_cuda_aware(None, {CUDA_AWARE_ENV: value}, never_asked)
    assert aware is expected and CUDA_AWARE_ENV in source


def test_query_then_default():
    assert resolve_cuda_aware(None, {}, lambda: True, MPICH) == (True, "MPIX_Query_cuda_support")
    assert resolve_cuda_aware(None, {}, lambda: False, MPICH) == (False,
                                                                 "MPIX_Query_cuda_support")
    assert resolve_cuda_aware(None, {CUDA_AWARE_ENV: ""}, lambda: None, MPICH)[0] is False


@pytest.mark.parametrize("environ, aware, words", [
    ({"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "cuda"}, True,
     "Intel MPI 2021.18 with I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda"),
    ({"I_MPI_OFFLOAD": "1"}, True, "I_MPI_OFFLOAD_MODE=auto"),
    ({"I_MPI_OFFLOAD": "2", "I_MPI_OFFLOAD_MODE": "CUDA"}, True, "I_MPI_OFFLOAD=2"),
    ({"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "level_zero"}, False, "level_zero, not cuda"),
    ({"I_MPI_OFFLOAD": "0"}, False, "without I_MPI_OFFLOAD=1"),
    ({}, False, "set I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda"),
])
def test_intel_mpi_takes_device_buffers_where_i_mpi_offload_says(environ, aware, words):
    """Intel MPI's own switch decides (it has no MPIX_Query_cuda_support to ask); an explicit
    setting or ZERO1_MPI_CUDA_AWARE still wins, and other libraries ignore I_MPI_OFFLOAD."""
    decided, source = resolve_cuda_aware(None, environ, never_asked, INTEL)
    assert decided is aware and words in source
    assert resolve_cuda_aware(None, {**environ, CUDA_AWARE_ENV: "0"}, never_asked,
                              INTEL)[0] is False
    assert resolve_cuda_aware(None, environ, lambda: False, MPICH) == (
        False, "MPIX_Query_cuda_support")


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match=f"{CUDA_AWARE_ENV}='maybe'"):
        resolve_cuda_aware(None, {CUDA_AWARE_ENV: "maybe"}, never_asked)
    with pytest.raises(TypeError, match="cuda_aware='yes'"):
        resolve_cuda_aware("yes", {}, never_asked)


def test_communicator_follows_the_query_when_nothing_is_set(monkeypatch):
    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    comm = Communicator(MPI.COMM_SELF)
    answer = query_cuda_support()
    if mpi_library()[0] == "Intel MPI":  # I_MPI_OFFLOAD decides there
        assert comm.cuda_aware_source.startswith("Intel MPI 20")
        return
    assert comm.cuda_aware is bool(answer)
    assert comm.cuda_aware_source == ("MPIX_Query_cuda_support" if answer is not None
                                      else "default (no query available)")
    if "MPICH" in MPI.Get_library_version() or "Open MPI" in MPI.Get_library_version():
        assert answer is not None  # both export MPIX_Query_cuda_support


@pytest.mark.parametrize("bad", ["world", 3, None.__class__])
def test_not_a_communicator(bad):
    with pytest.raises(TypeError, match="intracommunicator"):
        Communicator(bad)


def test_comm_null():
    with pytest.raises(ValueError, match="COMM_NULL"):
        Communicator(MPI.COMM_NULL)


def test_nccl_communicator_needs_cupy_and_says_so():
    try:
        import cupy.cuda.nccl  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy with NCCL is installed: tests/test_gpu.py covers NcclCommunicator")
    from zero1_mpi.comm.nccl import NcclCommunicator
    with pytest.raises(ImportError, match="NcclCommunicator needs CuPy built with NCCL"):
        NcclCommunicator(MPI.COMM_SELF)


def test_started_collectives_take_device_buffers_only_when_told_or_proven(monkeypatch):
    assert resolve_device_started(None, {}, INTEL) == (
        False, "Intel MPI 2021.18 (not proven on device buffers: blocking collectives)")
    monkeypatch.setattr(capabilities, "DEVICE_STARTED_PROVEN", (("Intel MPI", (2021, 18)),))
    assert resolve_device_started(None, {}, INTEL) == (
        True, "Intel MPI 2021.18 (proven by tools/mpi_probe.py --device)")
    assert resolve_device_started(None, {}, ("Intel MPI", (2021, 17)))[0] is False
    assert resolve_device_started(None, {DEVICE_STARTED_ENV: "0"}, INTEL)[0] is False
    assert resolve_device_started(None, {DEVICE_STARTED_ENV: "1"})[0] is True
    assert resolve_device_started(True, {DEVICE_STARTED_ENV: "0"}) == (True, "argument")
    with pytest.raises(ValueError, match=f"{DEVICE_STARTED_ENV}='sometimes'"):
        resolve_device_started(None, {DEVICE_STARTED_ENV: "sometimes"})
    comm = Communicator(MPI.COMM_SELF, device_started=True)
    assert comm.device_started and comm.device_started_source == "argument"


def test_two_ranks_on_one_gpu_is_named_before_nccl_starts():
    """NcclCommunicator raises this on every rank (each computes it from the same list)."""
    from zero1_mpi.comm.nccl import shared_gpu_error
    assert shared_gpu_error([("a", "0000:01:00.0"), ("a", "0000:02:00.0"),
                             ("b", "0000:01:00.0")]) is None
    error = shared_gpu_error([("a", "0000:01:00.0"), ("a", "0000:02:00.0"),
                              ("a", "0000:01:00.0")])
    assert isinstance(error, RuntimeError)
    for words in ("ranks 0 and 2", "GPU 0000:01:00.0 on a", "Duplicate GPU detected",
                  "zero1_mpi.Communicator"):
        assert words in str(error)


def test_split_keeps_the_explicit_settings():
    """A sub-communicator (hierarchical sharding's groups and replicas) keeps its parent's
    explicit settings, each set here to the opposite of its default; through an optimizer's
    ``shard_comm`` and ``replica_comm`` in tests/cases/hierarchical.py."""
    default = Communicator(MPI.COMM_SELF)
    settings = {"persistent": not default.persistent, "cuda_aware": not default.cuda_aware,
                "device_started": not default.device_started, "stage_host": True}
    parent = Communicator(MPI.COMM_SELF, **settings)
    sub = parent.split(0)
    assert {name: getattr(sub, name) for name in settings} == settings
    for name in ("persistent", "cuda_aware", "device_started"):
        assert getattr(sub, f"{name}_source") == getattr(parent, f"{name}_source") == "argument"
    sub.free()
    parent.free()
    default.free()


def test_node_rank_is_the_place_among_the_nodes_ranks():
    assert Communicator(MPI.COMM_SELF).node_rank() == 0


def test_collective_call_failure_reaches_every_rank():
    """One rank's failing call (others blocked inside theirs), a late failure after the
    others succeeded, and all succeeding; and NCCL's unique id from rank 0 (or its error)."""
    out = run_mpi(3, "collective_call.py", timeout=120).stdout
    assert "OK collective_call on 3 ranks" in out


def test_collective_call_on_one_rank_returns_or_raises_naming_it():
    comm = Communicator(MPI.COMM_SELF)
    assert comm.collective_call(lambda: 5, "the call") == 5
    with pytest.raises(ZeroDivisionError, match=r"the call failed on rank 0 \(this rank\)"):
        comm.collective_call(lambda: 1 / 0, "the call")


def test_staged_and_direct_paths_train_alike():
    """Every rule: the staged path and the direct one give the same parameters (bitwise for
    bf16); on a GPU the same case compares device buffers handed to MPI (tools/gpu_check.sh)."""
    out = run_mpi(3, "transport.py", "numpy", "--elements", "200K", timeout=240).stdout
    assert "OK transport: 4 rules x fp32, bf16 on 3 ranks (numpy; direct path: host" in out


@pytest.mark.parametrize("n, kernel", [(3, "auto"), (4, "numpy")])
def test_communicator_collectives_direct_and_staged(n, kernel):
    """Every collective on every dtype, direct and staged (tests/cases/comm.py): reductions are
    sums in some order, agreement raises everywhere, the optimizer through staging, float16
    sums in MPI; a step in steady state allocates only a few KB (with the Numba kernel where
    it imports, on 3 ranks)."""
    out = run_mpi(n, "comm.py", timeout=120, env={"ZERO1_MPI_KERNEL": kernel}).stdout
    assert f"OK comm on {n} ranks" in out
