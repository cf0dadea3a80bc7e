"""A progress line on rank 0 for training loops: step, loss, throughput, ETA.

``Progress(total_steps, rank)`` prints on rank 0 only (``rank``: an int, or a communicator with
``.rank`` or ``Get_rank()``); call ``update(step, loss)`` after each step (``step``: the 0-based
index of the step just done) and ``close()`` at the end, or use it as a context manager. Modes
(argument ``mode``, else ``$ZERO1_PROGRESS``): ``auto`` (default) is a ``tqdm`` bar when tqdm is
installed and the stream is a terminal (under mpiexec it is a pipe), else ``plain``: a line at the
first step, every ``every`` steps and at the last, timed since the previous line, e.g.
``step 120/200 | loss 1.2345 | 150.00 ms/step | 5400 tokens/s | ETA 0:00:12`` (the last line says
``done in H:MM:SS``); ``tqdm`` requires tqdm; ``off`` prints nothing. Stdlib only; no MPI.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
import sys
import time
from datetime import timedelta

__all__ = ["ENV", "MODES", "Progress"]

#: The modes, and the environment variable that chooses one when ``mode`` is not given.
MODES, ENV = ("auto", "plain", "tqdm", "off"), "ZERO1_PROGRESS"


def _rank_of(rank) -> int:
    """``rank`` as an int: itself, or a communicator's ``.rank`` or ``Get_rank()``."""
    value = rank
    if not isinstance(rank, numbers.Integral):
        value = getattr(rank, "rank", None)
        if value is None and callable(getattr(rank, "Get_rank", None)):
            value = rank.Get_rank()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"rank={rank!r} must be a rank >= 0 or a communicator with .rank or "
            f"Get_rank() (zero1_mpi.Communicator, mpi4py's comm): pass comm.rank"
        )
    return int(value)


def _clock_text(seconds: float) -> str:
    """``0:00:12``: whole seconds as H:MM:SS."""
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def _field(name: str, value) -> str:
    return f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"


class Progress:
    """Steps, loss, throughput and ETA of a training loop, printed on rank 0.

    ``total_steps``: the index the loop stops before (``range(start, total_steps)``).
    ``start``: the first step of this run (a resumed run's ``opt.step_count``).
    ``tokens_per_step``: items per step over all ranks (tokens, examples) for the rate, named
    ``unit`` (default ``"tokens"``); None: no rate. ``every``: plain lines every that many
    steps (besides the first and last). ``file``: the stream (default ``sys.stdout``).
    ``clock``: seconds, for tests. Timing runs from construction (create it right before the
    loop) to each ``update``: synchronize the device first where steps run asynchronously.
    """

    def __init__(
        self,
        total_steps: int,
        rank=0,
        *,
        start: int = 0,
        tokens_per_step: float | None = None,
        unit: str = "tokens",
        every: int = 10,
        file=None,
        mode: str | None = None,
        clock=time.perf_counter,
    ):
        for name, value, low in (
            ("total_steps", total_steps, 1),
            ("every", every, 1),
            ("start", start, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"Progress {name}={value!r} must be an integer >= {low}")
        if start > total_steps:
            raise ValueError(
                f"Progress start={start} is past total_steps={total_steps}: nothing is left to run"
            )
        if tokens_per_step is not None and (
            isinstance(tokens_per_step, bool)
            or not isinstance(tokens_per_step, numbers.Real)
            or not tokens_per_step > 0
        ):
            raise ValueError(
                f"Progress tokens_per_step={tokens_per_step!r} must be a number "
                f"> 0 (tokens or examples per step, over all ranks), or None"
            )
        source = "mode" if mode is not None else f"${ENV}"
        chosen = mode if mode is not None else os.environ.get(ENV) or "auto"
        mode = chosen.strip().lower() if isinstance(chosen, str) else chosen
        if mode not in MODES:
            raise ValueError(
                f"Progress {source}={chosen!r} is not a mode; known: {', '.join(MODES)}"
            )
        if mode == "tqdm" and importlib.util.find_spec("tqdm") is None:
            raise ImportError(
                f"Progress {source}='tqdm' but tqdm is not installed: "
                f"pip install tqdm, or choose 'plain'"
            )
        self.total_steps, self.start, self.every = int(total_steps), int(start), int(every)
        self.tokens_per_step, self.unit = tokens_per_step, unit
        self.rank = _rank_of(rank)
        self.file = file if file is not None else sys.stdout
        self._clock, self._last_step, self._bar = clock, self.start - 1, None
        self.mode = "off" if self.rank != 0 else self._choose(mode)
        if self.mode == "off":
            return
        self._began = self._marked = clock()
        self._marked_done, self._rate = self.start, None
        if self.mode == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps,
                initial=self.start,
                file=self.file,
                unit="step",
                dynamic_ncols=True,
            )

    def _choose(self, mode: str) -> str:
        if mode != "auto":
            return mode
        try:
            tty = bool(self.file.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            tty = False
        return "tqdm" if tty and importlib.util.find_spec("tqdm") is not None else "plain"

    def update(self, step: int, loss: float | None = None, **extra) -> str | None:
        """Record that step ``step`` (0-based, after the previous one) is done, with its
        ``loss`` and any ``extra`` fields (``lr=3e-4``: shown as ``lr 0.0003``). Returns the
        plain line printed, else None (other ranks, tqdm, steps between lines)."""
        if (
            isinstance(step, bool)
            or not isinstance(step, numbers.Integral)
            or not self._last_step < step < self.total_steps
        ):
            raise ValueError(
                f"Progress.update(step={step!r}): the step just done, after "
                f"{self._last_step} and below total_steps={self.total_steps}"
            )
        first, self._last_step = self._last_step < self.start, int(step)
        if self.mode == "off":
            return None
        done = step + 1
        last = done == self.total_steps
        due = first or last or done % self.every == 0
        fields = [] if loss is None else [f"loss {float(loss):.4f}"]
        fields += [_field(name, value) for name, value in extra.items()]
        timing = []
        if due:  # per step over the steps since the previous line
            now = self._clock()
            per_step = (now - self._marked) / (done - self._marked_done)
            self._marked, self._marked_done = now, done
            if self.tokens_per_step is not None:
                rate = self.tokens_per_step / per_step if per_step > 0 else float("inf")
                self._rate = f"{rate:.0f} {self.unit}/s"
            timing = [f"{per_step * 1e3:.2f} ms/step"] + ([self._rate] if self._rate else [])
            timing.append(
                f"done in {_clock_text(now - self._began)}"
                if last
                else f"ETA {_clock_text(per_step * (self.total_steps - done))}"
            )
        if self._bar is not None:  # tqdm shows the steps, the time and the ETA itself
            postfix = fields + ([self._rate] if self._rate else [])
            self._bar.set_postfix_str(", ".join(postfix), refresh=False)
            self._bar.update(done - self._bar.n)
            return None
        if not due:
            return None
        width = len(str(self.total_steps))
        line = " | ".join([f"step {done:>{width}}/{self.total_steps}"] + fields + timing)
        print(line, file=self.file, flush=True)
        return line

    def close(self) -> None:
        """End the bar (tqdm); plain lines need nothing. Safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
