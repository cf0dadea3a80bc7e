"""Property-based tests over the edges (Hypothesis), on N ranks.

    mpiexec -n N python -m mpi4py tests/cases/properties.py [--examples K]

Hypothesis draws a model and a configuration: 1-5 tensors whose sizes sit at, one below and
one above the code's threshold constants (``EDGES``: a bucket's quantum of 64 elements a shard,
the 8-bit blocks of 256, the 8-bit state's 4096, the CPU kernels' chunks of 65,536 a shard),
empty and 0-d tensors; a bucket size around the quantum; every rule of the registry (each
variant) with its option sets; fp32, fp16 or bf16 parameters; one shard group of all N ranks
or groups of 2; the state kept in fp32, bf16 or 8 bits; fp32 or 8-bit sums. For each drawn
case, after 3 steps:

- **reference**: with fp32 state and sums, the parameters are within the project's bound of
  the rule's float64 reference on the averaged gradients (``casekit.oracle``);
- **masters**: with bf16 parameters, the 2-byte remainder masters give the same bits as fp32
  masters (parameters and state), whatever the state, sums and shapes;
- **stage 2**: ``shard_gradients=True`` with an fp32 gradient shard and one micro-batch gives
  stage 1's bits;
- **offload**: half of the shard offloaded (``offload_fraction=0.5``) gives the bits of none.

Every rank draws the same cases (``derandomize``, no database), and each case's outcome is
agreed (a failure on one rank fails it on all), so that Hypothesis shrinks alike everywhere and
the failing case it prints is the smallest. ``--examples`` (default 12; the tool
``tools/properties.py`` runs more) bounds the cases.
"""

import argparse

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import casekit as kit
from casekit import rank, size, world
from zero1_mpi.kernels.backend import resolve_dtype, to_numpy

parser = argparse.ArgumentParser()
parser.add_argument("--examples", type=int, default=12)
ARGS = parser.parse_args()

QUANTUM = 64
#: Elements a shard around which the code changes course (with K ranks a shard, K times as
#: many a tensor or a bucket): the quantum, the 8-bit blocks, the 8-bit state's smallest
#: tensor, the CPU kernels' chunk.
EDGES = (QUANTUM, 256, 4096, 65536)
STEPS = 3
RULES = [(entry.name, variant, options) for entry in kit.registry().values()
         for variant, options in kit.rule_cases(entry)]
counts = {"cases": 0, "reference": 0, "masters": 0, "stage 2": 0, "offload": 0}


@st.composite
def cases(draw):
    group = draw(st.sampled_from([None] + ([2] if size % 2 == 0 and size > 2 else [])))
    k = size if group is None else group
    edge = draw(st.sampled_from(EDGES))  # one tensor (or its shard) at an edge, the rest small
    at_edge = draw(st.sampled_from([max(0, edge * m + d) for m in (1, k) for d in (-1, 0, 1)]))
    sizes = draw(st.permutations([at_edge] + draw(st.lists(st.integers(0, 300), max_size=3))))
    shapes = {f"t{i}": (n,) if i % 2 == 0 or n < 4 else (2, n // 2)
              for i, n in enumerate(sizes)}
    if draw(st.booleans()):
        shapes["scalar"] = ()
    name, variant, options = draw(st.sampled_from(RULES))
    return {
        "shapes": shapes, "rule": (name, variant, options), "group": group,
        "dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        "bucket": draw(st.sampled_from([1, QUANTUM * k - 1, QUANTUM * k, QUANTUM * k + 1,
                                        4096 * k, 65536 * k + 1])),
        "state": draw(st.sampled_from(["float32", "bfloat16", "int8"])),
        "reduce": draw(st.sampled_from(["float32", "int8"])),
    }


def run(case, **engine):
    """The drawn case's optimizer after ``STEPS`` steps: its parameters and state (NumPy)."""
    name, variant, options = case["rule"]
    init = kit.init_values(case["shapes"])
    opt = kit.build(variant, init, world, options, param_dtype=case["dtype"],
                    bucket_elements=case["bucket"], shard_group_size=case["group"],
                    max_grad_norm=5.0, **engine)
    kit.train(opt, range(1, STEPS + 1), case["shapes"])
    result = {k: to_numpy(v).copy() for k, v in opt.params.items()}
    result.update({f"state {k}": v for k, v in kit.state_rows(opt).items()})
    opt.close()
    return result


def same(a, b, what):
    for key in a:
        kit.check(kit.same_bits(a[key], b[key]), f"{what}: {key} differs")


def check_case(case):
    fp32_wire = case["state"] == "float32" and case["reduce"] == "float32"
    plain = {"state_dtype": case["state"], "reduce_dtype": case["reduce"]}
    base = run(case, masters="fp32", **plain)
    if fp32_wire:
        name, variant, options = case["rule"]
        ref = kit.oracle(variant, options, kit.init_values(case["shapes"]), max_grad_norm=5.0)
        for step in range(1, STEPS + 1):
            ref.step(kit.mean_grads(step, case["shapes"], dtype=resolve_dtype(case["dtype"])))
        kit.close_to({k: base[k] for k in case["shapes"]}, ref.params, case["dtype"],
                     f"{name} against its reference")
        counts["reference"] += 1
    if case["dtype"] == "bfloat16":
        same(run(case, masters="remainder", **plain), base, "remainder masters")
        counts["masters"] += 1
    if case["reduce"] == "float32":
        same(run(case, masters="fp32", shard_gradients=True, grad_shard_dtype=(
            None if case["dtype"] == "float32" else "float32"), **plain), base, "stage 2")
        counts["stage 2"] += 1
    same(run(case, offload="cpu", offload_fraction=0.5, **plain), base, "offloaded half")
    counts["offload"] += 1


def described(case) -> str:
    """The case as text the same on every rank (a rule object's repr holds its address)."""
    name, variant, options = case["rule"]
    return repr({**case, "rule": (name, variant.settings(), options)})


@settings(max_examples=ARGS.examples, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
          print_blob=False)
@given(cases())
def test_properties(case):
    drawn = world.allgather(described(case))
    kit.check(len(set(drawn)) == 1, "the ranks drew different cases")
    failure = None
    try:
        check_case(case)
    except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    failures = [f for f in world.allgather(failure) if f]
    counts["cases"] += 1
    if failures:
        raise AssertionError(f"{described(case)}\n" + "\n".join(failures))


if __name__ == "__main__":
    test_properties()
    if rank == 0:
        print(f"OK properties on {size} ranks: {counts['cases']} cases (reference "
              f"{counts['reference']}, masters {counts['masters']}, stage 2 "
              f"{counts['stage 2']}, offload {counts['offload']})", flush=True)
