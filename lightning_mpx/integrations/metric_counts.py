"""The front doors' reader of the ``mpx/*`` metrics, and their checkpoints of the release that carried counts.

The engine owns the overflow totals and each reader's position (:meth:`Amp.metrics
<lightning_mpx.engine.amp.Amp.metrics>`): a door that logs reads as :data:`LOG_READER`, so that a user's read between
two logs (``trainer.precision_plugin.metrics()`` in a callback) and the log never take counts from each other, and
the engine's checkpoint holds the log's position.

The release before kept a second copy, the counts read between logs and not logged yet (``unlogged_counts`` in a
door's checkpoint): :func:`upgrade_unlogged` turns such a checkpoint into a position, so its resumed run's first log
still reports exactly those counts and its own.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from lightning_mpx.common.containers import read_floats
from lightning_mpx.engine.overflow import overflows_name

__all__ = ["LOG_READER", "log_metrics", "upgrade_unlogged"]

#: The reader a front door logs the metrics as (``Amp.metrics(LOG_READER)``).
LOG_READER = "log"
#: The key of the counts not logged yet in a door's checkpoint of the release before (written no more).
UNLOGGED_KEY = "unlogged_counts"


def log_metrics(amp: Any, loggers: Iterable[Any], step: int) -> None:
    """Log ``amp``'s ``mpx/*`` metrics as :data:`LOG_READER` (counts since the previous log) to ``loggers`` at
    ``step``: a logging step, where syncing is fine; one host read, not one per metric."""
    amp.read_step_outcomes()
    values = read_floats(amp.metrics(LOG_READER))
    for logger in loggers:
        logger.log_metrics(values, step=step)


def upgrade_unlogged(state: dict[str, Any], reader: str) -> dict[str, Any]:
    """``state``, a door's checkpoint of the engine; one of the release that saved ``unlogged_counts`` (and no reader
    positions) gets ``reader``'s position instead: each loss's total there less its counts not logged yet, and the
    module totals (that release kept none) from zero less theirs. Any other ``state`` as it is."""
    if not isinstance(state, Mapping):
        return state  # not a checkpoint of the engine at all: Amp.load_state_dict names what it is
    unlogged = state.get(UNLOGGED_KEY)
    if not isinstance(unlogged, Mapping) or "metric_readers" in state or not isinstance(state.get("scalers"), list):
        return state
    scalers = state["scalers"]
    position = {overflows_name(i, len(scalers)): int(s.get("overflows", 0)) for i, s in enumerate(scalers)}
    for name, count in unlogged.items():
        position[name] = position.get(name, 0) - int(count)
    upgraded = {key: value for key, value in state.items() if key != UNLOGGED_KEY}
    return {**upgraded, "overflow_counts": {"modules": {}, "first": {}}, "metric_readers": {reader: position}}
