"""Reading a run's TensorBoard scalars as one curve per tag, in the order they were written.

A run folder can hold several event files: one run's files split by a restart of its writer, a resumed run that
continues the curve, or a run started again from step 0 (a fixed ``TensorBoardLogger(version=0)``, a Fabric loop whose
step count restarted, a resume from a checkpoint older than the last logged step). Merging the points by step alone
(a later point at the same step wins) makes one curve of two runs: the new run's steps 0-19 and the old run's 20-39.
Read in the order written, a point at a step at or below the previous point's starts the curve again from there: the
points logged before at that step or later are left out, as TensorBoard does for a writer that marks its restart
(``purge_step``), and the reader says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lightning_mpx.common.imports import require

__all__ = ["Restart", "RunScalars", "describe_restarts", "read_run"]

#: At most this many restarts are described one by one (the latest); the earlier ones are counted.
RESTARTS_SHOWN = 3

Series = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Restart:
    """The steps of a run's curves went back: the points logged before at ``to_step`` or later are left out.

    Attributes:
        folder: The folder of the event file whose point went back.
        from_step: The last step logged before it (the largest over the tags).
        to_step: The step the curves went back to.
        dropped: How many points (over every tag) were left out.
        times: How many times the steps went back to ``to_step`` there (a loop that logs each epoch from 0 again).
    """

    folder: str
    from_step: int
    to_step: int
    dropped: int
    times: int = 1

    def describe(self) -> str:
        """One line for a report."""
        return (
            f"the steps went back from {self.from_step} to {self.to_step} in {self.folder}"
            f"{f' ({self.times} times)' if self.times > 1 else ''} (a run started again, or "
            f"resumed from a checkpoint older than its last logged step): the {self.dropped} point(s) logged before "
            f"at step {self.to_step} or later are left out, as TensorBoard purges a restarted writer's orphans."
        )


@dataclasses.dataclass(frozen=True)
class RunScalars:
    """What :func:`read_run` read: ``series`` (``tag -> [(step, value)]``, steps ascending) and the ``restarts``."""

    series: dict[str, Series]
    restarts: tuple[Restart, ...] = ()


def read_run(run_dir: str | Path) -> RunScalars:
    """Every scalar series in the TensorBoard event files under ``run_dir``, read in the order written (by wall
    time, file order on ties, over every folder), a step at or below the previous point's replacing the points from
    that step on.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds no event files.
    """
    accumulator_module = require(
        "tensorboard.backend.event_processing.event_accumulator", extra="demo", feature="lightning-mpx plot"
    )
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"RUN_DIR={str(run)!r} does not exist.")
    folders = sorted({p.parent for p in run.rglob("events.out.tfevents.*")})
    if not folders:
        raise FileNotFoundError(f"RUN_DIR={str(run)!r} holds no TensorBoard event files (events.out.tfevents.*).")
    written: list[tuple[float, int, str, int, float, str]] = []
    for folder in folders:
        # Orphans kept: the restarts are told here, over every folder and every tag, and said.
        events = accumulator_module.EventAccumulator(
            str(folder), size_guidance={"scalars": 0}, purge_orphaned_data=False
        )
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                written.append((event.wall_time, len(written), tag, event.step, event.value, str(folder)))
    series: dict[str, Series] = {}
    restarts: dict[tuple[str, int], list[int]] = {}  # (folder, to_step) -> [from_step, dropped, times]
    for _, _, tag, step, value, folder in sorted(written, key=lambda point: (point[0], point[1])):
        curve = series.setdefault(tag, [])
        if curve and step == curve[-1][0]:
            curve.pop()  # the same step written again: the later point
        elif curve and step < curve[-1][0]:
            # The run started again at ``step``: every tag's points from there on are orphans (TensorBoard's purge),
            # a tag the new run does not log (an overflow's module) too.
            last = max(points[-1][0] for points in series.values() if points)
            dropped = 0
            for name, points in series.items():
                kept = [point for point in points if point[0] < step]
                dropped += len(points) - len(kept)
                series[name] = kept
            curve = series[tag]
            seen = restarts.setdefault((folder, step), [last, 0, 0])
            seen[0] = max(seen[0], last)
            seen[1] += dropped
            seen[2] += 1
        curve.append((step, value))
    series = {tag: points for tag, points in series.items() if points}
    told = tuple(Restart(folder, start, to, *counts) for (folder, to), (start, *counts) in restarts.items())
    return RunScalars(series, told)


def describe_restarts(restarts: tuple[Restart, ...]) -> list[str]:
    """A report's lines for ``restarts``: the latest :data:`RESTARTS_SHOWN` described, the earlier ones counted (a
    loop that logs each epoch from step 0 again restarts every epoch)."""
    lines = [restart.describe() for restart in restarts[-RESTARTS_SHOWN:]]
    if len(restarts) > RESTARTS_SHOWN:
        earlier = len(restarts) - RESTARTS_SHOWN
        lines.insert(0, f"the steps went back {len(restarts)} times; the {earlier} earliest are not shown one by one.")
    return lines
