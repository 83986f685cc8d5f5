"""The doctor's underflow checks (:func:`lightning_mpx.health.doctor.diagnose_scalars` runs them): a loss scale too
low (heavy underflow in every group with room left below the half maximum), heavy underflow in one module while
another uses the range, the exact zeros of a group judged against the scale (:func:`_zeros_verdict`: structural, or
values the half backward flushed to zero), and, without underflow telemetry, a constant low scale pointed out. Their
thresholds are the constants below (re-exported by :mod:`lightning_mpx.health.doctor`, whose import path is kept).
"""

from __future__ import annotations

import bisect
import math

from lightning_mpx.health.findings import (
    PROMOTED_PREFIX,
    Finding,
    Series,
    _by_suffix,
    _fmt_num,
    _fmt_ratio,
    _fmt_scale,
    _tail,
)
from lightning_mpx.health.plot import OVERFLOW_TAG, SCALE_TAG, UNDERFLOW_PREFIX, ZEROS_PREFIX, headroom_ratios

#: Heavy underflow: at least this fraction of a group's gradient elements are below the half dtype's smallest normal
#: (``mpx/underflow/<group>``, plus the zeros that move with the scale; mean over the end of the run).
UNDERFLOW_HEAVY = 0.5
#: A group's zero fraction (``mpx/zeros/<group>``) "moves with the scale" when, over the last ``ZEROS_CHANGES`` changes
#: of the scale between logged points, it fell (as the scale grew; rose as it fell) by more than this share of its
#: level on average, and by more than ``ZEROS_MOVE_MIN``: batch-to-batch noise in the absent rows of an embedding
#: moves it a few percent either way.
ZEROS_MOVE = 0.1
ZEROS_MOVE_MIN = 0.005
ZEROS_CHANGES = 3
#: With no change of the scale to judge zeros by, they count as underflow when at least this share of the group's
#: non-zero elements sit below the smallest normal: gradients that reach that far down reach below the smallest
#: subnormal too. bfloat16 runs, whose range ends near 1e-38, have none: their zeros are structural.
SUBNORMAL_SHARE = 0.01
#: "Far below the half maximum": a group's largest scaled gradient under this fraction of the half dtype's maximum
#: (``2 ** -mpx/headroom_doublings/<group>``, max over the end of the run). float16's normal range spans 30 binades; a
#: gradient tensor commonly spreads over 15 to 20 binades below its largest element, so a largest element 12 binades
#: below the top puts the small end under float16's smallest normal. Zero gradients of unused embedding rows count as
#: underflow too; their group's headroom stays normal, so they are not reported.
HEADROOM_LOW = 2.0**-12
#: Without underflow telemetry, a loss scale at or below this that never changed and never overflowed is pointed
#: out (information, not a problem): Apex-era static scales (128, 1024) are often too low for float16.
CONSTANT_SCALE_SUSPECT = 2.0**10
#: A suggested higher scale aims the largest gradient at this fraction of the half maximum (room for spikes).
HEADROOM_TARGET = 2.0**-3


#: A logged point whose largest scaled gradient (the largest over the groups of ``mpx/headroom_doublings/<group>``) is
#: below this fraction of the half maximum is a bfloat16 run's: float16's whole range, from its maximum to its smallest
#: subnormal, spans 40 doublings (2^16 to 2^-24), bfloat16's maximum is 2^128 and a real gradient lies far below it.
HALF_DTYPE_SPLIT = 2.0**-64


def logged_half_dtype(mpx: dict[str, Series]) -> str | None:
    """The run's half dtype, as its headroom tells it: ``"bfloat16"`` when a logged point's largest scaled gradient is
    below ``HALF_DTYPE_SPLIT`` of the half maximum (past float16's whole range: no float16 run logs one), ``"float16"``
    when every point is above; ``None`` without headroom scalars. A point above says little alone: a bfloat16 run
    diverging passes there on its way to the maximum. The loss scale cannot tell: bfloat16's static scale of 1 is a
    float16 scale too."""
    largest: dict[int, float] = {}
    for points in headroom_ratios(mpx).values():
        for step, ratio in points:
            if 0.0 < ratio < 1.0:  # not a group without a non-zero gradient (0), nor an overflow step (inf, NaN)
                largest[step] = max(largest.get(step, 0.0), ratio)
    low = any(ratio < HALF_DTYPE_SPLIT for ratio in largest.values())
    return "bfloat16" if low else "float16" if largest else None


