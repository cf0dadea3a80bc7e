"""The oracle: textbook Adam/AdamW on whole tensors, in float64, one process, no sharding.

Written from the ``torch.optim.Adam`` / ``AdamW`` documentation, independently of
``zero1_mpi.kernels``.
"""

from __future__ import annotations

import numpy as np


class ReferenceAdam:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=False):
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, decoupled
        self.t = 0

    def step(self, grads) -> None:
        self.t += 1
        b1, b2 = self.betas
        for k, p in self.params.items():
            g = np.asarray(grads[k], dtype=np.float64)
            if self.weight_decay and not self.decoupled:
                g = g + self.weight_decay * p
            if self.decoupled:
                p *= 1 - self.lr * self.weight_decay
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat = self.m[k] / (1 - b1 ** self.t)
            v_hat = self.v[k] / (1 - b2 ** self.t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """16-bit floats as integers whose difference counts units in the last place."""
    bits = a.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, 0x8000 - bits, bits)


def max_ulp_diff(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in ulps between two 16-bit arrays of the same dtype."""
    if a.size == 0:
        return 0
    return int(np.abs(ordered_bits(a) - ordered_bits(b)).max())


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Relative error in the max norm: max |a - b| / max |b| over the tensor."""
    if a.size == 0:
        return 0.0
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), np.finfo(np.float64).tiny))
