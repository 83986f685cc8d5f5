"""The counts among the ``mpx/*`` metrics (``mpx/overflows``, ``mpx/overflow/<module>``...), as the doors log them.

The engine's counts (``mpx/overflows``, ``mpx/overflow/<module>``...) are "since the last read". The plugin logs them
as "since the previous log", so a read between two logs (``trainer.precision_plugin.metrics()`` in a callback, which
the docs allow) must not take them from the next log: :class:`LoggedMetrics` carries what such a read took into it.
After a checkpoint is loaded, every door starts the counts afresh from the checkpoint's totals (:func:`rebase_counts`):
otherwise the first log of a resumed run would report every overflow of the run before it.
"""

from __future__ import annotations

from typing import Any

from lightning_mpx.common.containers import read_floats

__all__ = ["LoggedMetrics", "rebase_counts"]

#: Metric names that count events since the previous read (the engine's ``mpx/overflows``, the forensics' counts).
_COUNT_PREFIXES = ("mpx/overflows", "mpx/overflow/", "mpx/overflow_first/")


def _is_count(name: str) -> bool:
    return name.startswith(_COUNT_PREFIXES)


def rebase_counts(amp: Any) -> None:
    """Start ``amp``'s counts since the last read from its totals, after it loaded a checkpoint (the totals are not
    this run's new events). Nothing is read from the device."""
    amp.metrics()  # what it returns is dropped: only its "last read" marks move


class LoggedMetrics:
    """Reads an engine's metrics so that the counts of each log cover every event since the previous log."""

    def __init__(self) -> None:
        self._carried: dict[str, float] = {}  # counts taken by reads since the previous log

    def read(self, amp: Any, log: bool) -> dict[str, float]:
        """``amp.metrics()`` as Python numbers (one host read), its counts since the previous log; ``log``: this read
        is the log (the next one counts from here)."""
        values = read_floats(amp.metrics())
        for name, count in self._carried.items():
            values[name] = values.get(name, 0.0) + count
        self._carried = {} if log else {name: value for name, value in values.items() if _is_count(name)}
        return values

    def rebase(self, amp: Any) -> None:
        """Start the counts afresh after ``amp`` loaded a checkpoint (:func:`rebase_counts`)."""
        rebase_counts(amp)
        self._carried = {}
