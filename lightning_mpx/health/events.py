"""Reading a run's TensorBoard scalars as one curve per tag, in the order they were written.

A run folder can hold several event files: one run's files split by a restart of its writer, a resumed run that
continues the curve, or a run started again from step 0 (a fixed ``TensorBoardLogger(version=0)``, a Fabric loop whose
step count restarted, a resume from a checkpoint older than the last logged step). Merging the points by step alone
(a later point at the same step wins) makes one curve of two runs: the new run's steps 0-19 and the old run's 20-39.
Read in the order written, an ``mpx/*`` point at a step below the previous one's starts the run again from there: the
``mpx/*`` points logged before at that step or later are left out, as TensorBoard does for a writer that marks its
restart (``purge_step``), and the reader says so. The ``mpx/*`` tags are logged at the run's step; another tag may
count its own steps (``trainer.validate()``'s batches after ``fit``, a loop's batch index in its epoch): going back,
it starts its own curve again and leaves the others alone. The same step written again by one writer (one event
file) adds the counts (``mpx/overflows``, ``mpx/overflow/<module>``: since the previous log, which an
``Accelerator.log`` per call makes twice a step) and keeps the later value of the others.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from lightning_mpx.common.imports import require

__all__ = ["Restart", "RunScalars", "describe_restarts", "read_run", "unprefixed"]

#: At most this many restarts are described one by one (the latest); the earlier ones are counted.
RESTARTS_SHOWN = 3
#: The tags logged at the run's step (their steps going back is a restart of the run).
RUN_PREFIX = "mpx/"
#: The counts since the previous log: the same step logged twice by one writer adds them.
COUNT_TAGS = ("mpx/overflows", "mpx/overflow/", "mpx/overflow_first/")
_VERSION = re.compile(r"version_(\d+)")

Series = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Restart:
    """The steps of a run's curves went back: the points logged before at ``to_step`` or later are left out.

    Attributes:
        folder: The folder of the event file whose point went back.
        from_step: The last step logged before it (the largest over the tags).
        to_step: The step the curves went back to.
        dropped: How many points (over every ``mpx/*`` tag) were left out.
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
    time, file order on ties, over every folder): an ``mpx/*`` step below the previous one's replaces the ``mpx/*``
    points from that step on (a restart, told), another tag's step its own; the same step again keeps the later
    point, or the sum of a count written twice by one writer.

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
    written: list[tuple[float, int, str, int, float, str, str]] = []
    for folder in folders:
        # One writer per event file: its points at one step are one log's. Orphans kept: the restarts are told here.
        for file in sorted(folder.glob("events.out.tfevents.*")):
            events = accumulator_module.EventAccumulator(
                str(file), size_guidance={"scalars": 0}, purge_orphaned_data=False
            )
            events.Reload()
            for tag in events.Tags()["scalars"]:
                for event in events.Scalars(tag):
                    point = (event.wall_time, len(written), tag, event.step, event.value, str(folder), str(file))
                    written.append(point)
    series: dict[str, Series] = {}
    writers: dict[str, str] = {}  # tag -> the file of its last point
    restarts: dict[tuple[str, int], list[int]] = {}  # (folder, to_step) -> [from_step, dropped, times]
    # Folder by folder: TensorBoardLogger's version_<N> in N's order (a clock set apart on another machine does not
    # reorder them), others by their first point's time; in a folder, by time (two writers at once interleave).
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for point in written:
        first[point[5]] = min(first.get(point[5], point[0]), point[0])
        last[point[5]] = max(last.get(point[5], point[0]), point[0])
    versions = {folder: _VERSION.fullmatch(Path(folder).name) for folder in first}
    numbered = all(versions.values())
    number = {f: int(m.group(1)) if numbered and m else 0 for f, m in versions.items()}
    # Folders of one number written at once (two loggers of one run: version_0 and second/version_0) share a rank:
    # their points interleave by time, the same step from the other writer is no restart.
    rank: dict[str, tuple[int, float]] = {}
    current, end = (-1, -math.inf), -math.inf
    for folder in sorted(first, key=lambda f: (number[f], first[f])):
        if current[0] != number[folder] or first[folder] > end:
            current, end = (number[folder], first[folder]), last[folder]
        rank[folder], end = current, max(end, last[folder])
    for _, _, tag, step, value, folder, file in sorted(written, key=lambda p: (rank[p[5]], p[0], p[1])):
        curve = series.setdefault(tag, [])
        if curve and step == curve[-1][0]:
            _, before = curve.pop()  # the same step written again: the later point, or both counts by one writer
            value += before if writers[tag] == file and _is_mpx(tag, COUNT_TAGS) else 0.0
        elif curve and step < curve[-1][0] and not _is_mpx(tag):
            series[tag] = curve = [point for point in curve if point[0] < step]  # its own steps started again
        elif curve and step < curve[-1][0]:
            # The run started again at ``step``: every mpx/* tag's points from there on are orphans (TensorBoard's
            # purge), a tag the new run does not log (an overflow's module) too.
            run = {name: points for name, points in series.items() if _is_mpx(name) and points}
            last = max(points[-1][0] for points in run.values())
            dropped = 0
            for name, points in run.items():
                kept = [point for point in points if point[0] < step]
                dropped += len(points) - len(kept)
                series[name] = kept
            curve = series[tag]
            seen = restarts.setdefault((folder, step), [last, 0, 0])
            seen[0] = max(seen[0], last)
            seen[1] += dropped
            seen[2] += 1
        curve.append((step, value))
        writers[tag] = file
    series = {tag: points for tag, points in series.items() if points}
    told = tuple(Restart(folder, start, to, *counts) for (folder, to), (start, *counts) in restarts.items())
    return RunScalars(series, told)


def _is_mpx(tag: str, names: tuple[str, ...] = (RUN_PREFIX,)) -> bool:
    """Whether ``tag`` is one of the ``mpx/*`` ``names``, also under a logger's prefix (``train-mpx/...``)."""
    return tag.startswith(names) or any(f"{join}{name}" in tag for join in "/-" for name in names)


def describe_restarts(restarts: tuple[Restart, ...]) -> list[str]:
    """A report's lines for ``restarts``: the latest :data:`RESTARTS_SHOWN` described, the earlier ones counted (a
    loop that logs each epoch from step 0 again restarts every epoch)."""
    lines = [restart.describe() for restart in restarts[-RESTARTS_SHOWN:]]
    if len(restarts) > RESTARTS_SHOWN:
        earlier = len(restarts) - RESTARTS_SHOWN
        lines.insert(0, f"the steps went back {len(restarts)} times; the {earlier} earliest are not shown one by one.")
    return lines


def unprefixed(series: dict[str, Series]) -> tuple[dict[str, Series], str]:
    """``series`` with a prefix put before every ``mpx/*`` tag taken off, and the prefix (``""``: none). A logger's
    ``prefix=`` (Lightning's ``TensorBoardLogger(prefix="train")`` logs ``train-mpx/loss_scale``) or a user's
    ``train/`` before the metrics' names: one prefix is taken off; none, or several (one per rank), leave ``series``
    as it is."""
    if any(tag.startswith(RUN_PREFIX) for tag in series):
        return series, ""
    prefixes = {tag[: -len("mpx/loss_scale")] for tag in series if tag.endswith("mpx/loss_scale")}
    if len(prefixes) != 1:
        return series, ""
    (prefix,) = prefixes
    return {tag[len(prefix) :] if tag.startswith(prefix) else tag: points for tag, points in series.items()}, prefix
