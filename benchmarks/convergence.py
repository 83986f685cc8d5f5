"""Numerical fidelity: the demo's character-level language model at O0-O3, float16 and bfloat16, several seeds.

Every variant trains :class:`lightning_mpx.demo.CharTransformer` through Lightning and ``MixedPrecisionPlugin`` for
the same step budget on the same data (the seed picks the initial weights and the batch order, and each seed is
shared by all variants). O0 ignores the half dtype, so it runs once per seed. The final validation loss of each
variant (mean and spread over the seeds) is compared with O0's: O1 and O2 must be within ``--tolerance`` (2 %).
O3 (pure half, no master weights, Apex's static scale 1.0) is reported as it comes; its overflows are counted as
skipped steps instead of stopping the run (``on_floor="continue"``).

    python benchmarks/convergence.py [--steps 200] [--seeds 0 1 2] [--quick] [--out PATH] [--plot PATH]

Writes JSON (default ``benchmarks/results/convergence.json``) and a PNG of the validation curves, mean over the seeds
(default ``docs/convergence.png``; ``--plot ''`` skips it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import _harness  # benchmarks/ is on sys.path when a script runs
import torch

LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = ("float16", "bfloat16")
#: Variants whose final validation loss must match O0's within the tolerance.
GATED_LEVELS = ("O1", "O2")


def variant_names(levels: tuple[str, ...] | list[str], dtypes: tuple[str, ...] | list[str]) -> list[str]:
    """``O0`` once, then ``<level>-<dtype>`` for every other level and dtype."""
    names = []
    for level in levels:
        if level == "O0":
            names.append("O0")
        else:
            names.extend(f"{level}-{dtype}" for dtype in dtypes)
    return names


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric",
                 "lightning.fabric.utilities.rank_zero", "lightning_mpx"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_variant(name: str, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    """Train one variant with one seed; returns its summary (final loss, curve, skipped steps, final scale)."""
    from lightning_mpx.demo import DemoConfig, train

    level, _, dtype = name.partition("-")
    plugin_kwargs: dict[str, Any] = {"on_floor": "continue"} if level == "O3" else {}
    config = DemoConfig(
        opt_level=level,
        half_dtype=dtype or "float16",  # O0 ignores it
        steps=args.steps,
        batch_size=args.batch,
        seq_len=args.seq_len,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        lr=args.lr,
        seed=seed,
        val_every=args.val_every,
        val_batches=args.val_batches,
        corpus_bytes=args.corpus_bytes,
        run_dir=str(runs_dir / f"{name}-seed{seed}"),
        accelerator=args.accelerator,
        progress_bar=False,
        log_every_n_steps=max(1, min(10, args.steps)),
        plugin_kwargs=plugin_kwargs,
    )
    result = train(config)
    return {
        "variant": name,
        "seed": seed,
        "val_loss": _number(result.val_loss),
        "train_loss": _number(result.train_loss),
        "skipped_steps": result.skipped_steps,
        "loss_scale": float(result.loss_scale),
        "steps": result.steps,
        "seconds": result.seconds,
        "val_curve": [[int(step), _number(float(loss))] for step, loss in result.val_curve],
    }


def summarise(runs: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """One row per variant: mean, spread (sample std) and min/max of the final validation loss over the seeds,
    skipped steps and final scales, the ratio to O0's mean, and PASS/FAIL for the gated levels."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_variant.setdefault(run["variant"], []).append(run)
    baseline = statistics.fmean(r["val_loss"] for r in by_variant["O0"]) if "O0" in by_variant else None
    rows = []
    for name, group in by_variant.items():
        losses = [r["val_loss"] if r["val_loss"] is not None else math.nan for r in group]
        finite = all(math.isfinite(loss) for loss in losses)  # O3 float16 can end in NaN
        mean = statistics.fmean(losses) if finite else math.nan
        ratio = mean / baseline if baseline and finite else None
        level = name.split("-")[0]
        if level in GATED_LEVELS:
            verdict = "PASS" if ratio is not None and abs(ratio - 1.0) <= tolerance else "FAIL"
        else:
            verdict = "baseline" if level == "O0" else "reported"
        rows.append(
            {
                "variant": name,
                "seeds": [r["seed"] for r in group],
                "val_loss_mean": _number(mean),
                "val_loss_std": _number(statistics.stdev(losses) if len(losses) > 1 and finite else 0.0 if finite
                                        else math.nan),
                "val_loss_min": _number(min(losses)) if finite else None,
                "val_loss_max": _number(max(losses)) if finite else None,
                "non_finite_runs": sum(1 for loss in losses if not math.isfinite(loss)),
                "ratio_to_O0": ratio,
                "skipped_steps": [r["skipped_steps"] for r in group],
                "final_loss_scale": [r["loss_scale"] for r in group],
                "seconds_mean": statistics.fmean(r["seconds"] for r in group),
                "verdict": verdict,
            }
        )
    return rows


