"""What an optimizer keeps on disk: sharded checkpoints (blocking or written in the background),
exports, and the checkpoint a signal asks for (preemption).

``Persistence`` reads and writes the sharded state (``state.ShardedState``) and the step's
``Counters``, never the optimizer: ``save``/``load`` (``checkpoint``), ``save_consolidated``/
``load_consolidated`` (``export``), ``checkpoint_on_signal`` (``preemption``). It also takes
part in each step: ``poll()`` gives this rank's part of the step's agreement (a signal pending,
a save still being written), ``agreed`` publishes a non-blocking save once every rank's file is
written, ``stop_if_asked`` saves the checkpoint a signal asked for. ``close()`` finishes a save
in flight and restores the signal handlers. All methods must be called on all ranks.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import cast

import numpy as np

from ..step.records import Agreement, Counters, StepInfo
from . import checkpoint, preemption
from . import consolidated as export

__all__ = ["Persistence"]


class Persistence:
    """The saves, loads and signal checkpoints of ``state`` and ``counters`` over ``comm``
    (the state's gathers in flight completed before it is read); ``watch`` (the step's
    ``Watchdog``) is disarmed while a step saves: file time is not a hang."""

    def __init__(self, comm, state, counters: Counters, watch):
        self._comm, self._state, self._counters = comm, state, counters
        self._watch = watch
        self._pending: checkpoint.PendingSave | None = None
        self._snapshot: np.ndarray | None = None  # the host copy non-blocking saves write from
        self._on_signal: preemption.SignalCheckpoint | None = None
        self._asked = 0  # the signals this rank had received at the last poll
        #: Tensor names of an earlier release that a checkpoint may hold instead of today's
        #: (theirs -> today's): 0.1.0's nnx names, given by the JAX binding; loads take them
        #: with a DeprecationWarning.
        self.old_names: dict[str, str] = {}

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the host copy that non-blocking saves write from (0 before the first)."""
        return 0 if self._snapshot is None else self._snapshot.nbytes

    # -- checkpoints and exports ---------------------------------------------------------------

    def save(self, path, keep: int | None = None, blocking: bool = True):
        """``ShardedOptimizer.save``."""
        if blocking not in (True, False):
            raise ValueError(f"blocking={blocking!r} must be True or False")
        self._state.wait()
        self.finish_save()  # raises the error of one that failed, also when a step finished it
        if blocking:
            return checkpoint.save(self._comm, self._state, self._counters, path, keep)
        shape = checkpoint.snapshot_shape(self._state)
        if shape is not None and (self._snapshot is None or self._snapshot.shape != shape):
            self._snapshot = np.empty(shape, np.float32)
        self._pending = checkpoint.start_save(
            self._comm, self._state, self._counters, path, keep, self._snapshot
        )
        return self._pending

    def finish_save(self):
        """``ShardedOptimizer.finish_save``."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait()

    def load(self, path):
        """``ShardedOptimizer.load``."""
        self._state.wait()
        if self._pending is not None and not self._pending.done:
            self.finish_save()  # (one a step finished and that failed: the next save raises)
        return checkpoint.load(self._comm, self._state, self._counters, path, self.old_names)

    def save_consolidated(self, path):
        """``ShardedOptimizer.save_consolidated``."""
        self._state.wait()
        return export.save_consolidated(self._comm, self._state, self._counters, path)

    def load_consolidated(self, path):
        """``ShardedOptimizer.load_consolidated``."""
        self._state.wait()
        return export.load_consolidated(
            self._comm, self._state, self._counters, path, self.old_names
        )

    def checkpoint_on_signal(
        self, path, signals=(signal.SIGTERM,), keep: int | None = None
    ) -> preemption.SignalCheckpoint:
        """``ShardedOptimizer.checkpoint_on_signal``."""
        error = None
        try:
            if self._on_signal is not None and self._on_signal.active:
                raise ValueError(
                    f"checkpoint_on_signal() is already active "
                    f"({self._on_signal!r}): close() it first"
                )
            path, signals = preemption.check_arguments(path, signals, keep)
        except ValueError as exc:
            error = exc
        self._comm.agree(error)
        self._comm.check_same(
            {"path": path, "signals": [s.name for s in signals], "keep": keep},
            "checkpoint_on_signal's",
            "pass the same arguments on every rank",
        )
        self._on_signal = preemption.SignalCheckpoint(path, signals, keep)
        return self._on_signal

    # -- in each step ----------------------------------------------------------------------------

    def poll(self) -> Agreement:
        """This rank's part of the step's agreement: a signal pending, a file being written."""
        self._asked = self._on_signal.poll() if self._on_signal is not None else 0
        pending = self._pending
        writing = pending is not None and not pending.done and not pending.written
        return Agreement(signals=float(bool(self._asked)), writing=float(writing))

    def agreed(self, agreed: Agreement) -> None:
        """Publish the non-blocking save in flight once every rank's file is on disk; a
        failure is the handle's (and the next save's). All ranks, after the agreement."""
        pending = self._pending
        if pending is not None and not pending.done and not agreed.writing:
            self._watch.disarm()  # publishing is file work (rank 0's syncs), not a hang
            pending.finish()

    def stop_if_asked(self, info: StepInfo, agreed: Agreement) -> StepInfo:
        """``info``, or once a signal reached any rank: ``stop=True`` and the checkpoint saved
        (none with ``path=None``: the caller saves)."""
        if not agreed.signals:
            return info
        self._watch.disarm()  # a save takes as long as the file system does: not a hang
        pending = self._pending
        if pending is not None and pending.error is not None:  # printed when it failed: it
            self._pending = None  # must not stop this checkpoint, the job is about to end
        on_signal = cast(preemption.SignalCheckpoint, self._on_signal)  # what polls signals
        where = None if on_signal.path is None else self.save(on_signal.path, on_signal.keep)
        on_signal.answered(self._asked)
        return replace(info, stop=True, checkpoint=where)

    def close(self) -> None:
        """Finish a save in flight (published, or its failure printed and left in its handle),
        put back the signal handlers, drop the host copy. Idempotent; all ranks."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()
        if self._on_signal is not None:
            self._on_signal.close()
        self._snapshot = None
