"""``check(condition, message)``: an assertion that ``python -O`` keeps, for the case scripts."""


def check(condition, message="check failed") -> None:
    if not condition:
        raise AssertionError(message)
