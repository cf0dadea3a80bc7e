"""Gradient sharding (``shard_gradients=True``, ZeRO stage 2).

The multi-rank case (tests/cases/stage2.py) holds stage 2 to stage 1 bit for bit (an fp32
gradient shard, one micro-batch) and to the float64 reference (accumulation, a 16-bit shard)
for every rule of the registry and dtype, and checks misuse on every rank and checkpoints
across the stages;
tests/cases/memory.py measures what it holds (2Ψ + 14Ψ/N for Adam). The options are checked
here, in one process, before any collective.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import run_mpi
from zero1_mpi import ZeroAdamW, ZeroSGD


@pytest.mark.parametrize("n", [1, 3])
def test_stage2_equals_stage1_and_the_reference_on_n_ranks(n, tmp_path):
    """1 rank (a reduction is a copy there), 3 (uneven shards): every rule, the features,
    misuse, checkpoints across the stages."""
    out = run_mpi(n, "stage2.py", str(tmp_path), timeout=300).stdout
    assert f"OK stage 2 on {n} ranks (numpy): 72 rule/dtype cases, 3 features, " \
           "checkpoints across the stages, misuse" in out, out


def test_stage2_with_hierarchical_sharding(tmp_path):
    """4 ranks in 2 groups of 2: the gradient shard summed across the groups."""
    out = run_mpi(4, "stage2.py", str(tmp_path), "hierarchical", timeout=300).stdout
    assert "OK stage 2 on 4 ranks (numpy): shard_group_size=2" in out, out


def params():
    return {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}


@pytest.mark.parametrize("options, text", [
    ({"shard_gradients": 1}, "shard_gradients=1 must be True"),
    ({"grad_shard_dtype": "float32"}, "sets the gradient shard of shard_gradients=True"),
    ({"shard_gradients": True, "grad_shard_dtype": "float16"}, "is not supported"),
    ({"shard_gradients": True, "grad_staging": 0}, "grad_staging=0 must be an integer >= 1"),
])
def test_bad_options_are_refused(options, text):
    with pytest.raises(ValueError, match=text):
        ZeroAdamW(params(), MPI.COMM_SELF, **options)


def test_add_grad_without_shard_gradients_says_what_to_do_instead():
    opt = ZeroSGD(params(), MPI.COMM_SELF, lr=0.1)
    with pytest.raises(ValueError, match=r"write them into opt.grads\[name\]"):
        opt.add_grad("w", np.ones((4, 3), np.float32))


def test_the_gradient_is_handed_over_and_the_step_takes_it():
    opt = ZeroSGD(params(), MPI.COMM_SELF, lr=0.5, shard_gradients=True,
                  param_dtype="bfloat16", grad_shard_dtype="float32")
    assert len(opt.grads) == 0 and opt.grad_shard_dtype == np.float32
    opt.add_grads({"b": np.full(3, 2.0, np.float32), "w": np.ones((4, 3), np.float32)})
    info = opt.step()
    assert info.step == 1 and info.grad_norm == pytest.approx(np.sqrt(12 + 3 * 4))
    assert np.array_equal(np.asarray(opt.params["b"], np.float32), np.full(3, -1.0))
    assert np.array_equal(np.asarray(opt.params["w"], np.float32), np.full((4, 3), 0.5))
    report = opt.memory_report()
    assert report.grad_shard_dtype == "float32" and report.gradients == 4 * 15
    # an fp32 shard (4) + SGD without momentum: a remainder master (2)
    assert report.formula_label == "2Ψ+6Ψ/N"


def test_zero_grad_after_a_hand_over_on_one_rank():
    """On one rank a bucket's reduction has no request to wait for: ``zero_grad()`` after its
    hand-over forgets it (it raised AttributeError before; found by mypy)."""
    opt = ZeroSGD(params(), MPI.COMM_SELF, lr=0.5, shard_gradients=True)
    opt.add_grads({"b": np.full(3, 2.0, np.float32), "w": np.ones((4, 3), np.float32)})
    opt.zero_grad()
    assert opt.step().grad_norm == 0.0
    assert np.array_equal(opt.params["w"], params()["w"])


def test_an_empty_tensor_belongs_to_no_bucket():
    """A (0, 3) tensor between two others, handed over before the first: its hand-over must
    not count towards a bucket, or the bucket would be reduced before its last tensor."""
    shapes = {"scalar": (), "empty": (0, 3), "vec": (7,)}
    opt = ZeroSGD({k: np.zeros(s, np.float32) for k, s in shapes.items()}, MPI.COMM_SELF,
                  lr=1.0, shard_gradients=True, bucket_elements=64)
    for name in ("vec", "empty", "scalar"):
        opt.add_grad(name, np.ones(shapes[name], np.float32))
    opt.step()
    assert np.asarray(opt.params["scalar"]) == -1 and (np.asarray(opt.params["vec"]) == -1).all()