def _underflow(mpx: dict[str, Series]) -> tuple[list[Finding], list[str]]:
    """The underflow findings, and the evidence lines a healthy finding shows."""
    # A group that runs in FP32 (promoted or pinned) keeps its small gradients: its underflow is not judged.
    fp32 = [module for module, points in _by_suffix(mpx, PROMOTED_PREFIX).items() if points[-1][1] >= 0.5]
    if not any(group.split(".")[0] == "module" for group in _by_suffix(mpx, UNDERFLOW_PREFIX)):
        # A run written before stop 70 named a data-parallel model's promoted modules "module.<name>" and its
        # underflow groups "<name>" (the tags now agree): read so.
        fp32 += [module[len("module.") :] for module in fp32 if module.startswith("module.")]

    def judged(prefix: str) -> dict[str, Series]:
        return {
            group: points
            for group, points in _by_suffix(mpx, prefix).items()
            if not any(group == module or group.startswith(module + ".") for module in fp32)
        }

    underflow, zeros = judged(UNDERFLOW_PREFIX), judged(ZEROS_PREFIX)
    if not underflow:
        return [], []
    headroom = headroom_ratios(mpx)  # ratios to the half max, in float64: bfloat16's tiny ones too
    scale = next((mpx[tag] for tag in sorted(mpx) if tag == SCALE_TAG or tag.startswith(SCALE_TAG + "/loss")), None)
    fraction: dict[str, float] = {}  # judged: non-zero values below tiny, plus the zeros that move with the scale
    below: dict[str, float] = {}  # mpx/underflow/<group> alone
    verdicts: dict[str, tuple[float, float, str]] = {}  # zeros: (mean, counted as underflow, why)
    room: dict[str, float] = {}
    window = (0, 0)
    overflow_points = 0
    for group, points in underflow.items():
        tail = _tail(points)
        below[group] = fraction[group] = sum(value for _, value in tail) / len(tail)
        window = (tail[0][0], tail[-1][0])
        if group in zeros:
            verdicts[group] = _zeros_verdict(zeros[group], below[group], scale)
            fraction[group] += verdicts[group][1]
        if group in headroom:
            # A headroom of 1 or more (inf) is an overflow step, which the overflow findings judge: left out here.
            values = [value for _, value in _tail(headroom[group])]
            finite = [value for value in values if value < 1.0]
            overflow_points = max(overflow_points, len(values) - len(finite))
            room[group] = max(finite, default=1.0)
    span = f"steps {window[0]}-{window[1]}"
    worst = max(fraction, key=lambda g: fraction[g])
    evidence = [f"underflow at most {fraction[worst]:.3f} (group {worst or '<root>'}, mean over {span})"]
    most = max(verdicts, key=lambda g: verdicts[g][0], default=None)
    if most is not None and verdicts[most][0] > 0:
        evidence.append(f"exact zeros at most {verdicts[most][0]:.3f} (group {most or '<root>'}): {verdicts[most][2]}")
    run_room = max(room.values()) if room else None
    if run_room is not None:
        top = max(room, key=lambda g: room[g])
        evidence.append(
            f"largest gradient {_fmt_ratio(run_room)} of the half maximum (group {top or '<root>'}, {span}"
            + (f"; {overflow_points} logged overflow step(s) left out)" if overflow_points else ")")
        )
    by_fraction = sorted(fraction, key=lambda g: -fraction[g])
    heavy = [g for g in by_fraction if fraction[g] >= UNDERFLOW_HEAVY and room.get(g, 0.0) <= HEADROOM_LOW]
    if not heavy:
        return [], evidence
    lines = []
    for group in heavy:
        if group in verdicts:
            line = (
                f"mpx/underflow/{group}: {below[group]:.3f} of its gradient elements below the half dtype's smallest "
                f"normal and not zero (mean over {span})"
            )
            if verdicts[group][1] > 0:
                line += f"; mpx/zeros/{group}: {verdicts[group][1]:.3f} exact zeros counted too ({verdicts[group][2]})"
        else:  # written before mpx/zeros/<group>: the zeros are inside mpx/underflow/<group>
            line = (
                f"mpx/underflow/{group}: {fraction[group]:.3f} of its gradient elements zero or below the half "
                f"dtype's smallest normal (mean over {span})"
            )
        if group in room:
            line += f"; its largest is {_fmt_ratio(room[group])} of the half maximum"
        lines.append(line)
    names = tuple(g or "<root>" for g in heavy)
    if run_room is None or run_room > HEADROOM_LOW or scale is None:
        # Another group uses the range (or the headroom is unknown): a larger scale would not help this one.
        room_line = evidence[-1]
        found = [_heavy_underflow(g, line, room, run_room, room_line, window[0]) for g, line in zip(heavy, lines)]
        return found, []
    tail_scale = _tail(scale)
    first, final = tail_scale[0][1], tail_scale[-1][1]
    factor = 2.0 ** max(1, math.floor(math.log2(HEADROOM_TARGET / run_room))) if run_room > 0 else 2.0**10
    lines.append(f"no group's largest gradient is above {_fmt_ratio(run_room)} of the half maximum: the scale has room")
    if final > first:
        lines.append(f"the loss scale grew from {_fmt_scale(first)} to {_fmt_scale(final)} over {span}")
        fix = (
            f"it falls as the scale grows; to get there sooner start higher (init_scale={_fmt_num(final * factor)}) "
            "or grow more often (a shorter growth_interval)"
        )
        summary = f"underflow in {', '.join(names)} while the loss scale is still climbing"
        return [Finding("scale_climbing", False, summary, tuple(lines), fix, names, window[0])], []
    never = all(value == final for _, value in scale)
    lines.append(f"loss scale {_fmt_scale(final)} " + ("never changed in the run" if never else f"flat over {span}"))
    fix = (
        f"raise the scale about {_fmt_num(factor)}x: loss_scale={_fmt_num(final * factor)} for a static scale, or "
        'loss_scale="dynamic" (the default) to let it find the largest safe scale; a dynamic scale stuck here needs '
        "a higher max_loss_scale or a shorter growth_interval"
    )
    summary = f"loss scale too low: heavy underflow in {', '.join(names)}, the scale {_fmt_scale(final)} not growing"
    return [Finding("scale_too_low", True, summary, tuple(lines), fix, names, window[0])], []


