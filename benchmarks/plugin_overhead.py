"""Per-step host time of the Lightning plugin against Lightning's own mixed precision, on a model whose compute is tiny.

The model has CIFAR ResNet-18's topology (stem, 4 stages of 2 basic blocks, 3 projection shortcuts, a linear head:
62 parameter tensors, 21 batch norms) with very narrow channels (``--width 2``), on a batch of 2 8x8 images, so a
step costs what Python and dispatch cost: the host work that made the plugin 0.90x of "16-mixed" on an H100 for the
real ResNet-18 (a host-bound 13 ms step). Variants (``--variants`` picks a subset):

* ``32-true``: ``Trainer(precision="32-true")``;
* ``bf16-mixed`` (``16-mixed`` with ``--device cuda``): Lightning's own AMP plugin, the reference of the ratios;
* ``plugin-O1``, ``plugin-O2``: ``Trainer(plugins=[MixedPrecisionPlugin(level, half_dtype)])``;
* ``core-O2``, ``core-O1``: the ``Amp`` loop without Lightning (forward in ``forward_context``, ``backward``,
  ``step``, ``update``, ``zero_grad``), over the same batches;
* ``loop-autocast``: a hand-written loop with ``torch.autocast`` (and ``GradScaler`` for float16), the reference the
  core loops are compared with.

Every Trainer row is a real ``Trainer.fit`` (AdamW, ``enable_progress_bar=False``, ``enable_checkpointing=False``,
a ``CSVLogger`` with Lightning's default ``log_every_n_steps=50`` (``--log-every``), or none with ``--logger none``).
A step's time is the time from one ``on_train_batch_start`` to the next (everything the loop does per batch, the
logging steps included; the loops time one iteration the same way, fetching the batch included). One run of a variant is
``--warmup`` + ``--steps`` steps in a fresh Trainer and model (after one untimed short run of every variant); a
repeat runs every variant once, the order rotated from one repeat to the next, ``--repeats`` times. Reported per
variant: each run's 20th percentile of step time (the steps the shared machine's bursts of load spared; the median
too) and the ratio to the reference *within the same repeat* (median, min and max over the repeats), so that a
change of load hits both sides of a ratio alike. ``ratio > 1`` means slower than the reference. On CPU the clock is
the process's CPU time (``--clock``), on CUDA wall time with a device sync at each step boundary.

``--count-syncs`` runs every variant twice more: once under a dispatch mode that counts
``aten._local_scalar_dense`` (what ``.item()``, ``bool(t)`` and ``float(t)`` of a tensor run: a host sync on a GPU)
per step, logging steps apart, and once counting ``Tensor.tolist`` calls and all Python and C function calls per
step (cProfile's counts over steps 10 to the last but one; ``tolist`` reads a tensor without a dispatched op on CPU;
the call count is a measure of host work that the machine's load does not change). On CPU AdamW reads its step
counters with ``.item()`` (62 a step, every variant alike): the differences count.
``--profile VARIANT`` runs one fit of that variant under cProfile and prints the plugin's own functions
(``lightning_mpx``) by cumulative time, then the top functions overall by own time.

    python benchmarks/plugin_overhead.py [--device cpu|cuda] [--steps 100] [--warmup 20] [--repeats 8]
        [--logger csv|none] [--count-syncs] [--profile plugin-O2] [--label before] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import logging
import pstats
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package comes from PYTHONPATH (before/after runs)

import _harness  # noqa: E402
import step  # noqa: E402
from step import ModelSpec, build_model, make_batches  # noqa: E402

VARIANTS = ("32-true", "reference", "plugin-O1", "plugin-O2", "core-O2", "core-O1", "loop-autocast")
TRAINER_VARIANTS = ("32-true", "reference", "plugin-O1", "plugin-O2")
#: ResNet-18 (CIFAR) blocks: 62 parameter tensors, 21 batch norms, as the GPU benchmark's model.
BLOCKS = (2, 2, 2, 2)


def names(device: str) -> dict[str, str]:
    """The variants' names in the table: the reference is Lightning's precision string for the device."""
    ref = "16-mixed" if device == "cuda" else "bf16-mixed"
    return {v: ref if v == "reference" else v for v in VARIANTS}


def half_dtype(device: str) -> torch.dtype:
    return torch.float16 if device == "cuda" else torch.bfloat16


class _Timer:
    """Step boundaries: the clock at every batch start (after a device sync on CUDA)."""

    def __init__(self, sync: Callable[[], None], clock: str) -> None:
        self.sync, self.clock = sync, _harness.CLOCKS[clock]
        self.starts: list[float] = []

    def mark(self) -> None:
        self.sync()
        self.starts.append(self.clock())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's info lines and its 'few workers' warnings, once per fit, are not the benchmark's output."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def run_trainer(variant: str, spec: ModelSpec, batches: list[Any], total: int, device: str, logger: str,
                log_dir: Path, clock: str = "wall", hook: Callable[[], None] | None = None,
                log_every: int = 50) -> tuple[list[float], dict[str, Any]]:
    """``total`` steps of ``Trainer.fit`` for one variant (``log_every_n_steps=log_every``); returns the step times
    (``total - 1`` of them)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mpx import MixedPrecisionPlugin

    torch.manual_seed(0)
    net = build_model("resnet", spec)
    timer = _Timer(torch.cuda.synchronize if device == "cuda" else (lambda: None), clock)

    class Mark(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if hook is not None:
                hook()
            timer.mark()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            timer.mark()  # the end of the last step

    dtype = half_dtype(device)
    if variant == "32-true":
        kwargs = step.precision(lightning="32-true")
    elif variant == "reference":
        kwargs = step.precision(lightning="16-mixed" if dtype == torch.float16 else "bf16-mixed")
    else:
        kwargs = step.precision(variant.split("-")[1], dtype)
    with _quiet():
        trainer = step.fit(net, batches, total, device, [Mark()],
                           CSVLogger(str(log_dir), name=variant) if logger == "csv" else False,
                           log_every_n_steps=log_every, **kwargs)
    extra: dict[str, Any] = {"lightning_precision": str(trainer.precision)}
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        extra["skipped_steps"] = sum(plugin.amp.skipped_steps)
    return timer.step_times(), extra


def run_loop(variant: str, spec: ModelSpec, batches: list[Any], total: int, device: str, clock: str = "wall",
             hook: Callable[[], None] | None = None) -> tuple[list[float], dict[str, Any]]:
    """``total`` iterations of a hand-written loop (``core-O1``/``core-O2`` with ``Amp``, or ``loop-autocast``)."""
    torch.manual_seed(0)
    net = build_model("resnet", spec)
    timer = _Timer(torch.cuda.synchronize if device == "cuda" else (lambda: None), clock)
    kind = variant.split("-")[1] if variant.startswith("core-") else "autocast"
    one, amp = step.loop_step(kind, net, device, half_dtype(device))
    loader = iter(step.ListDataset(batches, total))
    for _ in range(total):
        if hook is not None:
            hook()
        timer.mark()
        one(*next(loader))
    timer.mark()
    return timer.step_times(), {} if amp is None else {"skipped_steps": sum(amp.skipped_steps)}


def run_variant(variant: str, args: argparse.Namespace, spec: ModelSpec, batches: list[Any], total: int,
                log_dir: Path, hook: Callable[[], None] | None = None) -> tuple[list[float], dict[str, Any]]:
    if variant in TRAINER_VARIANTS:
        return run_trainer(variant, spec, batches, total, args.device, args.logger, log_dir, args.clock, hook,
                           args.log_every)
    return run_loop(variant, spec, batches, total, args.device, args.clock, hook)


class _SyncCounter(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls (a tensor read on the host: ``.item()``, ``bool``, ``float``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_syncs(variant: str, args: argparse.Namespace, spec: ModelSpec, batches: list[Any],
                log_dir: Path) -> dict[str, Any]:
    """Host reads of tensors per step (logging steps of the CSV logger apart from the others)."""
    counter = _SyncCounter()
    marks: list[int] = []
    total = args.sync_steps  # the logging steps: log_every - 1, 2 * log_every - 1, ... (49 and 99 at 50, the default)
    profiler = cProfile.Profile()
    first = 11  # function calls are counted from the start of step 10 to the start of the last step

    starts: list[None] = []

    def hook() -> None:
        starts.append(None)
        if len(starts) == first:
            profiler.enable()
        elif len(starts) == total:
            profiler.disable()

    with counter:
        run_variant(variant, args, spec, batches, total, log_dir, hook=lambda: marks.append(counter.count))
        marks.append(counter.count)
    # Function calls in a second run, without the counting mode (whose own Python would be counted).
    run_variant(variant, args, spec, batches, total, log_dir, hook=hook)
    stats = pstats.Stats(profiler)
    tolist = sum(stat[1] for (_, _, name), stat in stats.stats.items()  # type: ignore[attr-defined]
                 if name == "<method 'tolist' of 'torch._C.TensorBase' objects>")
    per_step = [b - a for a, b in zip(marks, marks[1:])]
    logged_run = variant in TRAINER_VARIANTS and args.logger == "csv"
    logging_steps = set(range(args.log_every - 1, total, args.log_every)) if logged_run else set()
    plain = [n for i, n in enumerate(per_step) if i >= 2 and i not in logging_steps]
    logged = [per_step[i] for i in sorted(logging_steps) if i >= 2]
    return {
        "variant": variant,
        "per_step_nonlogging": statistics.median(plain) if plain else None,
        "max_nonlogging": max(plain) if plain else None,
        "per_logging_step": statistics.median(logged) if logged else None,
        # Over the steps from 10 to the last but one (the logging steps among them):
        "tolist_per_step": tolist / (total - first),
        # Python and C function calls per step (cProfile's count): a proxy of the host work per step that the
        # machine's load does not change.
        "calls_per_step": stats.total_calls / (total - first),  # type: ignore[attr-defined]
    }


def profile(variant: str, args: argparse.Namespace, spec: ModelSpec, batches: list[Any], log_dir: Path) -> str:
    """cProfile of one run of ``variant``: the package's own functions by cumulative time, then the top overall."""
    profiler = cProfile.Profile()
    total = args.warmup + args.steps
    profiler.enable()
    run_variant(variant, args, spec, batches, total, log_dir)
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    print(f"cProfile, {total} steps of {variant}: lightning_mpx functions by cumulative time", file=buffer)
    stats.sort_stats("cumulative").print_stats(r"lightning_mpx", 40)
    print(f"cProfile, {total} steps of {variant}: all functions by own time", file=buffer)
    stats.sort_stats("tottime").print_stats(30)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of every run")
    parser.add_argument("--repeats", type=int, default=8, help="runs of every variant, the order rotated")
    parser.add_argument("--width", type=int, default=2, help="channels of the first stage (ResNet-18: 64)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image", type=int, default=8)
    parser.add_argument("--logger", choices=("csv", "none"), default="csv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default=None,
                        help="step time as wall time or as the process's CPU time (default: cpu on --device cpu, "
                             "where the load of other processes counts less; wall on cuda, where the host waits)")
    parser.add_argument("--count-syncs", action="store_true", help="count host reads of tensors per step")
    parser.add_argument("--sync-steps", type=int, default=120,
                        help="steps of each --count-syncs run (steps 49 and 99 are logging steps at --log-every 50)")
    parser.add_argument("--log-every", type=int, default=50,
                        help="the Trainer rows' log_every_n_steps (default 50, Lightning's): the logging steps are "
                        "the steps log_every - 1, 2 * log_every - 1, ...")
    parser.add_argument("--profile", choices=VARIANTS, default=None, help="print a cProfile table of one run")
    parser.add_argument("--label", default="", help="a name for this version in the JSON (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=_harness.default_out("plugin_overhead"))
    args = parser.parse_args(argv)
    if (args.steps < 2 or args.warmup < 0 or args.repeats < 1 or args.width < 1 or args.sync_steps < 13
            or args.log_every < 1):
        parser.error(f"--steps={args.steps} must be at least 2, --warmup={args.warmup} at least 0, "
                     f"--repeats={args.repeats}, --width={args.width} and --log-every={args.log_every} at least 1, "
                     f"--sync-steps={args.sync_steps} at least 13")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device and none is available; use --device cpu")
    args.clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    if args.device == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu with --device cuda would not count the host's waits for the GPU; use --clock wall")
    if "reference" not in args.variants:
        args.variants = ["reference", *args.variants]
    torch.set_num_threads(args.threads)
    shown = names(args.device)
    ref = shown["reference"]
    spec = ModelSpec(batch=args.batch, image=args.image, width=args.width, blocks=BLOCKS)
    batches = make_batches("resnet", spec, 8, torch.device(args.device))
    total = args.warmup + args.steps + 1  # the first step's start is the warm-up's end
    params = sum(1 for _ in build_model("resnet", spec).parameters())
    machine = _harness.machine(args.device)  # before the runs: the load they start under
    # Per run, two statistics of its timed steps (ms): the 20th percentile (the less disturbed steps; what the
    # ratios use, as the shared machine's load comes in bursts) and the median.
    extras: dict[str, dict[str, Any]] = {}

    def timed(variant: str) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            gc.collect()  # the previous run's garbage is not this run's
            times, extras[variant] = run_variant(variant, args, spec, batches, total, log_dir)
            ms = [t * 1e3 for t in times[args.warmup:]]
            return {"p20": statistics.quantiles(ms, n=5)[0], "median": statistics.median(ms)}

        return run

    def progress(index: int, samples: dict[str, list[dict[str, float]]]) -> None:
        print(f"repeat {index + 1}/{args.repeats} (p20 ms): "
              + ", ".join(f"{shown[v]} {samples[v][-1]['p20']:.2f}" for v in args.variants), flush=True)

    with tempfile.TemporaryDirectory(prefix="plugin-overhead-") as tmp:
        log_dir = Path(tmp)
        for variant in args.variants:  # a first fit imports and initialises what later ones reuse: not timed
            run_variant(variant, args, spec, batches, min(total, 10), log_dir)
        samples = _harness.interleave({v: timed(v) for v in args.variants}, args.repeats, after_round=progress)
        syncs = [count_syncs(v, args, spec, batches, log_dir) for v in args.variants] if args.count_syncs else []
        profile_text = profile(args.profile, args, spec, batches, log_dir) if args.profile else ""
    runs = {v: {stat: [s[stat] for s in samples[v]] for stat in ("p20", "median")} for v in args.variants}

    def ratio(a: str, b: str, stat: str = "p20") -> dict[str, Any]:
        values = [x / y for x, y in zip(runs[a][stat], runs[b][stat])]  # the same repeat's runs
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}

    rows = []
    for variant in args.variants:
        p20, med = ratio(variant, "reference"), ratio(variant, "reference", "median")
        rows.append({
            "variant": shown[variant],
            "step_ms_p20": statistics.median(runs[variant]["p20"]),
            "step_ms_median": statistics.median(runs[variant]["median"]),
            "step_ms_p20_runs": runs[variant]["p20"],
            "step_ms_median_runs": runs[variant]["median"],
            f"ratio_to_{ref}": p20["median"],
            "ratio_min": p20["min"],
            "ratio_max": p20["max"],
            "ratios": p20["values"],
            f"ratio_to_{ref}_of_medians": med["median"],
            **extras[variant],
        })
    pairs = {}  # further ratios of the same repeats: the plugin against the core loop, the core loop against autocast
    for a, b in (("plugin-O2", "core-O2"), ("plugin-O1", "core-O1"), ("core-O2", "loop-autocast"),
                 ("core-O1", "loop-autocast"), ("reference", "loop-autocast")):
        if a in runs and b in runs:
            pairs[f"{shown[a]} / {shown[b]}"] = ratio(a, b)
    own_calls = {}  # the plugin's own calls per step: plugin - core loop, less what Lightning adds to a plain loop
    calls = {x["variant"]: x["calls_per_step"] for x in syncs}
    for level in ("O1", "O2"):
        if {f"plugin-{level}", f"core-{level}", "reference", "loop-autocast"} <= set(calls):
            own_calls[f"plugin-{level}"] = (calls[f"plugin-{level}"] - calls[f"core-{level}"]
                                            - (calls["reference"] - calls["loop-autocast"]))  # fmt: skip
    tables = {
        "step time, ratios within a repeat": _harness.markdown_table(
            ["variant", "p20 ms", "median ms", f"ratio to {ref} (p20)", "min", "max", "(medians)"],
            [[r["variant"], f"{r['step_ms_p20']:.3f}", f"{r['step_ms_median']:.3f}", f"{r[f'ratio_to_{ref}']:.3f}",
              f"{r['ratio_min']:.3f}", f"{r['ratio_max']:.3f}", f"{r[f'ratio_to_{ref}_of_medians']:.3f}"]
             for r in rows]),
        "pairs of the same repeats (p20)": _harness.markdown_table(
            ["pair", "median", "min", "max"],
            [[name, f"{p['median']:.3f}", f"{p['min']:.3f}", f"{p['max']:.3f}"] for name, p in pairs.items()]),
    }
    if syncs:
        tables["host reads and function calls per step"] = _harness.markdown_table(
            ["variant", "_local_scalar_dense, non-logging (max)", "on a logging step", "tolist", "function calls"],
            [[shown[x["variant"]], f"{x['per_step_nonlogging']} ({x['max_nonlogging']})", x["per_logging_step"],
              f"{x['tolist_per_step']:.2f}", f"{x['calls_per_step']:.0f}"] for x in syncs])
    if own_calls:
        tables["the plugin's own function calls per step (beyond Lightning's and the core loop's)"] = \
            _harness.markdown_table(["variant", "calls"], [[k, f"{n:.0f}"] for k, n in own_calls.items()])
    print(f"lightning_mpx from {machine['package_path']}; {args.device}, {params} parameter tensors, "
          f"batch {args.batch}x3x{args.image}x{args.image}, logger {args.logger}, {args.clock} clock, "
          f"{args.repeats} repeats of {args.steps} steps")
    for title, text in tables.items():
        print(f"\n{title}:\n{text}")
    if profile_text:
        print(profile_text)
    result = {
        "benchmark": "plugin_overhead",
        "label": args.label,
        "command": _harness.command(argv),
        **machine,
        "half_dtype": str(half_dtype(args.device)).removeprefix("torch."),
        "reference": ref,
        "clock": args.clock,
        "loadavg": [machine["loadavg"], _harness.load_average()],
        "model": {"blocks": list(BLOCKS), "width": args.width, "batch": args.batch, "image": args.image,
                  "parameter_tensors": params},
        "logger": args.logger,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
        "pairs": pairs,
        "syncs": syncs,
        "plugin_own_calls_per_step": own_calls,
        "profiled": args.profile,
        "profile": profile_text,
    }
    _harness.save(args.out, result, tables)
    return result


if __name__ == "__main__":
    main()
