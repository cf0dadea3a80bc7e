"""Named views of the flat buffers: what the model reads and writes as ``opt.params`` and
``opt.grads``.

``Views(layout, flat)`` is a read-only mapping name -> a view of ``flat`` in the tensor's shape
(never a copy: writing into it writes the buffer), calling ``before_read`` before each lookup
(to complete the all-gathers in flight). ``NoFullGradients`` stands for ``grads`` where no rank
holds the full gradient (stage 2), ``Closed`` for both after ``close()``: their lookups raise,
naming what to do instead.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["Views", "NoFullGradients", "Closed", "closed_error"]


class Views(Mapping):
    """The tensors of ``layout`` as views of ``flat``; ``before_read`` runs before each lookup."""

    def __init__(self, layout, flat, before_read=None):
        self._views = {
            t.name: flat[t.offset : t.offset + t.numel].reshape(t.shape) for t in layout.tensors
        }
        self._before_read = before_read

    def __getitem__(self, name):
        if self._before_read is not None:
            self._before_read()
        return self._views[name]

    def __iter__(self):
        return iter(self._views)

    def __len__(self):
        return len(self._views)


class NoFullGradients(Mapping):
    """``grads`` with ``shard_gradients``: no rank holds the full gradient to view."""

    def __getitem__(self, name):
        raise KeyError(
            f"opt.grads[{name!r}]: with shard_gradients=True no rank holds the full "
            "gradient: hand it over with opt.add_grad(name, grad)"
        )

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


def closed_error(owner: str, what: str) -> RuntimeError:
    """What using ``owner.what`` raises once the optimizer is closed."""
    return RuntimeError(
        f"{owner}.{what}: this optimizer was closed (close(), or the end of its "
        "with-block), which released its buffers and communicators: build a "
        "new optimizer (a checkpoint saved before close() loads into it)"
    )


class Closed(Mapping):
    """``params`` and ``grads`` of a closed optimizer: any lookup raises ``closed_error``."""

    def __init__(self, owner: str):
        self._owner = owner

    def __getitem__(self, name):
        raise closed_error(self._owner, f"params/grads[{name!r}]")

    def __iter__(self):
        raise closed_error(self._owner, "params/grads")

    def __len__(self):
        raise closed_error(self._owner, "params/grads")