def _zeros_verdict(zeros: Series, below: float, scale: Series | None) -> tuple[float, float, str]:
    """A group's exact zeros judged against the loss scale: ``(mean zero fraction over the end of the run, the part
    of it counted as underflow, why)``.

    A zero is either structural (zero at any scale) or a value the half backward flushed to zero, which a larger scale
    would have kept. So the zero fraction is compared across the last ``ZEROS_CHANGES`` changes of the scale between
    logged points: unchanged, the zeros are structural (none counted); falling as the scale grows, they are flushed
    values (all counted). A logged scale is the one after the logging step's update, while the gradients were
    measured before it, so only points whose scale equals the previous point's (no change in between, none at the
    point itself) are compared. With no change to judge by, the zeros count when the group's non-zero values reach
    below the smallest normal (``SUBNORMAL_SHARE``). A group without a single non-zero gradient always counts.

    Args:
        zeros: ``mpx/zeros/<group>``.
        below: The mean of ``mpx/underflow/<group>`` over the end of the run (non-zero values below tiny).
        scale: The loss scale series (``None``: unknown).
    """
    tail = _tail(zeros)
    mean = sum(value for _, value in tail) / len(tail)
    if mean >= 1.0:
        # Not one non-zero gradient: the scales tried were all too low to keep any (the headroom reads 0).
        return mean, mean, "no gradient of the group is non-zero at any scale tried: counted as underflow"
    known: list[tuple[float, float]] = []  # (scale the gradients were measured at, zero fraction)
    if scale:
        steps = [step for step, _ in scale]
        values = [value for _, value in scale]

        def scale_at(step: int) -> float:
            return values[max(0, bisect.bisect_right(steps, step) - 1)]

        for (previous, _), (step, value) in zip(zeros, zeros[1:]):
            if scale_at(previous) == scale_at(step):
                known.append((scale_at(step), value))
    changes = [(a, b) for a, b in zip(known, known[1:]) if a[0] != b[0]][-ZEROS_CHANGES:]
    if changes:
        # Oriented so that zeros falling as the scale grows (or rising as it falls) move by a positive amount.
        moved = sum((za - zb) if sb > sa else (zb - za) for (sa, za), (sb, zb) in changes) / len(changes)
        level = sum(max(za, zb) for (_, za), (_, zb) in changes) / len(changes)
        (first, _), (last, _) = changes[0][0], changes[-1][1]
        what = f"the last {len(changes)} scale change(s), {_fmt_scale(first)} to {_fmt_scale(last)}"
        if moved > max(ZEROS_MOVE * level, ZEROS_MOVE_MIN):
            return mean, mean, (
                f"they fall as the scale grows, by {moved:.3f} on average at {what}: values flushed to zero, counted "
                "as underflow"
            )  # fmt: skip
        return mean, 0.0, f"unchanged at {what} ({moved:+.3f} on average): structural, not underflow"
    if below >= SUBNORMAL_SHARE * (1.0 - mean):
        return mean, mean, (
            "no change of the scale to judge them by, and the group's other values reach below the smallest normal: "
            "counted as underflow"
        )  # fmt: skip
    return mean, 0.0, (
        "no change of the scale to judge them by, and the group's other values stay above the smallest normal: "
        "structural, not underflow"
    )  # fmt: skip


