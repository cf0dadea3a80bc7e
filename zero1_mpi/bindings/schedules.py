"""Learning-rate schedules for a binding's param groups: a callable ``lr`` kept beside the core.

A schedule is a callable ``count -> lr`` (an optax schedule, any function of an int); ``count``
is optax's: the number of updates applied before this one (the optimizer's ``step_count``).
The core only ever holds numbers. ``Schedules.apply(groups, count)`` adopts a callable set as a
group's ``lr`` since (it replaces that group's schedule), ends the schedule of a group whose
``lr`` was set to a number, and sets each scheduled group's ``lr`` to ``schedule(count)``.
``settle(groups)`` records the groups after a step, ``rewritten(groups)`` after a load;
``restore(groups)`` puts back what ``apply`` replaced (a failed step). Checkpoints hold the
number; the restored step count gives the schedule's next value. Pure: no MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

from ..rules.options import number

__all__ = ["Schedules", "is_schedule"]


def is_schedule(value) -> TypeGuard[Callable]:
    """Is ``value`` a schedule: a callable that is not an array or a number?"""
    return callable(value) and not hasattr(value, "dtype")


class Schedules:
    """The schedules of a core optimizer's ``param_groups`` (by index): ``schedules`` those
    given at construction."""

    def __init__(self, schedules: dict[int, Callable], groups: list[dict], count: int):
        """``groups`` hold each schedule's number at ``count``."""
        self._by_group = dict(schedules)
        #: The count each scheduled group's number is the schedule's value at.
        self._counts = dict.fromkeys(schedules, count)
        self._settled: tuple[list, dict[int, int]] = ([], {})
        self.settle(groups)

    def scheduled(self) -> dict[int, Callable]:
        """The schedule of each scheduled group, by index."""
        return dict(self._by_group)

    def apply(self, groups: list[dict], count: int) -> str | None:
        """Give each scheduled group ``lr = schedule(count)`` (where it does not hold it
        already); a message naming the group when a schedule raised or gave no finite
        number (that group keeps its number), else None."""
        numbers, _ = self._settled
        problem, values = None, {}  # (each schedule evaluated once: groups may share one)
        for index, group in enumerate(groups):
            lr = group.get("lr")
            unchanged = index < len(numbers) and lr is numbers[index]
            if is_schedule(lr):
                self._by_group[index] = lr
                self._counts.pop(index, None)
            elif index in self._by_group and not unchanged:
                del self._by_group[index]  # a number set since: the schedule ends
                self._counts.pop(index, None)
            if index not in self._by_group or self._counts.get(index) == count:
                continue
            where = f"param_groups[{index}]['lr']"
            schedule = self._by_group[index]
            try:
                if id(schedule) not in values:
                    values[id(schedule)] = number(schedule(count), f"schedule({count})")
                group["lr"] = values[id(schedule)]
                self._counts[index] = count
            except Exception as exc:  # noqa: BLE001 - the caller raises it on every rank
                if is_schedule(lr):
                    group["lr"] = numbers[index] if index < len(numbers) else None
                problem = problem or (
                    f"{where}: the schedule failed at step count {count}: "
                    f"{type(exc).__name__}: {exc}"
                )
        return problem

    def restore(self, groups: list[dict]) -> None:
        """Put back the ``lr`` numbers ``apply`` replaced since ``settle`` (a failed step)."""
        numbers, counts = self._settled
        for index in self._by_group:
            if index < len(numbers):
                groups[index]["lr"] = numbers[index]
        self._counts = dict(counts)

    def settle(self, groups: list[dict]) -> None:
        """Record the groups' ``lr`` values, as a step or a load left them."""
        self._settled = ([group.get("lr") for group in groups], dict(self._counts))

    def rewritten(self, groups: list[dict]) -> None:
        """``settle`` after the core wrote the groups (a load): their numbers are no longer
        known to be the schedules' at the step count (the next ``apply`` evaluates them)."""
        self._counts.clear()
        self.settle(groups)
