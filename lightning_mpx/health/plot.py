"""``lightning-mpx plot RUN_DIR``: the loss-scale curve with overflow events marked, beside the training loss; and,
when the run logged them, the underflow, exact zeros and headroom per group and the overflows per module."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from lightning_mpx.common.imports import require
from lightning_mpx.health.events import read_run, unprefixed

SCALE_TAG = "mpx/loss_scale"
OVERFLOW_TAG = "mpx/overflows"
#: The logged loss, the first of these a run has: first with the ``_step`` Lightning adds to a value logged with
#: ``on_epoch=True`` (``self.log("train_loss", loss, on_epoch=True)`` writes ``train_loss_step`` and
#: ``train_loss_epoch``), a loss of each step for sure, before a plain name that may hold an epoch's mean
#: (``self.log("loss", loss, on_step=False, on_epoch=True)``: one bad batch makes it NaN). The ``_epoch`` ones not read.
LOSS_TAGS = ("train/loss_step", "train_loss_step", "loss_step", "train/loss", "train_loss", "loss")
UNDERFLOW_PREFIX = "mpx/underflow/"
#: Exact zeros per group (lightning_mpx.health.telemetry); runs written before it counted them in mpx/underflow/*.
ZEROS_PREFIX = "mpx/zeros/"
#: Headroom per group in powers of two, ``log2(half max / largest |scaled gradient|)``: how many more doublings of the
#: scale it takes to overflow (0 or less: overflowed; lightning_mpx.health.telemetry).
HEADROOM_DOUBLINGS_PREFIX = "mpx/headroom_doublings/"
#: Runs written before it: the ratio ``largest |scaled gradient| / half max``, which TensorBoard's float32 flushed to 0
#: under bfloat16 for gradients below about 5e-7. Read still (see :func:`headroom_ratios`).
HEADROOM_PREFIX = "mpx/headroom/"
MODULE_OVERFLOW_PREFIX = "mpx/overflow/"
#: Watched forward overflows by the first module whose output went non-finite (lightning_mpx.health.forensics).
FIRST_OVERFLOW_PREFIX = "mpx/overflow_first/"
_MAX_CURVES = 8  # per panel; the rest are left out (the title says how many)


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``run_dir``, as ``tag -> [(step, value)]``, read in
    the order written: a run whose steps started again keeps the points written since
    (:func:`lightning_mpx.health.events.read_run`, which also says where); ``mpx/*`` tags logged under one prefix
    (a logger's ``prefix=``: ``train-mpx/loss_scale``) are given without it."""
    return unprefixed(read_run(run_dir).series)[0]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a PNG of the run's loss scale (log scale, overflows marked) and training loss; returns its path.

    With several loss scalers (``mpx/loss_scale/loss0``, ...) each gets its own curve. When the run logged them, two
    more panels: per group the fraction of gradient elements below the half's smallest normal and not zero
    (``mpx/underflow/*``, solid), the fraction of exact zeros (``mpx/zeros/*``, dotted) and the headroom
    (``mpx/headroom_doublings/*``, drawn as max |grad| / half max: dashed, right axis); and the overflow steps per
    module (``mpx/overflow/*``, cumulative).
    """
    matplotlib = require("matplotlib", extra="demo", feature="lightning-mpx plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(read_scalars(run_dir), str(run_dir))
    path = Path(out) if out is not None else Path(run_dir) / "loss_scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_figure(series: dict[str, list[tuple[int, float]]], title: str = "") -> Any:
    """The figure :func:`plot_run` saves, from scalars as :func:`read_scalars` returns them (a matplotlib
    ``Figure``; the caller closes it)."""
    require("matplotlib", extra="demo", feature="lightning-mpx plot")
    import matplotlib.pyplot as plt

    scale_tags = sorted(t for t in series if t.startswith(SCALE_TAG))
    if not scale_tags:
        raise ValueError(
            f"RUN_DIR={title!r} has no '{SCALE_TAG}' scalars; was it written by a run with "
            "MixedPrecisionPlugin and a logger?"
        )
    underflow = _by_prefix(series, UNDERFLOW_PREFIX)
    zeros = _by_prefix(series, ZEROS_PREFIX)
    module_overflows = _by_prefix(series, MODULE_OVERFLOW_PREFIX)
    panels = 2 + bool(underflow or zeros) + bool(module_overflows)
    rows = (panels + 1) // 2
    fig, grid = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for extra in axes[panels:]:
        extra.remove()
    ax_scale, ax_loss, *more = axes[:panels]
    _scale_panel(ax_scale, series, scale_tags)
    loss_tag = next((t for t in LOSS_TAGS if t in series), None)
    if loss_tag is not None:
        steps, values = zip(*series[loss_tag])
        ax_loss.plot(steps, values, color="tab:green")
        bad = [step for step, value in series[loss_tag] if not math.isfinite(value)]
        if bad:  # a line plot leaves them out silently: mark them at the lowest finite value
            floor = min((v for v in values if math.isfinite(v)), default=0.0)
            ax_loss.scatter(bad, [floor] * len(bad), marker="x", color="tab:red", label="loss not finite (nan/inf)")
            ax_loss.legend(loc="best", fontsize="small")
        ax_loss.set_title(f"Training loss ({loss_tag})")
    else:
        ax_loss.set_title("Training loss (not logged)")
    ax_loss.set_xlabel("step")
    ax_loss.grid(True, alpha=0.3)
    if underflow or zeros:
        _underflow_panel(more.pop(0), underflow, zeros, headroom_ratios(series))
    if module_overflows:
        first_step = min(step for tag in scale_tags for step, _ in series[tag][:1])
        _module_overflow_panel(more.pop(0), module_overflows, first_step)
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    return fig


def _scale_panel(ax: Any, series: dict[str, list[tuple[int, float]]], scale_tags: list[str]) -> None:
    for tag in scale_tags:
        suffix = tag[len(SCALE_TAG) :]
        steps, values = zip(*series[tag])
        ax.step(steps, values, where="post", label=f"loss scale{suffix}")
        overflow_steps = [s for s, v in series.get(OVERFLOW_TAG + suffix, []) if v > 0]
        scale_at = dict(series[tag])
        if overflow_steps:
            ax.scatter(
                overflow_steps,
                [scale_at.get(s, float("nan")) for s in overflow_steps],
                marker="v",
                color="tab:red",
                zorder=3,
                label=f"overflow{suffix} (step skipped)",
            )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_title("Loss scale")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)


def _underflow_panel(
    ax: Any,
    underflow: dict[str, list[tuple[int, float]]],
    zeros: dict[str, list[tuple[int, float]]],
    headroom: dict[str, list[tuple[int, float]]],
) -> None:
    twin = ax.twinx() if headroom else None
    groups = sorted(set(underflow) | set(zeros))[:_MAX_CURVES]
    for index, group in enumerate(groups):
        color, name = f"C{index % 10}", group or "<root>"
        if group in underflow:
            steps, values = zip(*underflow[group])
            ax.plot(steps, values, color=color, label=f"{name} underflow")
        if group in zeros:
            steps, values = zip(*zeros[group])
            ax.plot(steps, values, color=color, linestyle=":", label=f"{name} zeros")
        if twin is not None and group in headroom:
            steps, values = zip(*[(s, v) for s, v in headroom[group] if v > 0] or [(0, float("nan"))])
            twin.plot(steps, values, color=color, linestyle="--", alpha=0.7, label=f"{name} headroom")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    if zeros:
        ax.set_ylabel("gradient elements (fraction)")
        ax.set_title(
            "Underflow (solid: non-zero, below the half's tiny), exact zeros (dotted),\n"
            "headroom (dashed, right: max |grad| / half max)"
        )
    else:  # a run written before mpx/zeros/*: its underflow counted the zeros
        ax.set_ylabel("gradient elements zero or subnormal (fraction)")
        ax.set_title("Underflow (solid) and headroom (dashed, right: max |grad| / half max)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", fontsize="x-small")
    if twin is not None:
        twin.set_yscale("log", base=2)
        twin.axhline(1.0, color="tab:red", linewidth=0.8, linestyle=":")  # at or above: overflow
        twin.set_ylabel("headroom (log2)")
        twin.legend(loc="center right", fontsize="x-small")


def _module_overflow_panel(ax: Any, module_overflows: dict[str, list[tuple[int, float]]], first_step: int) -> None:
    from matplotlib.ticker import MaxNLocator

    totals = {module: sum(v for _, v in points) for module, points in module_overflows.items()}
    shown = sorted(totals, key=lambda m: (-totals[m], m))[:_MAX_CURVES]
    for module in shown:
        # A module's tag starts at its first overflow: its curve starts at 0 from the run's first logged step.
        steps = [first_step] + [s for s, _ in module_overflows[module]]
        cumulative = [0.0, *itertools.accumulate(v for _, v in module_overflows[module])]
        ax.step(steps, cumulative, where="post", label=f"{module or '<root>'} ({totals[module]:g})")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    hidden = len(totals) - len(shown)
    ax.set_xlabel("step")
    ax.set_ylabel("overflow steps (cumulative)")
    ax.set_title("Overflows by module" + (f" (top {len(shown)}; {hidden} more not drawn)" if hidden else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="x-small")


def headroom_ratios(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Each group's headroom as the ratio ``largest |scaled gradient| / half max`` (1 or more: overflow; 0: no
    non-zero gradient) in Python floats, whose range holds bfloat16's smallest ratios: ``2 ** -doublings`` from
    ``mpx/headroom_doublings/<group>``, or ``mpx/headroom/<group>`` as a run written before it logged it."""
    out = _by_prefix(series, HEADROOM_PREFIX)
    for group, points in _by_prefix(series, HEADROOM_DOUBLINGS_PREFIX).items():
        out[group] = [(step, 2.0**-value) for step, value in points]  # -inf (overflow): inf; inf (zeros): 0
    return out


def _by_prefix(series: dict[str, list[tuple[int, float]]], prefix: str) -> dict[str, list[tuple[int, float]]]:
    return {tag[len(prefix) :]: points for tag, points in series.items() if tag.startswith(prefix) and points}
