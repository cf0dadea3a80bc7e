"""Bad input raises the same clear error on every rank, never hangs, and changes nothing.

Run on any number of ranks. Some cases are bad on one rank only (the last one): the others must
raise too. After every failed construction a valid optimizer must still work, which shows that
no collective was left half-done.
"""

import os

import numpy as np
from mpi4py import MPI

from zero1_mpi import CollectiveError, ZeroAdam, ZeroAdamW

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
last = size - 1


def good():
    return {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}


def on_last(bad, ok):
    return bad if rank == last else ok


def with_nonfinite():
    params = good()
    params["w"][1, 2] = np.nan
    return params


CASES = [
    # (description, callable, exception type, words the message must hold)
    ("params is a list", lambda: ZeroAdam([np.ones(3)]), TypeError, ["mapping"]),
    ("params is empty", lambda: ZeroAdam({}), ValueError, ["empty"]),
    ("a value is a list", lambda: ZeroAdam({"w": [1.0, 2.0]}), TypeError, ["params['w']"]),
    ("integer parameters", lambda: ZeroAdam({"w": np.ones(3, np.int32)}), TypeError,
     ["params['w']", "int32"]),
    ("name is not a str", lambda: ZeroAdam({1: np.ones(3, np.float32)}), TypeError, ["1"]),
    ("non-finite on the last rank", lambda: ZeroAdam(on_last(with_nonfinite(), good())),
     ValueError, ["params['w']", "non-finite", f"rank {last}"]),
    ("mixed dtypes, no param_dtype",
     lambda: ZeroAdam({"a": np.ones(2, np.float32), "b": np.ones(2, np.float16)}), ValueError,
     ["float16", "float32", "param_dtype"]),
    ("float64 without param_dtype", lambda: ZeroAdam({"a": np.ones(2)}), ValueError,
     ["float64", "param_dtype"]),
    ("unknown param_dtype", lambda: ZeroAdam(good(), param_dtype="int8"), ValueError,
     ["param_dtype='int8'", "bfloat16"]),
    ("negative lr", lambda: ZeroAdam(good(), lr=-1.0), ValueError, ["lr=-1.0"]),
    ("beta out of range", lambda: ZeroAdam(good(), betas=(0.9, 1.0)), ValueError,
     ["betas[1]=1.0"]),
    ("betas not a pair", lambda: ZeroAdam(good(), betas=0.9), ValueError, ["betas=0.9"]),
    ("nan eps", lambda: ZeroAdam(good(), eps=float("nan")), ValueError, ["eps=nan"]),
    ("reduce_dtype bfloat16", lambda: ZeroAdam(good(), param_dtype="bfloat16",
                                               reduce_dtype="bfloat16"), ValueError,
     ["reduce_dtype='bfloat16'", "float32"]),
    ("reduce_dtype float16 for bf16", lambda: ZeroAdam(good(), param_dtype="bfloat16",
                                                       reduce_dtype="float16"), ValueError,
     ["reduce_dtype='float16'", "bfloat16"]),
    ("comm is a string", lambda: ZeroAdam(good(), comm="world"), TypeError,
     ["comm='world'", "MPI.COMM_WORLD"]),
    ("comm is COMM_NULL", lambda: ZeroAdam(good(), comm=MPI.COMM_NULL), ValueError,
     ["COMM_NULL"]),
    ("different shape on the last rank",
     lambda: ZeroAdam(on_last({"w": np.ones((4, 3), np.float32), "b": np.zeros(4, np.float32)},
                              good())), CollectiveError if size > 1 else None,
     ["(4, 3)", "(3, 4)", "same names, shapes and dtypes"]),
    ("different names on the last rank",
     lambda: ZeroAdam(on_last({"w": np.ones((3, 4), np.float32), "c": np.zeros(4, np.float32)},
                              good())), CollectiveError if size > 1 else None, ["'c'", "'b'"]),
    ("extra tensor on the last rank",
     lambda: ZeroAdam(on_last({**good(), "x": np.ones(2, np.float32)}, good())),
     CollectiveError if size > 1 else None, ["2 tensors", "3 tensors"]),
    ("different param_dtype on the last rank",
     lambda: ZeroAdam(good(), param_dtype=on_last("float16", "float32")),
     CollectiveError if size > 1 else None, ["param_dtype"]),
    ("different lr on the last rank", lambda: ZeroAdamW(good(), lr=on_last(0.1, 0.2)),
     CollectiveError if size > 1 else None, ["param group options", "0.2", f"rank {last}"]),
    ("different bucket_elements on the last rank",
     lambda: ZeroAdam(good(), bucket_elements=on_last(1000, 2000)),
     CollectiveError if size > 1 else None, ["bucket_elements (2000 on rank 0, 1000", "same"]),
    ("unknown option type on one rank", lambda: ZeroAdam(good(), lr=on_last(10 ** 400, 0.1)),
     OverflowError, ["int too large"]),
    ("decoupled_weight_decay is a string",
     lambda: ZeroAdam(good(), decoupled_weight_decay="false"), TypeError,
     ["decoupled_weight_decay='false'", "True or False"]),
    ("a value beyond float16", lambda: ZeroAdam({"w": np.full(3, 1e5, np.float32)},
                                               param_dtype="float16"), ValueError,
     ["params['w']", "100000", "65504", "param_dtype"]),
    ("a value beyond float32", lambda: ZeroAdam({"w": np.full(3, 1e39)}, param_dtype="float32"),
     ValueError, ["float32"]),
    ("comm is an MPI.Group", lambda: ZeroAdam(good(), comm=MPI.COMM_WORLD.group),
     TypeError, ["intracommunicator"]),
    ("unknown offload", lambda: ZeroAdam(good(), offload="gpu"), ValueError,
     ["offload='gpu'", "'cpu'"]),
    ("offload on the last rank only", lambda: ZeroAdam(good(), offload=on_last("cpu", None)),
     CollectiveError if size > 1 else None, ["offload (None on rank 0, 'cpu' on rank", "same"]),
    ("offload_threads of 0", lambda: ZeroAdam(good(), offload="cpu", offload_threads=0),
     ValueError, ["offload_threads=0", ">= 1"]),
    ("offload_threads without offload", lambda: ZeroAdam(good(), offload_threads=2), ValueError,
     ["offload_threads=2", "offload='cpu'"]),
]


