"""The counts among the ``mpx/*`` metrics (``mpx/overflows``, ``mpx/overflow/<module>``...), as the doors log them.

The engine's counts are "since its last read". A door logs them as "since the previous log", so a read between two
logs (``trainer.precision_plugin.metrics()`` in a callback, which the docs allow, or the read a checkpoint makes) must
not take them from the next log: :class:`LoggedMetrics` carries what such a read took into it. A checkpoint holds the
counts not logged yet, so a resumed run's first log reports those and its own, never the saving run's whole total.
"""

from __future__ import annotations

from typing import Any

from lightning_mpx.common.containers import read_floats

__all__ = ["LoggedMetrics"]

#: Metric names that count events since the previous read (the engine's ``mpx/overflows``, the forensics' counts).
_COUNT_PREFIXES = ("mpx/overflows", "mpx/overflow/", "mpx/overflow_first/")
#: The key of the counts not logged yet in a door's checkpoint of the engine (the engine ignores it).
UNLOGGED_KEY = "unlogged_counts"


def _is_count(name: str) -> bool:
    return name.startswith(_COUNT_PREFIXES)


class LoggedMetrics:
    """Reads an engine's metrics so that each log holds every event since the previous log, and saves and restores
    the counts not logged yet with the engine's state."""

    def __init__(self) -> None:
        self._pending: dict[str, float] = {}  # what reads since the previous log took from the engine

    def read(self, amp: Any, log: bool) -> dict[str, float]:
        """``amp.metrics()`` as Python numbers (one host read), its counts since the previous log and, for a metric
        it no longer holds (a gradient norm an earlier read took), the earlier read's value; ``log``: this read is a
        log (the next one counts from here)."""
        fresh = read_floats(amp.metrics())
        values = {**self._pending, **fresh}
        for name, count in self._pending.items():
            if _is_count(name) and name in fresh:
                values[name] = fresh[name] + count
        self._pending = {} if log else values
        return values

    def state_dict(self, amp: Any) -> dict[str, Any]:
        """``amp.state_dict()`` with the counts not logged yet (their read is carried to the next log)."""
        state = amp.state_dict()  # first: it reads the steps skipped on the device, whose counts the read takes
        self.read(amp, log=False)
        return {**state, UNLOGGED_KEY: {name: v for name, v in self._pending.items() if _is_count(name)}}

    def load_state_dict(self, amp: Any, state: dict[str, Any]) -> None:
        """Load ``state`` (:meth:`state_dict`'s, or ``Amp.state_dict()``'s) into ``amp``; the next log counts from
        the checkpoint: the counts it had not logged, then this run's (not the saving run's totals)."""
        amp.load_state_dict(state)
        amp.metrics()  # dropped, nothing read from the device: the engine's counts start from the loaded totals
        self._pending = dict(state.get(UNLOGGED_KEY) or {})
