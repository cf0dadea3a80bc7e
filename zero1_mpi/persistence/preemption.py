"""A checkpoint when the scheduler warns: a signal on any rank stops training at a step boundary.

``opt.checkpoint_on_signal(path, signals=(SIGTERM,), keep=None)`` (all ranks, main thread) gives
a ``SignalCheckpoint``: handlers for ``signals`` that only count what arrives. Each ``step()``
adds this rank's "a signal is pending" to the sum its one ``Allreduce`` already does; the first
step after a signal on any rank completes (or is skipped on overflow), every rank saves
``opt.save(path, keep)`` and the ``StepInfo`` has ``stop=True`` and ``checkpoint`` (the new
directory). ``path=None`` saves nothing: the caller saves, with what it keeps beside (an LR
scheduler, a Trainer's state). A later signal counts at the next step; a step that raises leaves
it pending. ``close()`` restores the previous handlers. Bad arguments raise on every rank.
"""

from __future__ import annotations

import os
import signal
import threading

from .checkpoint import check_keep

__all__ = ["SignalCheckpoint", "check_arguments", "check_signals"]

#: Signals a process cannot catch, or that Python would not deliver to its handler.
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def check_signals(signals) -> tuple[signal.Signals, ...]:
    """``signals`` (a signal, its number or name such as ``"SIGUSR1"``, or an iterable of
    them) as ``signal.Signals``, or a ValueError naming the bad value and the fix."""
    if isinstance(signals, (str, int, signal.Signals)):
        signals = (signals,)
    try:
        items = list(signals)
    except TypeError:
        raise ValueError(
            f"signals={signals!r}: pass a signal or a tuple of them, e.g. "
            "(signal.SIGTERM,) or ('SIGUSR1',)"
        ) from None
    if not items:
        raise ValueError("signals=(): pass at least one signal, e.g. (signal.SIGTERM,)")
    found = []
    for item in items:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            elif isinstance(item, int) and not isinstance(item, bool):
                sig = signal.Signals(item)
            else:
                raise KeyError(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"signals: {item!r} is not a signal of this system: pass one of "
                "signal.SIGTERM, signal.SIGUSR1, ... (or its name)"
            ) from None
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"signals: {sig.name} cannot be caught by any process: use the "
                f"signal the scheduler sends first (Slurm: SIGTERM, or the one "
                "given with --signal, e.g. USR1)"
            )
        if sig not in found:
            found.append(sig)
    return tuple(found)


def check_arguments(path, signals, keep) -> tuple[str | None, tuple[signal.Signals, ...]]:
    """``(path, signals)`` checked for ``checkpoint_on_signal``, or a ValueError naming the
    value and the fix (this rank's; the caller agrees on it with the other ranks)."""
    check_keep(keep)
    if path is None and keep is not None:
        raise ValueError(
            f"keep={keep!r} with path=None: the step saves nothing, so there is nothing to "
            "keep; pass keep to your own opt.save(path, keep) instead"
        )
    try:
        path = None if path is None else os.fspath(path)
    except TypeError:
        raise ValueError(
            f"path={path!r}: pass the checkpoint directory as a str or a "
            "pathlib.Path (the one given to opt.save and opt.load), or None to save "
            "yourself when step() returns stop=True"
        ) from None
    signals = check_signals(signals)
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            f"checkpoint_on_signal() was called from thread "
            f"{threading.current_thread().name!r}: call it from the main thread "
            "(Python runs signal handlers there only), before the loop starts"
        )
    return path, signals


class SignalCheckpoint:
    """The handlers ``checkpoint_on_signal`` installed, and the checkpoint they ask for.

    ``path`` and ``keep``: where and how ``step()`` saves (None: it does not, the caller
    does); ``signals``: the signals handled;
    ``received``: the signals this rank got, in order; ``active``: whether the handlers are
    still installed. A context manager: leaving the block calls ``close()``.
    """

    def __init__(self, path, signals, keep):
        self.path, self.signals, self.keep = path, signals, keep
        self.received: list[signal.Signals] = []
        self._taken = 0  # how many of ``received`` a checkpoint has answered
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def active(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum, frame) -> None:  # frame unused: the signal module's signature
        self.received.append(signal.Signals(signum))  # only this: step() does the rest

    def poll(self) -> int:
        """For ``step()``, before its ``Allreduce``: 0 when no signal arrived since the last
        checkpoint, else a count to pass to ``answered`` once that checkpoint is saved."""
        count = len(self.received)  # one read: a signal arriving after it counts next time
        return count if count > self._taken else 0

    def answered(self, count: int) -> None:
        """The checkpoint that ``poll``'s ``count`` signals asked for is saved."""
        self._taken = max(self._taken, count)

    def close(self) -> None:
        """Put back the handlers that were installed before (idempotent; main thread)."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def __enter__(self) -> SignalCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return (
            f"SignalCheckpoint({self.path if self.path is None else os.fspath(self.path)!r}, "
            f"signals=({names}), "
            f"keep={self.keep!r}, active={self.active}, received={len(self.received)})"
        )
