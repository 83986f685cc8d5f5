"""The doctor's look at the logged loss itself (:func:`non_finite_loss`): a run whose loss is NaN or inf at the end,
over at least ``PERSISTENT_MIN_STEPS`` steps (or at every logged point), with no persistent overflow to explain it.

A dynamic float16 scale turns non-finite gradients into skipped steps, which the persistent-overflow check reads. A
bfloat16 run (a static scale of 1) or a forward that is already non-finite while the gradients' check has nothing to
skip (the loss NaN from a bad batch, a too high learning rate after the masters went non-finite) never overflows: the
scalars of the scale look healthy while nothing trains. Used by :func:`lightning_mpx.health.doctor.diagnose_scalars`.
"""

from __future__ import annotations

import math
from typing import Iterable

from lightning_mpx.health.findings import Finding, Series, _interval_starts, _trailing


def non_finite_loss(loss: Series | None, min_steps: int, overflows: Iterable[Series] = ()) -> Finding | None:
    """A problem where the logged ``loss`` (``[(step, value)]``) is non-finite at its last points, over at least
    ``min_steps`` steps or at every logged point (two or more); ``None`` otherwise (no loss logged, a finite one at the
    end, or a run's one logged point: one batch, whose NaN may be an empty batch's). Nor where a step counted in
    ``overflows`` (``mpx/overflows`` counts: skipped) lies in each non-finite point's interval: a loss logged as an
    epoch's mean (``self.log("loss", loss, on_step=False, on_epoch=True)``) is NaN at every epoch whose one bad batch
    was skipped, a run that trains."""
    if not loss:
        return None
    bad = _trailing(loss, lambda i: not math.isfinite(loss[i][1]))
    if bad is None:
        return None
    skipped = [
        (start, step)
        for points in overflows
        for (step, value), start in zip(points, _interval_starts(points, counts=True))
        if value > 0
    ]
    starts = _interval_starts(loss)
    if skipped and all(
        any(first <= loss[i][0] and starts[i] <= last for first, last in skipped) for i in range(bad, len(loss))
    ):
        return None  # each non-finite point's steps hold a skipped one: its bad batch, not a broken run
    since, last = loss[bad][0], loss[-1][0]
    if (bad > 0 or len(loss) == 1) and last - since + 1 < min_steps:
        return None  # one or two non-finite points at the very end (or the run's one point): one bad batch
    values = sorted({repr(value) for _, value in loss[bad:]})
    return Finding(
        "non_finite_loss",
        True,
        f"non-finite loss since step {since}, with no persistent overflow: nothing the loss scale skips",
        (
            f"the logged loss is {' / '.join(values)} at every logged step {since}-{last} ({len(loss) - bad} points)",
            "no persistent overflow of the gradients: the steps were not skipped (a static scale, bfloat16), or the "
            "weights themselves are non-finite",
        ),
        "find the first non-finite value: the forward's (on_overflow forensics, mpx/overflow_first/<module>), the "
        "data's, or the weights' after a step (a learning rate too high); at O2, amp.fp32_state_dict(model) shows the "
        "masters",
        since_step=since,
    )