def expect(description, build, exc_type, words):
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - the type is checked right below
        if exc_type is None or not isinstance(exc, exc_type):
            raise AssertionError(f"{description}: unexpected {type(exc).__name__}: {exc}")
        missing = [w for w in words if w not in str(exc)]
        if missing:
            raise AssertionError(f"{description}: message {str(exc)!r} lacks {missing}")
    else:
        if exc_type is not None:
            raise AssertionError(f"{description}: no error raised on rank {rank}")
    # Nothing is left half-done: a good optimizer still steps and agrees on every rank.
    opt = ZeroAdam(good(), lr=0.5)
    opt.grads["w"][...] = 1.0
    opt.step()
    total = float(opt.params["w"].sum())
    if not np.allclose(opt.params["w"], 0.5) or comm.allreduce(total, op=MPI.MAX) != total:
        raise AssertionError(f"{description}: optimizer broken afterwards")


def main():
    for description, build, exc_type, words in CASES:
        expect(description, build, exc_type, words)

    # The caller's arrays are never written, also when construction fails.
    mine = good()
    before = {k: v.copy() for k, v in mine.items()}
    opt = ZeroAdam(mine)
    opt.grads["w"][...] = 1.0
    opt.step()
    if any(not np.array_equal(mine[k], before[k]) for k in mine):
        raise AssertionError("the optimizer wrote into the caller's arrays")

    # Views cannot be replaced (they would silently stop being views).
    for mapping in (opt.params, opt.grads):
        try:
            mapping["w"] = np.zeros((3, 4), np.float32)
        except TypeError:
            pass
        else:
            raise AssertionError("opt.params / opt.grads accepted a new array")

    # A misspelt CUDA-awareness setting is an error that names the variable.
    def with_bad_setting_on_last_rank():
        if rank == last:
            os.environ["ZERO1_MPI_CUDA_AWARE"] = "maybe"
        try:
            ZeroAdam(good())
        finally:
            os.environ.pop("ZERO1_MPI_CUDA_AWARE", None)

    expect("bad ZERO1_MPI_CUDA_AWARE on one rank", with_bad_setting_on_last_rank, ValueError,
           ["ZERO1_MPI_CUDA_AWARE='maybe'", f"rank {last}"])
    expect("bad cuda_aware argument on one rank",
           lambda: ZeroAdam(good(), cuda_aware=on_last("yes", None)), TypeError,
           ["cuda_aware='yes'"])

    # Persistent collectives: a misspelt setting, and ranks that would choose differently
    # (a persistent collective matches only persistent ones: it would hang or go wrong).
    def with_persistent_setting(value):
        def build():
            os.environ["ZERO1_MPI_PERSISTENT"] = value
            try:
                ZeroAdam(good())
            finally:
                os.environ.pop("ZERO1_MPI_PERSISTENT", None)
        return build

    expect("bad ZERO1_MPI_PERSISTENT on one rank", with_persistent_setting(on_last("sure", "1")),
           ValueError, ["ZERO1_MPI_PERSISTENT='sure'", f"rank {last}"])
    cases = len(CASES) + 5
    if size > 1:
        expect("ZERO1_MPI_PERSISTENT differs between ranks",
               with_persistent_setting(on_last("0", "1")), CollectiveError,
               ["persistent", "ZERO1_MPI_PERSISTENT", f"rank {last}"])
        cases += 1

    if rank == 0:
        print(f"OK bad input: {cases} cases on {size} ranks")


if __name__ == "__main__":
    main()
