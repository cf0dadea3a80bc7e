"""torch.optim as the reference (skipped where torch is not installed; CI installs it).

- ZeroAdam/ZeroAdamW on 3 ranks against torch.optim.Adam/AdamW + clip_grad_norm_ in one
  process on the averaged gradients: param groups, weight decay, clipping and a learning rate
  changed before every step, fp32 and bf16 (tests/cases/torch_parity.py).
- ReferenceSGD, the float64 oracle that holds ZeroSGD on N ranks (tests/cases/parity.py) and
  its kernels (tests/test_rule_kernels.py), is torch.optim.SGD with clip_grad_norm_.
"""

import numpy as np
import pytest

from mpirun import run_mpi
from reference import ReferenceSGD, max_rel_err

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

torch = pytest.importorskip("torch")


def test_zero_adam_on_3_ranks_equals_torch_optim():
    out = run_mpi(3, "torch_parity.py", timeout=300).stdout
    assert "OK torch parity: 4 cases x 25 steps on 3 ranks" in out, out


TORCH_SGD = [  # (defaults, options of group 1, max_grad_norm)
    ({"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
     {"momentum": 0.8, "nesterov": True, "weight_decay": 0.0, "lr": 0.02}, 5.0),
    ({"momentum": 0.0, "weight_decay": 0.05}, {"momentum": 0.9, "dampening": 0.5}, None),
    ({"momentum": 0.7, "nesterov": True, "weight_decay": 0.0},
     {"momentum": 0.0, "weight_decay": 0.1, "lr": 0.2}, 3.0),
]


@pytest.mark.parametrize("defaults, group_1, max_grad_norm", TORCH_SGD)
def test_reference_sgd_is_torch_sgd(defaults, group_1, max_grad_norm):
    """ReferenceSGD (the oracle of tests/cases/parity.py) is torch.optim.SGD with
    clip_grad_norm_, in float64, with two param groups: this ties the multi-rank parity to
    torch."""
    shapes, names_1 = {"w": (5, 13), "b": (7,), "s": ()}, ["b", "s"]
    rng = np.random.default_rng(3)
    init = {k: rng.standard_normal(s) for k, s in shapes.items()}
    ref = ReferenceSGD(init, lr=0.1, **defaults, max_grad_norm=max_grad_norm,
                       groups=[{"names": ["w"]}, {"names": names_1, **group_1}])
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64))
              for k, v in init.items()}
    opt = torch.optim.SGD([{"params": [params["w"]]},
                           {"params": [params[k] for k in names_1], **group_1}],
                          lr=0.1, **defaults)
    clipped = 0
    for step in range(1, 9):
        grads = {k: rng.standard_normal(s) * (3.0 if step % 2 else 0.2)
                 for k, s in shapes.items()}
        norm = ref.step(grads)
        for k, p in params.items():
            p.grad = torch.tensor(grads[k], dtype=torch.float64)
        if max_grad_norm is not None:
            total = float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm))
            assert abs(total - norm) <= 1e-12 * norm
            clipped += norm > max_grad_norm
        opt.step()
        for k, p in params.items():
            assert max_rel_err(ref.params[k], p.detach().numpy()) <= 1e-12, (step, k)
            buf = opt.state[p].get("momentum_buffer")
            if buf is None:
                assert k not in ref.buf, (step, k)
            else:
                assert max_rel_err(ref.buf[k], buf.numpy()) <= 1e-12, (step, k)
    assert max_grad_norm is None or 0 < clipped < 8  # clipping both applied and not
