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
not move when the scale changes is structural (rows of an embedding absent from the batch, switched-off units) and
is not underflow; one that falls as the scale grows is made of values the half backward flushed to zero, and counts
(see :func:`~lightning_mpx.health.underflow_checks._zeros_verdict`). Runs written before ``mpx/zeros/<group>``
existed logged zeros inside ``mpx/underflow/<group>``; they are judged as before. Runs written before the underflow
and per-module tags existed are diagnosed from ``mpx/loss_scale``, ``mpx/overflows`` and ``mpx/skipped_steps``
alone. The states are judged on the end of the run (the trailing steps), so a scale that backed off at the start and
settled is healthy. The thresholds are constants: the overflow ones below, the underflow ones in
:mod:`lightning_mpx.health.underflow_checks` (with those checks; re-exported here).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from lightning_mpx.health.events import describe_restarts, read_run, unprefixed
from lightning_mpx.health.findings import (  # noqa: F401  (re-exported: the import path is kept)
    PROMOTED_PREFIX,
    SKIPPED_TAG,
    TAIL_FRACTION,
    TAIL_MIN_POINTS,
    Finding,
    Series,
    _by_suffix,
    _fmt_scale,
    _interval_starts,
    _trailing,
)
from lightning_mpx.health.loss_checks import non_finite_loss
from lightning_mpx.health.plot import (
    FIRST_OVERFLOW_PREFIX,
    LOSS_TAGS,
    MODULE_OVERFLOW_PREFIX,
    OVERFLOW_TAG,
    SCALE_TAG,
    UNDERFLOW_PREFIX,
)
from lightning_mpx.health.underflow_checks import (  # noqa: F401  (re-exported: the import path is kept)
    CONSTANT_SCALE_SUSPECT,
    HALF_DTYPE_SPLIT,
    HEADROOM_LOW,
    HEADROOM_TARGET,
    SUBNORMAL_SHARE,
    UNDERFLOW_HEAVY,
    ZEROS_CHANGES,
    ZEROS_MOVE,
    ZEROS_MOVE_MIN,
    _unchecked_constant_scales,
    _underflow,
    logged_half_dtype,
)

#: An interval between two logged points "overflows on most steps" when at least this fraction of its steps
#: overflowed (``mpx/overflows`` divided by the steps the interval covers).
OVERFLOW_MOST_STEPS = 0.5
#: Persistent overflow: the intervals that overflow on most steps cover at least this many steps at the end of the
#: run (a dynamic scale backing off from a high start overflows a few steps in a row: 8 from 2^24 down to 2^16).
PERSISTENT_MIN_STEPS = 10
#: A module is named as a culprit of persistent overflow when its gradients were non-finite in at least this
#: fraction of the overflow steps.
MODULE_SHARE = 0.5

#: Exit statuses of ``lightning-mpx doctor``.
EXIT_HEALTHY, EXIT_PROBLEM, EXIT_NO_TAGS = 0, 1, 2


class NoMixedPrecisionTagsError(ValueError):
    """The run folder holds TensorBoard events but none of the ``mpx/*`` scalars the doctor reads."""


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
            + (
                " If it had both: the mpx/* scalars are logged at training steps, every log_every_n_steps (the "
                "Trainer's default: 50); a shorter run logs none (an epoch's end, validation and hp_metric log theirs "
                "still); lower log_every_n_steps."
                if series
                else " No scalar was logged at all: a run shorter than its logging interval (Trainer(log_every_n_steps="
                "50), the default, with fewer steps) logs none; lower log_every_n_steps."
            )
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
    half = logged_half_dtype(mpx)
    for tag in sorted(t for t in mpx if t == SCALE_TAG or t.startswith(SCALE_TAG + "/loss")):
        suffix = tag[len(SCALE_TAG) :]
        overflow = _persistent_overflow(mpx, suffix, module_overflows, loss, first_overflows, half)
        if overflow is not None:
            problems.append(overflow)
        else:
            healthy_evidence.append(_scale_summary(mpx, suffix))
    overflow_counts = [
        points for tag, points in mpx.items() if tag == OVERFLOW_TAG or tag.startswith(OVERFLOW_TAG + "/loss")
    ]
    if not problems and (broken := non_finite_loss(loss, PERSISTENT_MIN_STEPS, overflow_counts)) is not None:
        problems.append(broken)  # a loss NaN to the end that no overflow explains (bfloat16, a static scale)
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
    half: str | None = None,
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
    count = sum(value for _, value in overflows[streak:])
    # One overflowing step with a non-finite loss is one bad batch (skipped: a burst), not a forward that stays broken.
    if last - since + 1 < PERSISTENT_MIN_STEPS and not (forward and count >= 2):
        return None  # a short burst, or a scale backing off from a high start (whose loss is finite)
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
        where = (
            f"module {modules[0]}"
            if len(modules) == 1
            else f"modules {', '.join(modules[:4])}" + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
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
            'gradients; keep it in FP32 (fp32_modules=[...]) or on_floor="promote", or train in bfloat16'
        )
    if forward:
        fix += "; check the data for inf/NaN too"
    else:
        fix += "; a learning rate that is too high or exploding gradients look the same: lower it or clip"
    if half == "bfloat16":  # told by the run's headroom: FP32 and bfloat16 would not help there
        fix = (
            "this run is bfloat16 (its mpx/headroom_doublings put the half maximum at 2^128), whose range is FP32's: "
            'FP32 overflows too (fp32_modules and on_floor="promote" do not help): lower the learning rate or clip, '
            "and check the data and the weights for inf/NaN"
        )
    elif flat == 0 and final == 1.0 and half is None:  # bfloat16's static scale, or float16's: both told
        fix = (
            "a scale of 1 at every logged step is a bfloat16 run's (or a static float16 scale of 1): in bfloat16, FP32 "
            "has the same range and overflows too (fp32_modules does not help): lower the learning rate or clip, and "
            f"check the data and the weights for inf/NaN; in float16: {fix}"
        )
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


def to_json(diagnosis: Diagnosis) -> str:
    """``diagnosis`` as indented JSON (what ``lightning-mpx doctor --json`` prints)."""
    return json.dumps(diagnosis.to_dict(), indent=2)
