"""The step watchdog: ends the job when a step's collectives have not completed in time.

MPI has no timeout: a rank whose peer hangs, or whose network link goes down, waits in a
collective for ever. ``Watchdog(timeout, ...)`` runs one daemon thread that wakes every
``timeout / 4`` seconds; the engine arms it while a step waits for collectives and marks the phase
and bucket it waits in with plain attribute writes (no lock, no system call). Armed for
``timeout`` seconds (at most ``timeout / 4`` more), the thread writes one line naming the rank,
the step, the phase and the bucket to stderr, flushes it, and calls MPI Abort; should Abort
not end the process within ``EXIT_GRACE_SECONDS`` (a peer unreachable), ``os._exit`` does.
A wait disarmed within ``timeout`` is never ended. ``close()`` stops the thread;
``Watchdog(None, ...)`` has none and only takes the marks.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import threading
import time
from typing import cast

__all__ = ["Watchdog", "watched", "check_step_timeout", "EXIT_GRACE_SECONDS", "EXIT_STATUS"]

EXIT_GRACE_SECONDS = 5.0  # from MPI Abort to os._exit, should Abort not end the process
EXIT_STATUS = 1
_WRITE_GRACE_SECONDS = 0.2  # after the message, before Abort (comm.agreement.ABORT_GRACE_SECONDS)


def check_step_timeout(value) -> float | None:
    """``value`` as float seconds (None: no watchdog), or a ValueError naming it and the fix."""
    if value is None:
        return None
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and float(value) > 0
    ):
        return float(value)
    raise ValueError(
        f"step_timeout={value!r} must be a positive, finite number of seconds (the "
        "longest a step() may wait for its collectives before the job is ended, "
        "e.g. 600) or None (no "
        "watchdog)"
    )


class Watchdog:
    """Marks where this rank's step is, and with a ``timeout``, a thread that watches them.

    Args:
        timeout: seconds an armed step may take (None: no thread; the marks go unread).
        rank: this rank, for the message.
        abort: called (from the thread) to end the job: MPI Abort.
        write: where the message goes (default: ``sys.stderr``, flushed).
        exit_grace: seconds from Abort to ``exit``; exit: ``os._exit`` (tests replace both).

    The engine's thread writes ``phase`` and ``bucket``; ``arm``/``disarm`` frame a step.
    """

    def __init__(
        self,
        timeout: float | None,
        rank: int = 0,
        abort=None,
        write=None,
        exit_grace: float = EXIT_GRACE_SECONDS,
        exit=os._exit,
    ):
        self.timeout, self.rank = timeout, rank
        self.step, self.phase = 0, ""
        self.bucket: int | None = None
        self.armed = 0  # the token of the armed step, 0 when none is armed
        self._token = 0
        self._abort, self._write = abort, write
        self._exit_grace, self._exit = exit_grace, exit
        self._closed = threading.Event()
        self._thread = None
        if timeout is not None:
            self._thread = threading.Thread(
                target=self._watch, name="zero1_mpi watchdog", daemon=True
            )
            self._thread.start()

    def arm(self, step: int, phase: str) -> bool:
        """Start timing ``step`` (in ``phase``) unless a step is armed; whether this armed it."""
        if self.armed:
            return False
        self.step, self.phase, self.bucket = step, phase, None
        self._token += 1
        self.armed = self._token
        return True

    def disarm(self) -> None:
        self.armed = 0

    def close(self) -> None:
        """Stop the thread (it exits at once); the marks still take writes."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def message(self) -> str:
        where = "" if self.bucket is None else f" of bucket {self.bucket}"
        return (
            f"zero1_mpi: rank {self.rank}: step {self.step} has not finished "
            f"{self.phase!r}{where} within {self.timeout:g} s (step_timeout): ending the "
            "job (a rank stopped taking part, or the network between ranks failed; the "
            "other ranks' lines say where they waited)\n"
        )

    def _watch(self) -> None:
        timeout = cast(float, self.timeout)  # the thread runs only with a timeout
        interval = max(timeout / 4, 0.01)
        seen, since = 0, 0.0
        while not self._closed.wait(interval):
            token = self.armed
            if not token:
                seen = 0
                continue
            now = time.monotonic()
            if token != seen:  # armed since the last look: the clock starts now
                seen, since = token, now
            elif now - since >= timeout and self.armed == token:
                self._fire()
                return

    def _fire(self) -> None:
        """Write why, then end this process: MPI Abort, else ``os._exit`` after a grace."""
        ender = threading.Thread(
            target=_exit_after,
            args=(self._exit_grace, self._exit),
            name="zero1_mpi watchdog exit",
            daemon=True,
        )
        ender.start()
        text = self.message()
        try:
            if self._write is not None:
                self._write(text)
            else:
                sys.stderr.write(text)
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stderr must not stop the ending
            pass
        if self._abort is not None:
            time.sleep(_WRITE_GRACE_SECONDS)  # the launcher forwards the line before Abort
            try:
                self._abort()
            except Exception:  # noqa: BLE001 - os._exit follows
                pass
        self._exit(EXIT_STATUS)


def _exit_after(seconds: float, exit) -> None:
    time.sleep(seconds)
    exit(EXIT_STATUS)


def watched(phase: str, ahead: int):
    """Decorator for a method of an object with ``watchdog`` and ``step_count``: the call is
    armed as step ``step_count + ahead`` in ``phase`` unless a step is armed already (a
    ``wait()`` inside ``step()``), and disarmed when it returns or raises."""

    def decorate(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            watchdog = self.watchdog
            armed = watchdog.arm(self.step_count + ahead, phase)
            try:
                return method(self, *args, **kwargs)
            finally:
                if armed:
                    watchdog.disarm()

        return run

    return decorate