def _heavy_underflow(
    group: str, line: str, room: dict[str, float], run_room: float | None, room_line: str, since: int
) -> Finding:
    name = group or "<root>"
    gap = f" about 2^{round(math.log2(run_room / room[group]))} times" if run_room and room.get(group) else ""
    fix = (
        f"its gradients are{gap} smaller than the largest ones, so the scale cannot rise for it: keep it in FP32 "
        f'(fp32_modules=["{name}"]) or train in bfloat16; a small weight on the loss term it feeds shrinks its '
        "gradients the same way"
    )
    return Finding("heavy_underflow", True, f"heavy underflow in module {name}", (line, room_line), fix, (name,), since)


def _unchecked_constant_scales(mpx: dict[str, Series]) -> list[Finding]:
    """Without underflow telemetry, a scale that never changed and never overflowed is worth a look: a static scale
    that is too low loses the small gradients silently."""
    found = []
    for tag in sorted(t for t in mpx if t == SCALE_TAG or t.startswith(SCALE_TAG + "/loss")):
        suffix = tag[len(SCALE_TAG) :]
        scale = mpx[tag]
        overflows = sum(value for _, value in mpx.get(OVERFLOW_TAG + suffix, []))
        if overflows or scale[0][1] > CONSTANT_SCALE_SUSPECT or any(v != scale[0][1] for _, v in scale):
            continue
        found.append(
            Finding(
                "constant_scale", False,
                f"the loss scale{suffix} stayed at {_fmt_scale(scale[0][1])} and never overflowed: if it is static, "
                "it may be too low",
                (f"mpx/loss_scale{suffix} {scale[0][1]:g} at every logged step {scale[0][0]}-{scale[-1][0]}, "
                 f"mpx/overflows{suffix} 0",),
                "in float16 a gradient below 2^-24 / scale is lost (bfloat16 needs no scale); log the underflow "
                "telemetry (mpx/underflow/*) to know, or let a dynamic scale (the default) find the largest safe one",
                (), scale[0][0], suffix,
            )
        )  # fmt: skip
    return found
