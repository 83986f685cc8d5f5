"""``lightning-mpx doctor RUN_DIR``: a diagnosis of a run's precision health from its TensorBoard scalars.

The doctor reads the ``mpx/*`` scalars a run logged (through :meth:`lightning_mpx.Amp.metrics`, so through the
Lightning loggers and ``Accelerator.log``) and reports, one finding each, with the evidence (steps and values) and a
suggested fix:

- **persistent overflow** (the scale is too high for what the model produces, or the model produces non-finite
  values at any scale): most steps overflow, the scale sits at its floor (or is static) and skipped steps grow; with
  ``mpx/overflow/<module>`` tags the modules whose gradients were non-finite, and since which step;
- **scale too low**: gradients underflow (``mpx/underflow/<group>``, and the zeros of ``mpx/zeros/<group>`` that
  move with the scale) while every group's largest gradient sits far below the half maximum (``mpx/headroom_doublings/
  <group>``) and the scale does not grow (a static scale, or a dynamic one stuck at its ceiling);
- **heavy underflow in one module**: one group's gradients underflow while the scale cannot rise because another
  group already uses the range;
- **promoted modules** (``mpx/promoted/<module>``), for information;
- **healthy** when none of the problems shows.

Exact zeros are judged apart from the non-zero values below the half's smallest normal: a zero fraction that does
not move when the scale changes is structural (rows of an embedding absent from the batch, switched-off units) and is
not underflow; one that falls as the scale grows is made of values the half backward flushed to zero, and counts (see
:func:`_zeros_verdict`). Runs written before ``mpx/zeros/<group>`` existed logged zeros inside
``mpx/underflow/<group>``; they are judged as before. Runs written before the underflow and per-module tags existed
are diagnosed from ``mpx/loss_scale``, ``mpx/overflows`` and ``mpx/skipped_steps`` alone. The states are judged on the
end of the run (the trailing steps), so a scale that backed off at the start and settled is healthy. The thresholds are
the constants below.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_mpx.health.events import describe_restarts, read_run, unprefixed
from lightning_mpx.health.plot import (
    FIRST_OVERFLOW_PREFIX,
    LOSS_TAGS,
    MODULE_OVERFLOW_PREFIX,
    OVERFLOW_TAG,
    SCALE_TAG,
    UNDERFLOW_PREFIX,
    ZEROS_PREFIX,
    headroom_ratios,
)

SKIPPED_TAG = "mpx/skipped_steps"
PROMOTED_PREFIX = "mpx/promoted/"

#: An interval between two logged points "overflows on most steps" when at least this fraction of its steps
#: overflowed (``mpx/overflows`` divided by the steps the interval covers).
OVERFLOW_MOST_STEPS = 0.5
#: Persistent overflow: the intervals that overflow on most steps cover at least this many steps at the end of the
#: run (a dynamic scale backing off from a high start overflows a few steps in a row: 8 from 2^24 down to 2^16).
PERSISTENT_MIN_STEPS = 10
#: A module is named as a culprit of persistent overflow when its gradients were non-finite in at least this
#: fraction of the overflow steps.
MODULE_SHARE = 0.5
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
#: The end of the run that states are judged on: this fraction of the logged points, and at least
#: ``TAIL_MIN_POINTS`` of them.
TAIL_FRACTION = 0.25
TAIL_MIN_POINTS = 3

#: Exit statuses of ``lightning-mpx doctor``.
EXIT_HEALTHY, EXIT_PROBLEM, EXIT_NO_TAGS = 0, 1, 2

Series = list[tuple[int, float]]


class NoMixedPrecisionTagsError(ValueError):
    """The run folder holds TensorBoard events but none of the ``mpx/*`` scalars the doctor reads."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding of the doctor.

    Attributes:
        kind: Problems: ``"persistent_overflow"``, ``"scale_too_low"``, ``"heavy_underflow"``. Information:
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


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found in one run.

    Attributes:
        run_dir: The run folder.
        first_step, last_step: The steps the ``mpx/*`` scalars span.
        findings: Problems first, then information; a healthy run has one ``"healthy"`` finding.
        notes: What the doctor could not judge (tags this run does not have).
    """

    run_dir: str
    first_step: int
    last_step: int
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        """Whether no finding is a problem."""
        return not any(finding.problem for finding in self.findings)

    @property
    def exit_status(self) -> int:
        """``0`` when healthy, ``1`` when a problem was found."""
        return EXIT_HEALTHY if self.healthy else EXIT_PROBLEM

    def to_dict(self) -> dict[str, Any]:
        """The diagnosis as plain JSON-able data (what ``--json`` prints)."""
        return {
            "run_dir": self.run_dir,
            "steps": [self.first_step, self.last_step],
            "healthy": self.healthy,
            "exit_status": self.exit_status,
            "findings": [finding.to_dict() for finding in self.findings],
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """The human-readable report: one block per finding."""
        lines = [f"lightning-mpx doctor {self.run_dir} (steps {self.first_step}-{self.last_step})"]
        for finding in self.findings:
            label = "PROBLEM" if finding.problem else "OK" if finding.kind == "healthy" else "INFO"
            lines.append(f"{label}: {finding.summary}")
            lines.extend(f"  - {line}" for line in finding.evidence)
            if finding.fix:
                lines.append(f"  {'fix' if finding.problem else 'hint'}: {finding.fix}")
        lines.extend(f"note: {note}" for note in self.notes)
        problems = sum(finding.problem for finding in self.findings)
        lines.append(
            "diagnosis: healthy" if not problems else f"diagnosis: {problems} problem{'s' * (problems > 1)} found"
        )
        return "\n".join(lines)


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Read the TensorBoard events under ``run_dir`` and diagnose the run.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds no event files.
        NoMixedPrecisionTagsError: the events hold no ``mpx/*`` scalars.
    """
    read = read_run(run_dir)
    series, prefix = unprefixed(read.series)
    diagnosis = diagnose_scalars(series, str(run_dir))
    restarted = describe_restarts(read.restarts)  # the points judged are the latest run's
    restarted += [f"the mpx/* scalars were logged as {prefix}mpx/*: read without {prefix!r}."] if prefix else []
    diagnosis = dataclasses.replace(diagnosis, notes=(*diagnosis.notes, *restarted))
    folders = sorted({str(path.parent) for path in Path(run_dir).rglob("events.out.tfevents.*")})
    if len(folders) > 1:
        # read_run merges them in the order written: fine for one run's split files, not for several runs
        # (TensorBoardLogger's version_0, version_1) logged at once.
        shown = ", ".join(folders[:4]) + (f" and {len(folders) - 4} more" if len(folders) > 4 else "")
        note = (
            f"RUN_DIR holds event files in {len(folders)} folders ({shown}), read as one run; if they are separate "
            "runs, point the doctor at one."
        )
        diagnosis = dataclasses.replace(diagnosis, notes=(*diagnosis.notes, note))
    return diagnosis


def diagnose_scalars(series: dict[str, Series], run_dir: str = "") -> Diagnosis:
    """Diagnose a run from its scalars (``tag -> [(step, value)]``, as :func:`lightning_mpx.health.plot.read_scalars`).

    Raises:
        NoMixedPrecisionTagsError: ``series`` holds no ``mpx/*`` scalars.
    """
    mpx = {tag: points for tag, points in series.items() if tag.startswith("mpx/") and points}
    shown = ", ".join(sorted(series, key=lambda t: ("mpx/" not in t, t))[:8]) or "none"  # a renamed mpx/* first
    if not mpx:
        raise NoMixedPrecisionTagsError(
            f"RUN_DIR={run_dir!r} holds no mpx/* scalars (scalars found: {shown}); was it logged by a run with "
            "MixedPrecisionPlugin or lightning_mpx.accelerate.Accelerator and a logger?"
        )
    if not any(tag == SCALE_TAG or tag.startswith(SCALE_TAG + "/loss") for tag in mpx):
        # Renamed (mpx/loss_scale/rank0): nothing could be judged, which is not "healthy".
        raise NoMixedPrecisionTagsError(
            f"RUN_DIR={run_dir!r} holds mpx/* scalars but no {SCALE_TAG} (scalars found: {shown}): the doctor reads "
            "the names Amp.metrics() gives; log them unchanged, without a suffix or prefix (per rank: rank 0's)."
        )
    steps = [step for points in mpx.values() for step, _ in points]
    loss = next((series[tag] for tag in LOSS_TAGS if tag in series), None)
    module_overflows = _by_suffix(mpx, MODULE_OVERFLOW_PREFIX)
    first_overflows = _by_suffix(mpx, FIRST_OVERFLOW_PREFIX)
    problems: list[Finding] = []
    info: list[Finding] = []
    healthy_evidence: list[str] = []
    for tag in sorted(t for t in mpx if t == SCALE_TAG or t.startswith(SCALE_TAG + "/loss")):
        suffix = tag[len(SCALE_TAG) :]
        overflow = _persistent_overflow(mpx, suffix, module_overflows, loss, first_overflows)
        if overflow is not None:
            problems.append(overflow)
        else:
            healthy_evidence.append(_scale_summary(mpx, suffix))
    underflow_findings, underflow_evidence = _underflow(mpx)
    for finding in underflow_findings:
        (problems if finding.problem else info).append(finding)
    healthy_evidence.extend(underflow_evidence)
    info.extend(_promoted(mpx, module_overflows))
    notes = []
    if not _by_suffix(mpx, UNDERFLOW_PREFIX):
        info.extend(_unchecked_constant_scales(mpx))
        notes.append(
            "no mpx/underflow/* or mpx/headroom_doublings/* scalars in this run: underflow (a scale that is too low) "
            "could not be judged."
        )
    overflowed = any(value > 0 for tag, points in mpx.items() if tag.startswith(OVERFLOW_TAG) for _, value in points)
    if overflowed and not module_overflows:
        notes.append("no mpx/overflow/<module> scalars in this run: its overflows cannot be traced to modules.")
    findings: list[Finding] = problems
    if not problems:
        summary = "healthy: no persistent overflow, no heavy underflow"
        findings = [Finding("healthy", False, summary, tuple(healthy_evidence))]
    return Diagnosis(run_dir, min(steps), max(steps), tuple(findings + info), tuple(notes))


# -- persistent overflow ------------------------------------------------------------------------------------------
def _persistent_overflow(
    mpx: dict[str, Series],
    suffix: str,
    module_overflows: dict[str, Series],
    loss: Series | None,
    first_overflows: dict[str, Series] | None = None,
) -> Finding | None:
    scale = mpx[SCALE_TAG + suffix]
    overflows = mpx.get(OVERFLOW_TAG + suffix, [])
    if not overflows:
        return None
    logged = [step for step, _ in overflows]  # the logging steps: each count covers the steps since the previous
    starts = _interval_starts(overflows, logged, counts=True)
    spans = [step - start + 1 for (step, _), start in zip(overflows, starts)]
    streak = _trailing(overflows, lambda i: overflows[i][1] >= OVERFLOW_MOST_STEPS * spans[i])
    if streak is None:
        return None
    final = scale[-1][1]
    flat = _trailing(scale, lambda i: scale[i][1] == final)
    since = starts[streak]
    last = overflows[-1][0]
    bad = _trailing(loss, lambda i: not math.isfinite(loss[i][1])) if loss is not None else None
    forward = loss is not None and bad is not None and loss[bad][0] <= last
    if last - since + 1 < PERSISTENT_MIN_STEPS and not forward:
        return None  # a short burst, or a scale backing off from a high start (whose loss is finite)
    count = sum(value for _, value in overflows[streak:])
    evidence = [
        f"{count:g} of the {last - since + 1} steps {since}-{last} overflowed (mpx/overflows{suffix}): "
        "the steps were skipped"
    ]
    if flat == 0:
        evidence.append(f"loss scale {_fmt_scale(final)} never changed in the run (static, or stuck at its floor)")
        state = "the loss scale cannot go lower"
    elif flat is not None and flat < len(scale) - 1:
        floor_since = _interval_starts(scale)[flat]
        evidence.append(
            f"loss scale {_fmt_scale(final)} unchanged since step {floor_since}: at its floor, it cannot go lower"
        )
        state = "the loss scale is at its floor"
    else:
        # No point before the streak (it began the run): its first point, at its own step (not "before step 0").
        step, before = next(((step, value) for step, value in reversed(scale) if step < since), scale[0])
        evidence.append(
            f"loss scale falling: {_fmt_scale(before)} "
            f"{f'before step {since}' if step < since else f'at step {step}'}, {_fmt_scale(final)} at step {last}; "
            "each overflow lowers it on its way to min_loss_scale"
        )
        state = "the loss scale is collapsing"
    skipped = mpx.get(SKIPPED_TAG + suffix)
    if skipped:
        # Unknown without a point before: a resumed run's total counts the steps before its first (not 0).
        before = next((value for step, value in reversed(skipped) if step < since), None)
        line = f"skipped steps: {skipped[-1][1]:g} at step {skipped[-1][0]}"
        evidence.append(line + (f", {before:g} before step {since}" if since and before is not None else ""))
    if forward and loss is not None and bad is not None:
        evidence.append(
            f"the logged loss is {loss[-1][1]} since step {loss[bad][0]}: the forward already produces "
            "non-finite values"
        )
    # A forward overflow makes every gradient non-finite; where the forward was watched, the first module whose
    # output went non-finite (mpx/overflow_first/<module>) is the culprit, and the gradient counts are not.
    watched = {
        module: points
        for module, points in (first_overflows or {}).items()
        if any(step >= since and value > 0 for step, value in points)
    }
    source, source_prefix = (watched, FIRST_OVERFLOW_PREFIX) if watched else (module_overflows, MODULE_OVERFLOW_PREFIX)
    culprits: list[tuple[int, float, str]] = []
    for module, points in source.items():
        in_window = [(step, value) for step, value in points if step >= since]
        hits = sum(value for _, value in in_window)
        if count and (hits >= MODULE_SHARE * count or (watched and hits > 0)):
            # A module's tag appears at the first logging step after its first overflow: its counts cover the
            # run's logging intervals, not the steps since its own previous point.
            module_starts = _interval_starts(points, logged, counts=True)
            module_spans = [step - begin + 1 for (step, _), begin in zip(points, module_starts)]
            start = _trailing(points, lambda i: points[i][1] >= OVERFLOW_MOST_STEPS * module_spans[i])
            culprits.append((module_starts[start] if start is not None else since, -hits, module))
    culprits.sort()
    modules = tuple(name or "<root>" for _, _, name in culprits)
    for first, hits, module in culprits[:8]:
        what = "the first non-finite forward output" if watched else "non-finite gradients"
        evidence.append(
            f"{source_prefix}{module}: {what} in {-hits:g} of those {count:g} overflow steps, since step {first}"
        )
    if culprits:
        if not watched:  # a watched module's tag starts with the watch (at the floor), not with the overflows
            since = min(first for first, _, _ in culprits)
        where = f"module {modules[0]}" if len(modules) == 1 else f"modules {', '.join(modules[:4])}" + (
            f" and {len(modules) - 4} more" if len(modules) > 4 else ""
        )
        summary = f"persistent overflow in {where} since step {since}"
        pin = ", ".join(f'"{m}"' for m in modules[:4])
        fix = (
            f"keep {'it' if len(modules) == 1 else 'them'} in FP32 (fp32_modules=[{pin}]), or let lightning_mpx do it "
            'at the floor (on_floor="promote"), or train in bfloat16'
        )
        if len(modules) > 1:
            fix += (
                "; when a forward overflow poisons every gradient, the first module to go non-finite is the culprit: "
                "amp.last_overflow.first_module (diagnose_overflows=True) names it"
            )
    else:
        summary = f"persistent overflow since step {since}: {state} and most steps are skipped"
        fix = (
            "find the module: the overflow warnings and amp.last_overflow name the parameters with non-finite "
            "gradients; keep it in FP32 (fp32_modules=[...]) or on_floor=\"promote\", or train in bfloat16"
        )
    if forward:
        fix += "; check the data for inf/NaN too"
    else:
        fix += "; a learning rate that is too high or exploding gradients look the same: lower it or clip"
    return Finding(
        "persistent_overflow", True, summary + (f" (loss scale{suffix})" if suffix else ""), tuple(evidence), fix,
        modules, since, suffix,
    )  # fmt: skip


def _scale_summary(mpx: dict[str, Series], suffix: str) -> str:
    scale = [value for _, value in mpx[SCALE_TAG + suffix]]
    overflows = mpx.get(OVERFLOW_TAG + suffix, [])
    total = sum(value for _, value in overflows)
    steps = mpx[SCALE_TAG + suffix][-1][0] - _interval_starts(mpx[SCALE_TAG + suffix])[0] + 1
    skipped = mpx.get(SKIPPED_TAG + suffix)
    text = (
        f"loss scale{suffix} {_fmt_scale(scale[0])} throughout"
        if min(scale) == max(scale)
        else f"loss scale{suffix} between {_fmt_scale(min(scale))} and {_fmt_scale(max(scale))}, "
        f"{_fmt_scale(scale[-1])} at the end"
    )
    text += f"; {total:g} overflow steps in {steps} ({100 * total / steps:.1f}%)"
    if skipped:
        text += f", {skipped[-1][1]:g} skipped in all"
    return text


# -- underflow ----------------------------------------------------------------------------------------------------
def _underflow(mpx: dict[str, Series]) -> tuple[list[Finding], list[str]]:
    """The underflow findings, and the evidence lines a healthy finding shows."""
    # A group that runs in FP32 (promoted or pinned) keeps its small gradients: its underflow is not judged.
    fp32 = [module for module, points in _by_suffix(mpx, PROMOTED_PREFIX).items() if points[-1][1] >= 0.5]

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
            )
        return mean, 0.0, f"unchanged at {what} ({moved:+.3f} on average): structural, not underflow"
    if below >= SUBNORMAL_SHARE * (1.0 - mean):
        return mean, mean, (
            "no change of the scale to judge them by, and the group's other values reach below the smallest normal: "
            "counted as underflow"
        )
    return mean, 0.0, (
        "no change of the scale to judge them by, and the group's other values stay above the smallest normal: "
        "structural, not underflow"
    )


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


# -- promotion ----------------------------------------------------------------------------------------------------
def _promoted(mpx: dict[str, Series], module_overflows: dict[str, Series]) -> list[Finding]:
    found = []
    for module, points in sorted(_by_suffix(mpx, PROMOTED_PREFIX).items()):
        since = next((step for step, value in points if value >= 0.5), None)
        if since is not None:
            found.append((since, module))
    if not found:
        return []
    found.sort()
    names = tuple(name or "<root>" for _, name in found)
    evidence = []
    for since, module in found:
        line = f"mpx/promoted/{module or '<root>'}: 1 since step {since}"
        overflows = [(step, value) for step, value in module_overflows.get(module, []) if value > 0]
        if overflows:
            after = sum(value for step, value in overflows if step > since)
            total = sum(value for _, value in overflows)
            line += f"; its gradients overflowed in {total:g} steps up to step {overflows[-1][0]}"
            line += f", {after:g} of them after the promotion" if after else ", none after the promotion"
        evidence.append(line)
    return [
        Finding(
            "promoted", False,
            f"running in FP32: {', '.join(names)} (promoted at the loss-scale floor, or pinned with fp32_modules)",
            tuple(evidence), None, names, found[0][0],
        )
    ]  # fmt: skip


# -- helpers ------------------------------------------------------------------------------------------------------
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


def to_json(diagnosis: Diagnosis) -> str:
    """``diagnosis`` as indented JSON (what ``lightning-mpx doctor --json`` prints)."""
    return json.dumps(diagnosis.to_dict(), indent=2)
