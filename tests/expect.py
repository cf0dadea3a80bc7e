"""``check(condition, message)``: an assertion that ``python -O`` keeps, for the case scripts;
``raises(kind, text, fn)``: ``fn()`` must raise ``kind`` with ``text`` in its message."""


def check(condition, message="check failed") -> None:
    if not condition:
        raise AssertionError(message)


def raises(kind, text: str, fn) -> None:
    """``fn()`` raises ``kind`` whose message holds ``text`` (an AssertionError otherwise)."""
    try:
        fn()
    except kind as exc:
        check(text in str(exc), f"{kind.__name__} without {text!r}: {exc}")
        return
    raise AssertionError(f"no {kind.__name__} ({text!r})")
