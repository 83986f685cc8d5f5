"""``lightning-mpx plot RUN_DIR``: the loss-scale curve with overflow events marked, beside the training loss."""

from __future__ import annotations

from pathlib import Path

from lightning_mpx._imports import require

SCALE_TAG = "mpx/loss_scale"
OVERFLOW_TAG = "mpx/overflows"
LOSS_TAGS = ("train/loss", "train_loss", "loss")


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``run_dir``, as ``tag -> [(step, value)]``."""
    accumulator_module = require(
        "tensorboard.backend.event_processing.event_accumulator", extra="demo", feature="lightning-mpx plot"
    )
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"RUN_DIR={str(run)!r} does not exist.")
    folders = sorted({p.parent for p in run.rglob("events.out.tfevents.*")})
    if not folders:
        raise FileNotFoundError(f"RUN_DIR={str(run)!r} holds no TensorBoard event files (events.out.tfevents.*).")
    series: dict[str, dict[int, float]] = {}
    for folder in folders:
        events = accumulator_module.EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                series.setdefault(tag, {})[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in series.items()}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a PNG of the run's loss scale (log scale, overflows marked) and training loss; returns its path.

    With several loss scalers (``mpx/loss_scale/loss0``, ...) each gets its own curve.
    """
    matplotlib = require("matplotlib", extra="demo", feature="lightning-mpx plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_scalars(run_dir)
    scale_tags = sorted(t for t in series if t.startswith(SCALE_TAG))
    if not scale_tags:
        raise ValueError(
            f"RUN_DIR={str(run_dir)!r} has no '{SCALE_TAG}' scalars; was it written by a run with "
            "MixedPrecisionPlugin and a logger?"
        )
    loss_tag = next((t for t in LOSS_TAGS if t in series), None)
    fig, (ax_scale, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2))
    for tag in scale_tags:
        suffix = tag[len(SCALE_TAG) :]
        steps, values = zip(*series[tag])
        ax_scale.step(steps, values, where="post", label=f"loss scale{suffix}")
        overflow_steps = [s for s, v in series.get(OVERFLOW_TAG + suffix, []) if v > 0]
        scale_at = dict(series[tag])
        if overflow_steps:
            ax_scale.scatter(
                overflow_steps,
                [scale_at.get(s, float("nan")) for s in overflow_steps],
                marker="v",
                color="tab:red",
                zorder=3,
                label=f"overflow{suffix} (step skipped)",
            )
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_xlabel("step")
    ax_scale.set_title("Loss scale")
    ax_scale.legend(loc="best", fontsize="small")
    ax_scale.grid(True, alpha=0.3)
    if loss_tag is not None:
        steps, values = zip(*series[loss_tag])
        ax_loss.plot(steps, values, color="tab:green")
        ax_loss.set_title(f"Training loss ({loss_tag})")
    else:
        ax_loss.set_title("Training loss (not logged)")
    ax_loss.set_xlabel("step")
    ax_loss.grid(True, alpha=0.3)
    fig.suptitle(str(run_dir), fontsize="small")
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "loss_scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
