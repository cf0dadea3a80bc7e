"""``zero1_mpi.progress.Progress``: plain lines at the first step, every ``every`` steps and the
last, with ms/step, tokens/s and an ETA from a fake clock; rank != 0 prints nothing; the mode
from the argument or ``$ZERO1_PROGRESS``; a tqdm bar where tqdm is installed (else skipped)."""

from __future__ import annotations

import importlib.util
import io
import re
from types import SimpleNamespace

import pytest
from mpi4py import MPI

import zero1_mpi.progress
from zero1_mpi.progress import Progress

pytestmark = pytest.mark.mpi_independent  # (conftest.py)

HAVE_TQDM = importlib.util.find_spec("tqdm") is not None
needs_tqdm = pytest.mark.skipif(not HAVE_TQDM, reason="tqdm is not installed (optional)")


class Clock:
    """A clock the test moves: ``tick(s)`` before each update."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def tick(self, seconds):
        self.now += seconds


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(progress: Progress, clock: Clock, steps, seconds, loss=lambda s: 1.0 / (s + 1),
        **extra) -> list:
    """``update`` after each step of ``steps``, ``seconds(step)`` apart; the returned lines."""
    returned = []
    with progress:
        for step in steps:
            clock.tick(seconds(step))
            returned.append(progress.update(step, loss(step), **extra))
    return returned


def test_plain_lines_at_the_first_every_nth_and_last_step_with_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    progress = Progress(50, 0, tokens_per_step=1000, every=20, file=out, mode="plain",
                        clock=clock)
    # The first step (warm-up) takes 1 s, the others 0.1 s each.
    returned = run(progress, clock, range(50), lambda s: 1.0 if s == 0 else 0.1)
    lines = out.getvalue().splitlines()
    assert lines == [
        "step  1/50 | loss 1.0000 | 1000.00 ms/step | 1000 tokens/s | ETA 0:00:49",
        "step 20/50 | loss 0.0500 | 100.00 ms/step | 10000 tokens/s | ETA 0:00:03",
        "step 40/50 | loss 0.0250 | 100.00 ms/step | 10000 tokens/s | ETA 0:00:01",
        "step 50/50 | loss 0.0200 | 100.00 ms/step | 10000 tokens/s | done in 0:00:06",
    ]
    assert [r for r in returned if r is not None] == lines  # update returns what it printed
    assert sum(r is None for r in returned) == 46


def test_the_docstrings_line_is_what_it_prints():
    clock, out = Clock(), io.StringIO()
    progress = Progress(200, 0, start=100, tokens_per_step=810, every=20, file=out,
                        mode="plain", clock=clock)
    run(progress, clock, range(100, 120), lambda s: 0.15, loss=lambda s: 1.2345)
    line = out.getvalue().splitlines()[-1]
    assert line == "step 120/200 | loss 1.2345 | 150.00 ms/step | 5400 tokens/s | ETA 0:00:12"
    assert f"``{line}``" in zero1_mpi.progress.__doc__.replace("\n", " ")


def test_a_resumed_run_counts_from_start_and_refuses_steps_out_of_order():
    clock, out = Clock(), io.StringIO()
    progress = Progress(200, 0, start=100, every=50, file=out, mode="plain", clock=clock)
    with pytest.raises(ValueError, match=r"update\(step=99\).*after 99 and below "
                                         r"total_steps=200"):
        progress.update(99, 1.0)
    run(progress, clock, range(100, 200), lambda s: 0.2, loss=lambda s: 0.5)
    assert out.getvalue().splitlines() == [  # no tokens_per_step: no rate
        "step 101/200 | loss 0.5000 | 200.00 ms/step | ETA 0:00:20",
        "step 150/200 | loss 0.5000 | 200.00 ms/step | ETA 0:00:10",
        "step 200/200 | loss 0.5000 | 200.00 ms/step | done in 0:00:20"]
    for step in (150, 199, 200):
        with pytest.raises(ValueError, match=f"step={step}"):
            progress.update(step, 1.0)


def test_without_loss_and_with_extra_fields():
    clock, out = Clock(), io.StringIO()
    progress = Progress(2, 0, tokens_per_step=256, unit="examples", file=out, mode="plain",
                        clock=clock)
    clock.tick(0.5)
    progress.update(0, lr=3e-4, scale=65536, skipped=0)
    clock.tick(0.25)
    progress.update(1, 2.5, lr=1.5e-4)
    assert out.getvalue().splitlines() == [
        ("step 1/2 | lr 0.0003 | scale 65536 | skipped 0 | 500.00 ms/step | 512 examples/s | "
         "ETA 0:00:00"),
        "step 2/2 | loss 2.5000 | lr 0.00015 | 250.00 ms/step | 1024 examples/s | done in 0:00:01"]


@pytest.mark.parametrize("rank", [1, 3, SimpleNamespace(rank=2),
                                  SimpleNamespace(Get_rank=lambda: 1)])
@pytest.mark.parametrize("mode", ["plain", "auto", pytest.param("tqdm", marks=needs_tqdm)])
def test_other_ranks_print_nothing(capsys, rank, mode):
    clock, out = Clock(), Terminal()
    progress = Progress(20, rank, tokens_per_step=10, every=1, file=out, mode=mode,
                        clock=clock)
    assert progress.mode == "off" and progress.rank >= 1
    assert run(progress, clock, range(20), lambda s: 0.1) == [None] * 20
    assert out.getvalue() == "" and capsys.readouterr() == ("", "")


@pytest.mark.parametrize("comm", [MPI.COMM_SELF, SimpleNamespace(rank=0),
                                  SimpleNamespace(Get_rank=lambda: 0)])
def test_rank_0_from_a_communicator_prints(comm, capsys):
    progress = Progress(1, comm, mode="plain")  # file: sys.stdout
    assert progress.rank == 0
    progress.update(0, 1.0)
    assert capsys.readouterr().out.startswith("step 1/1 | loss 1.0000 | ")


def test_the_environment_chooses_the_mode(monkeypatch):
    out = Terminal()
    monkeypatch.setenv("ZERO1_PROGRESS", "plain")
    assert Progress(5, 0, file=out).mode == "plain"  # a terminal, but plain asked for
    monkeypatch.setenv("ZERO1_PROGRESS", " OFF ")
    progress = Progress(5, 0, file=out)
    assert progress.mode == "off" and progress.update(0, 1.0) is None and not out.getvalue()
    assert Progress(5, 0, file=out, mode="plain").mode == "plain"  # the argument wins
    monkeypatch.setenv("ZERO1_PROGRESS", "fancy")
    with pytest.raises(ValueError, match=r"\$ZERO1_PROGRESS='fancy' is not a mode; known: "
                                         r"auto, plain, tqdm, off"):
        Progress(5, 0)
    monkeypatch.setenv("ZERO1_PROGRESS", "")
    assert Progress(5, 0, file=io.StringIO()).mode == "plain"  # empty: auto; not a terminal


def test_auto_is_plain_on_a_pipe_and_tqdm_on_a_terminal_only_where_installed(monkeypatch):
    monkeypatch.delenv("ZERO1_PROGRESS", raising=False)
    assert Progress(5, 0, file=io.StringIO()).mode == "plain"  # mpiexec's stdout: a pipe
    closed = io.StringIO()
    closed.close()
    assert Progress(5, 0, file=closed).mode == "plain"
    assert Progress(5, 0, file=object()).mode == "plain"  # no isatty at all
    with Progress(5, 0, file=Terminal()) as progress:
        assert progress.mode == ("tqdm" if HAVE_TQDM else "plain")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tqdm" else real_find_spec(name, *a))
    assert Progress(5, 0, file=Terminal()).mode == "plain"
    with pytest.raises(ImportError, match="mode='tqdm' but tqdm is not installed: pip install "
                                          "tqdm, or choose 'plain'"):
        Progress(5, 3, mode="tqdm")  # on every rank, so that no rank waits for another


@needs_tqdm
def test_tqdm_bar_shows_steps_loss_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    progress = Progress(30, 0, tokens_per_step=512, every=10, file=out, mode="tqdm",
                        clock=clock)
    returned = run(progress, clock, range(30), lambda s: 0.1, lr=3e-4)
    assert returned == [None] * 30 and progress._bar is None  # closed on leaving the block
    frames = out.getvalue().split("\r")
    assert " 0/30 " in frames[1] and "?step/s" in frames[1]
    last = frames[-1]
    assert "100%" in last and " 30/30 " in last, last
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, +[\d.]+step/s", last), last  # tqdm's ETA
    assert last.rstrip().endswith("loss 0.0333, lr 0.0003, 5120 tokens/s]"), last
    assert "ms/step" not in out.getvalue()  # tqdm shows time and rate itself


@needs_tqdm
def test_tqdm_bar_of_a_resumed_run_starts_at_start():
    clock, out = Clock(), io.StringIO()
    run(Progress(200, 0, start=150, every=10, file=out, mode="tqdm", clock=clock), clock,
        range(150, 200), lambda s: 0.1)
    frames = out.getvalue().split("\r")
    assert " 150/200 " in frames[1] and " 200/200 " in frames[-1]


@pytest.mark.parametrize("kwargs, message", [
    ({"total_steps": 0}, "total_steps=0 must be an integer >= 1"),
    ({"total_steps": 10.0}, "total_steps=10.0 must be an integer >= 1"),
    ({"every": 0}, "every=0 must be an integer >= 1"),
    ({"start": -1}, "start=-1 must be an integer >= 0"),
    ({"start": 11}, "start=11 is past total_steps=10"),
    ({"tokens_per_step": 0}, "tokens_per_step=0 must be a number > 0"),
    ({"mode": "bar"}, "mode='bar' is not a mode"),
])
def test_bad_arguments_are_named(kwargs, message):
    arguments = {"total_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        Progress(arguments.pop("total_steps"), 0, **arguments)


@pytest.mark.parametrize("rank", [-1, "0", 1.0, True, SimpleNamespace(size=2)])
def test_a_bad_rank_is_named(rank):
    with pytest.raises(ValueError, match="must be a rank >= 0 or a communicator with .rank or "
                                        "Get_rank()"):
        Progress(10, rank)
