"""The benchmarks of ``tools/bench.py``, one module a subcommand (``common.py`` says what one
is and holds what they share; ``step_report.py`` and ``step_torch.py`` are parts of ``step``)."""
