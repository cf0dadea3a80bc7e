"""The engine options are declared once (``zero1_mpi.config.options.OPTIONS``): every optimizer's
signature, its ``help()`` text, the list in docs/api.md and the values the ranks compare come
from that declaration; the checked values are the optimizer's attributes; ``repr(opt)`` says
the rule, the param groups' options, N, the shard groups, the stage, the dtypes and offload."""

import inspect
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from zero1_mpi import Communicator, ShardedOptimizer, ZeroAdamW, ZeroSGD
from zero1_mpi.config import generated, options
from zero1_mpi.rules.registry import builtin_rules

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi_independent  # (conftest.py)
CLASSES = [ShardedOptimizer] + [e.optimizer for e in builtin_rules().values()] + [ZeroAdamW]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_signatures_and_help_come_from_the_declaration(cls):
    keyword_only = [p for p in inspect.signature(cls).parameters.values()
                    if p.kind is p.KEYWORD_ONLY and p.name in options._BY_NAME]
    assert keyword_only == generated.signature_parameters()
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    assert generated.docstring_section() in cls.__doc__
    for option in options.OPTIONS:
        assert f"{option.name}:" in cls.__doc__
    section = generated.docstring_section().splitlines()[1:]  # each option a hanging paragraph
    assert max(map(len, section)) <= 92  # the project's 96 columns, less the class's indent
    assert all(line.startswith(" " * 8) and not line.startswith(" " * 9) or
               line.startswith(" " * 12) and not line.startswith(" " * 13) for line in section)


def test_the_api_page_lists_the_declared_options():
    done = subprocess.run([sys.executable, "tools/docs_options.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    page = (ROOT / "docs" / "api.md").read_text()
    for option in options.OPTIONS:
        assert f"- `{option.name}` (`{option.type}`, default `{option.default!r}`)" in page


def test_checked_options_are_attributes_and_are_compared_across_ranks():
    opt = ZeroAdamW({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, param_dtype="bfloat16",
                    max_grad_norm=2, bucket_elements=64, shard_gradients=True)
    assert (opt.param_dtype.name, opt.max_grad_norm, opt.grad_shard_dtype.name) == \
        ("bfloat16", 2.0, "bfloat16")
    assert opt.shard_group_size == 1 and opt.offload_threads is None
    assert set(opt.options.agreed()) == {o.name for o in options.OPTIONS if not o.local}
    assert {o.name for o in options.OPTIONS if o.local} == {"offload_threads"}
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        opt.nonsense  # noqa: B018


def test_an_unknown_option_names_itself_and_the_closest():
    with pytest.raises(TypeError, match="'bucket_elemnts': did you mean 'bucket_elements'"):
        ZeroSGD({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, bucket_elemnts=64)


def test_repr_says_rule_groups_world_stage_dtypes_and_offload():
    groups = [{"params": {"w": np.ones((2, 3), np.float32)}},
              {"params": {"b": np.ones(3, np.float32)}, "weight_decay": 0.0}]
    opt = ZeroAdamW(groups, MPI.COMM_SELF, lr=0.01, param_dtype="bfloat16",
                    offload="cpu", offload_threads=1, offload_fraction=0.25)
    text = repr(opt)
    for words in ("ZeroAdamW (rule 'adam', decoupled_weight_decay=True", "N=1",
                  "shard_group_size=1", "stage 1", "param_dtype=bfloat16",
                  "reduce_dtype=float32", "offload='cpu', offload_fraction=0.25",
                  "Parameter Group 0 (1 tensors)",
                  "    lr: 0.01", "Parameter Group 1 (1 tensors)", "    weight_decay: 0.0"):
        assert words in text, (words, text)
    staged = ZeroSGD({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, shard_gradients=True,
                     grad_shard_dtype="float32", param_dtype="float16")
    assert "stage 2" in repr(staged) and "grad_shard_dtype=float32" in repr(staged)
    whole = ZeroSGD({"w": np.ones(3, np.float32)}, MPI.COMM_SELF, offload="cpu")
    assert "offload='cpu')" in repr(whole), repr(whole)  # a share of 1 goes unsaid
    opt.close()
    assert repr(opt).endswith("(closed)")


@pytest.mark.parametrize("share, want", [(np.float32(0.5), 0.5), (Fraction(1, 4), 0.25),
                                         (-0.0, 0.0), (1, 1.0)])
def test_offload_fraction_takes_any_real_number_from_0_to_1(share, want):
    opt = ZeroAdamW({"w": np.ones(8, np.float32)}, MPI.COMM_SELF, offload="cpu",
                    offload_threads=1, offload_fraction=share)
    got = opt.options.offload_fraction
    assert type(got) is float and got == want and str(got) == str(want)
    opt.close()


def test_what_the_checks_resolve_and_refuse_beside_the_declarations():
    """What tools/mutate.py found no test of: ``cuda_aware`` refused beside a Communicator
    (and its default taken), ``masters='auto'`` resolved to fp32 where offload keeps every
    master on the host, and ``EngineOptions``' repr."""
    comm = Communicator(MPI.COMM_SELF)
    params = {"w": np.ones(3, np.float32)}
    ZeroAdamW(params, comm).close()
    with pytest.raises(ValueError, match="cuda_aware= applies to a communicator this "):
        ZeroAdamW(params, comm, cuda_aware=True)
    offloaded = ZeroAdamW(params, MPI.COMM_SELF, param_dtype="bfloat16", offload="cpu")
    assert offloaded.options.masters == "fp32"
    assert repr(offloaded.options).startswith("EngineOptions(param_dtype=dtype(bfloat16)")
    offloaded.close()