def _number(value: float) -> float | None:
    """``value``, or ``None`` when it is not finite (strict JSON has no NaN)."""
    return value if math.isfinite(value) else None


def mean_curves(runs: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Validation curve per variant, averaged over the seeds at each recorded step."""
    points: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for step, loss in run["val_curve"]:
            if loss is None:
                continue  # a run that diverged: the mean is over the runs that did not
            points.setdefault(run["variant"], {}).setdefault(step, []).append(loss)
    return {
        name: [(step, statistics.fmean(values)) for step, values in sorted(steps.items())]
        for name, steps in points.items()
    }


def plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """Validation loss against step, one line per variant (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for name, points in curves.items():
        steps, losses = zip(*points)
        style = "-" if name == "O0" or name.endswith("bfloat16") else "--"
        ax.plot(steps, losses, style, marker="o", markersize=3, linewidth=2.2 if name == "O0" else 1.3, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4f}"


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False, default=_strict) + "\n")


def _strict(value: Any) -> Any:
    raise TypeError(f"{value!r} is not JSON serialisable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=25, help="steps between validation points")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--tolerance", type=float, default=0.02, help="allowed relative gap to O0 for O1/O2")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="cpu")
    parser.add_argument("--runs-dir", type=Path, default=None, help="Lightning run dirs (default: a temp folder)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 steps, one seed, tiny model")
    parser.add_argument("--out", type=Path, default=_harness.default_out("convergence"))
    parser.add_argument("--plot", default=str(Path(__file__).parents[1] / "docs" / "convergence.png"),
                        help="PNG of the validation curves; '' to skip")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.dim, args.layers, args.val_every, args.val_batches = 4, args.seeds[:1], 16, 1, 2, 1
        args.corpus_bytes = 200_000
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    if args.dim % args.heads:
        parser.error(f"--dim={args.dim} must be a multiple of --heads={args.heads}")
    _quiet()
    torch.set_num_threads(args.threads)
    names = variant_names(args.levels, args.dtypes)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    loads = [_harness.load_average()]
    with tempfile.TemporaryDirectory(prefix="mpx-bench-conv-") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for seed in args.seeds:  # seeds outermost: an early stop still leaves every variant with as many seeds
            for name in names:
                run = run_variant(name, seed, args, runs_dir)
                runs.append(run)
                loads.append(_harness.load_average())
                _write(args.out.with_suffix(".partial.json"), {"benchmark": "convergence", "partial": True,
                                                               "runs": runs})
                print(
                    f"  {name:<14} seed {seed}: val {_fmt(run['val_loss'])}  skipped {run['skipped_steps']:>3}  "
                    f"scale {run['loss_scale']:g}  {run['seconds']:.0f} s",
                    flush=True,
                )
    rows = summarise(runs, args.tolerance)

    table = _harness.markdown_table(
        ["variant", "val loss mean", "std", "vs O0", "skipped", "final scale", "verdict"],
        [[r["variant"], _fmt(r["val_loss_mean"]), _fmt(r["val_loss_std"]),
          f"{(r['ratio_to_O0'] - 1) * 100:+.2f}%" if r["ratio_to_O0"] is not None else None,
          "/".join(str(x) for x in r["skipped_steps"]), "/".join(f"{x:g}" for x in r["final_loss_scale"]),
          r["verdict"]] for r in rows], align="lrrrrrl")  # fmt: skip
    print(table)
    result = {
        "benchmark": "convergence",
        "command": _harness.command(argv),
        **_harness.machine("cuda" if args.accelerator == "gpu" or (args.accelerator == "auto"
                                                                   and torch.cuda.is_available()) else "cpu"),
        "loadavg": loads,
        "wall_seconds": time.perf_counter() - started,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "plot")
        },
        "tolerance": args.tolerance,
        "rows": rows,
        "curves": {name: [list(p) for p in points] for name, points in mean_curves(runs).items()},
        "runs": runs,
    }
    _harness.save(args.out, result, {"final validation loss against O0": table}, allow_nan=False, default=_strict)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    if args.plot:
        title = (
            f"CharTransformer dim {args.dim}, {args.layers} layers, {args.steps} steps, "
            f"batch {args.batch}x{args.seq_len}"
            f"; mean of {len(args.seeds)} seed(s)"
        )
        plot(mean_curves(runs), Path(args.plot), title)
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
