"""The ``lightning-mpx`` console script: ``demo``, ``plot`` and ``doctor``."""

from __future__ import annotations

import argparse
import sys

from lightning_mpx.opt_levels import OPT_LEVELS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-mpx", description="lightning_mpx: Apex-style mixed precision.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small character-level transformer with Lightning and print a summary",
        description="Train a byte-level transformer on the Python standard library's source with "
        "MixedPrecisionPlugin; TensorBoard logs go to the run folder.",
    )
    demo.add_argument("--opt-level", default="O1", choices=OPT_LEVELS, help="opt level (default: O1)")
    demo.add_argument(
        "--half-dtype",
        default="auto",
        choices=("auto", "float16", "bfloat16"),
        help="default: auto (float16 on a GPU; bfloat16 with a dynamic loss scale on a CPU, where float16 is often "
        "emulated)",
    )
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--dim", type=int, default=64)
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--growth-interval", type=int, default=50, help="clean steps before the loss scale doubles (default: 50)"
    )
    demo.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default on a CPU: 1; the model is small, so more threads add a fork-join to every op, "
        "and stall it when other processes share the cores)",
    )
    demo.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu (default: auto)")
    demo.add_argument("--run-dir", default=None, help="TensorBoard run folder (default: runs/demo-LEVEL-DTYPE-TIME)")
    demo.add_argument("--no-progress-bar", action="store_true")
    demo.add_argument("--plot", action="store_true", help="also write the loss-scale plot into the run folder")

    plot = commands.add_parser(
        "plot",
        help="plot a run's loss-scale curve (overflows marked) beside its training loss",
        description="Read the TensorBoard event files under RUN_DIR and write a PNG.",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/loss_scale.png)")

    doctor = commands.add_parser(
        "doctor",
        help="diagnose a run's precision health (overflow, underflow, the loss scale) from its TensorBoard events",
        description="Read the mpx/* scalars under RUN_DIR and print the findings with their evidence and a fix. "
        "Exit status: 0 healthy, 1 a problem found, 2 no mpx/* scalars (or no events) under RUN_DIR.",
    )
    doctor.add_argument("run_dir", metavar="RUN_DIR")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from lightning_mpx.demo import DemoConfig, device_type, format_summary, resolve_half_dtype, train

        if args.threads is None and device_type(args.accelerator) == "cpu":
            args.threads = 1
        for name in ("steps", "batch_size", "seq_len", "dim", "layers", "growth_interval", "threads"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                print(
                    f"lightning-mpx demo: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1",
                    file=sys.stderr,
                )
                return 2
        config = resolve_half_dtype(
            DemoConfig(
                opt_level=args.opt_level,
                half_dtype=args.half_dtype,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                dim=args.dim,
                layers=args.layers,
                lr=args.lr,
                seed=args.seed,
                growth_interval=args.growth_interval,
                accelerator=args.accelerator,
                run_dir=args.run_dir,
                progress_bar=not args.no_progress_bar,
                threads=args.threads,
            )
        )
        print(f"lightning-mpx demo: {config.opt_level} in {config.half_dtype}: {config.half_dtype_reason}", flush=True)
        result = train(config)
        print(format_summary(result))
        if args.plot:
            from lightning_mpx.health.plot import plot_run

            print(f"plot: {plot_run(result.run_dir)}")
        print(f"see the curves with: tensorboard --logdir {result.run_dir}   or: lightning-mpx plot {result.run_dir}")
        return 0
    if args.command == "doctor":
        return _doctor(args.run_dir, args.json)
    from lightning_mpx.health.plot import plot_run

    try:
        path = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"lightning-mpx plot: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _doctor(run_dir: str, as_json: bool) -> int:
    from lightning_mpx.health.doctor import EXIT_NO_TAGS, NoMixedPrecisionTagsError, diagnose, to_json

    try:
        diagnosis = diagnose(run_dir)
    except (FileNotFoundError, NoMixedPrecisionTagsError) as error:
        print(f"lightning-mpx doctor: {error}", file=sys.stderr)
        return EXIT_NO_TAGS
    print(to_json(diagnosis) if as_json else diagnosis.format())
    return diagnosis.exit_status


if __name__ == "__main__":
    sys.exit(main())
