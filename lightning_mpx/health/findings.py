"""What the doctor's checks (:mod:`lightning_mpx.health.doctor`, :mod:`lightning_mpx.health.underflow_checks`) share:
the :class:`Finding` each one reports, the scalar series they read (``tag -> [(step, value)]``) and the readings of a
series they all make: the tags by suffix, the steps a logged count covers, the run of points at the end of a series
that holds a condition, the end of the run that states are judged on, and how scales and ratios are shown.
:mod:`lightning_mpx.health.doctor` re-exports the public names (its import path is kept).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Callable, Sequence

SKIPPED_TAG = "mpx/skipped_steps"
PROMOTED_PREFIX = "mpx/promoted/"

#: The end of the run that states are judged on: this fraction of the logged points, and at least
#: ``TAIL_MIN_POINTS`` of them.
TAIL_FRACTION = 0.25
TAIL_MIN_POINTS = 3

Series = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding of the doctor.

    Attributes:
        kind: Problems: ``"persistent_overflow"``, ``"scale_too_low"``, ``"heavy_underflow"``,
            ``"non_finite_loss"``. Information:
            ``"healthy"``, ``"scale_climbing"``, ``"constant_scale"``, ``"promoted"``.
        problem: Whether it makes the exit status 1.
        summary: One line.
        evidence: The steps and values it rests on, one line each.
        fix: The suggested fix (a hint for information; ``None`` when there is nothing to do).
        modules: The modules (or parameter groups) it names, culprits first.
        since_step: The first step the state was seen at (the first step of the logging interval it showed in).
        loss: The loss-scale tag suffix (``"/loss1"``) when the run has several loss scales, else ``""``.
    """

    kind: str
    problem: bool
    summary: str
    evidence: tuple[str, ...] = ()
    fix: str | None = None
    modules: tuple[str, ...] = ()
    since_step: int | None = None
    loss: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The finding as plain JSON-able data."""
        data = dataclasses.asdict(self)
        data["evidence"], data["modules"] = list(self.evidence), list(self.modules)
        return data


def _by_suffix(mpx: dict[str, Series], prefix: str) -> dict[str, Series]:
    return {tag[len(prefix) :]: points for tag, points in mpx.items() if tag.startswith(prefix)}


def _interval_starts(points: Series, logged: Sequence[int] | None = None, counts: bool = False) -> list[int]:
    """The first step each logged point covers: one past the previous logging step (of ``logged``, by default the
    points' own steps); the first one's interval back from it, as long as its count at least with ``counts``. A count
    logged at step ``s`` covers the steps since the previous logging."""
    steps = sorted(set(logged if logged is not None else (step for step, _ in points)))
    # The first covers one logging interval (the median gap), not every step since 0: a run resumed at step 1000
    # and logging every 50 logs its first point at 1049, counting since 1000.
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]))
    first = max(0, steps[0] - gaps[len(gaps) // 2] + 1) if gaps else 0
    starts = []
    for step, _ in points:
        index = bisect.bisect_left(steps, step)
        starts.append(steps[index - 1] + 1 if index > 0 else first)
    if counts and points and starts[0] == first:  # a step counted once at most: a count of 10 covers 10 steps
        starts[0] = max(0, min(first, points[0][0] - math.ceil(points[0][1]) + 1))
    return starts


def _trailing(points: Series, holds: Callable[[int], bool]) -> int | None:
    """The index where the run of points at the end of ``points`` for which ``holds(i)`` starts (``None``: the last
    point does not hold)."""
    start = None
    for index in range(len(points) - 1, -1, -1):
        if not holds(index):
            break
        start = index
    return start


def _tail(points: Series) -> Series:
    size = max(TAIL_MIN_POINTS, math.ceil(TAIL_FRACTION * len(points)))
    return points[-size:]


def _fmt_num(value: float) -> str:
    """A scale as one would type it: ``65536``, ``0.5``, ``2**30``."""
    if value >= 2.0**24:
        return f"2**{round(math.log2(value))}"
    return f"{int(value)}" if value.is_integer() else f"{value:g}"


def _fmt_scale(value: float) -> str:
    """A scale with its power of two: ``65536 (2^16)``."""
    if value > 0 and math.isfinite(value) and math.log2(value).is_integer():
        shown = f"{int(value)}" if 1 <= value < 2.0**53 else f"{value:g}"
        return f"{shown} (2^{int(math.log2(value))})"
    return f"{value:g}"


def _fmt_ratio(value: float) -> str:
    if value <= 0:
        return "0"
    return f"{value:.3g} (2^{math.log2(value):.1f})"
