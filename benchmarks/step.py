"""Training-step speed and memory: lightning_mpx against FP32, Lightning's own AMP and plain torch.autocast.

Two models, a GPT-2-like decoder on random tokens and a ResNet-style convolutional net with batch norm on random
images (``--size small`` for CPU, ``--size real`` for a GPU: GPT-2 small's shape at sequence 512, a CIFAR ResNet-18).
Every variant runs in its own fresh subprocess with the same seed, data, optimizer (AdamW) and thread count, so peak
memory is per variant and nothing leaks from one to the next; with ``--repeats N`` the whole variant list is run N
times, in order, and the per-run medians are combined by their median.

Variants (``--variants`` picks a subset):

* ``fp32``: Lightning, ``precision="32-true"``;
* ``mpx-O{1,2,3}-{fp16,bf16}``: Lightning with ``MixedPrecisionPlugin``;
* ``lightning-16-mixed``, ``lightning-bf16-mixed``: Lightning's own AMP (on CPU Lightning runs "16-mixed" as
  bfloat16 autocast: the JSON records the dtype it actually used);
* ``mpx-O1-fp16-compiled``, ``lightning-16-mixed-compiled``: the same Trainer rows with the network passed through
  ``torch.compile`` (inductor): O1 compiled against Lightning's AMP compiled;
* ``lightning-16-mixed-clip``, ``mpx-O1-fp16-clip``, ``mpx-O2-fp16-clip``: the same Trainer rows with
  ``gradient_clip_val=1.0`` (the habit of most fine-tuning recipes): the plugin's clip runs the fused kernels on CUDA,
  its plain step torch's; compared with Lightning's "16-mixed" with the same clip;
* ``lightning-16-mixed-fused``, ``lightning-bf16-mixed-fused``, ``mpx-O1-fp16-fused``, ``mpx-O1-bf16-fused``,
  ``mpx-O2-fp16-fused``: the same Trainer rows with ``AdamW(fused=True)``, the plugin's with ``skip_on_device=True``
  (the overflow flag handed to the fused step, not read on the host, as ``GradScaler`` does for a fused optimizer);
  each compared with Lightning's own AMP of the same dtype with the same fused AdamW;
* ``fabric-mpx-O2-fp16``, ``fabric-16-mixed``: a Lightning Fabric loop (``fabric.setup``, ``fabric.backward``,
  ``optimizer.step``) with ``FabricMixedPrecisionPlugin("O2")`` and with Fabric's own ``precision="16-mixed"`` (on
  CPU Fabric runs it as bfloat16 autocast, recorded as for Lightning's rows);
* ``torch-autocast-{fp16,bf16}``: a hand-written loop with ``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16);
* ``loop-fp32``, ``core-O1-{fp16,bf16}``, ``core-O2-{fp16,bf16}``: hand-written loops, plain and with ``Amp``;
* ``torch-autocast-fused-{fp16,bf16}``, ``core-O1-fused-{fp16,bf16}``, ``core-O1-devskip-{fp16,bf16}``: the loops
  with ``AdamW(fused=True)``: torch's (``GradScaler`` skips on the device at fp16), ``Amp`` reading the overflow flag
  on the host, and ``Amp`` with ``skip_on_device=True`` (the flag handed to the fused step, no host read).

Step time is the median over ``--steps`` steps after ``--warmup`` (forward, backward, optimizer step; measured by a
Lightning callback from ``on_train_batch_start`` to ``on_train_batch_end`` or around the (Fabric) loop body, with
``torch.cuda.synchronize()`` on GPU). Peak memory is ``torch.cuda.max_memory_allocated`` on GPU and the child's peak
RSS on CPU (which includes the ~0.5 GB of the imported libraries). The ratios compare throughput with Lightning's
"16-mixed" and "bf16-mixed" rows (and Fabric's "16-mixed" row, and the ``-clip`` and ``-fused`` rows' own
references: Lightning's rows with the same clip or the same fused AdamW) of the same run.

    python benchmarks/step.py [--device cpu|cuda] [--model gpt|resnet|all] [--steps 20] [--warmup 5] [--out PATH]

float16 matmuls are very slow on most CPUs (no native fp16 arithmetic): the fp16 rows on CPU say nothing about
speed on a GPU, and ``--cpu-fp16-steps`` runs them with fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs

# The variants and their builders live in _step_variants; every name is re-exported here, where the other
# scripts and the tests look for it (step.ModelSpec, step.loop_step, ...).
from _step_variants import (  # noqa: F401
    FABRIC_VARIANTS,
    LIGHTNING_VARIANTS,
    LOOP_VARIANTS,
    MODELS,
    REFERENCES,
    SPECS,
    SUFFIXES,
    VARIANTS,
    ListDataset,
    ModelSpec,
    _fabric_steps,
    _lightning_steps,
    _loop_extra,
    _loop_steps,
    _loss,
    _step_timer,
    _trainer_extra,
    _trainer_precision,
    aligned_table,
    base_variant,
    build_model,
    fit,
    fit_more,
    fit_parts,
    half_dtype_of,
    is_fp16,
    lightning_module,
    loop_of,
    loop_step,
    make_batches,
    precision,
    time_steps,
)


# -- the child: one variant, one model ---------------------------------------------------------------------------------
def run_child(variant: str, kind: str, spec: ModelSpec, steps: int, warmup: int, device: str,
              threads: int, compile_backend: str = "inductor") -> dict[str, Any]:
    """Train ``variant`` for ``warmup + steps`` steps in this process; returns its step times and peak memory.

    ``compile_backend``: the ``torch.compile`` backend of the ``-compiled`` variants (the tests use ``aot_eager``,
    which traces the same graph without inductor's minute of CPU code generation)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cuda = device == "cuda"
    dev = torch.device(device)
    total = warmup + steps
    batches = make_batches(kind, spec, min(total, 8), dev)
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    net = build_model(kind, spec)
    extra: dict[str, Any] = {}
    if variant in LIGHTNING_VARIANTS:
        times, extra = _lightning_steps(variant, net, batches, total, device, sync, compile_backend)
    elif variant in FABRIC_VARIANTS:
        times, extra = _fabric_steps(variant, net, batches, total, device, sync)
    else:
        times, extra = _loop_steps(variant, net, batches, total, dev, sync)
    return _record(variant, kind, spec.batch, times[warmup:], cuda,
                   "cuda_max_memory_allocated" if cuda else "peak_rss", extra)


def _record(variant: str, kind: str, batch: int, timed: list[float], cuda: bool, peak_kind: str,
            extra: dict[str, Any]) -> dict[str, Any]:
    """A run's row: its timed steps (seconds) summarised, and the peak memory so far (CUDA's allocated, or RSS)."""
    import torch

    median = statistics.median(timed)
    peak = (
        torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "variant": variant,
        "model": kind,
        "steps_timed": len(timed),
        "step_ms_median": median * 1e3,
        "step_ms_iqr": _harness.iqr_width(timed) * 1e3,
        "step_ms_min": min(timed) * 1e3,  # the least disturbed step: a floor under a shared machine's load
        "samples_per_second": batch / median,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": peak_kind,
        **extra,
    }


def run_in_process(variant: str, kind: str, spec: ModelSpec, steps: int, warmup: int, device: str,
                   threads: int) -> dict[str, Any]:
    """:func:`run_child` in this process, then the run's objects collected (and CUDA's cached blocks released), so
    that the next run's peak memory is its own."""
    import gc

    import torch

    try:
        return run_child(variant, kind, spec, steps, warmup, device, threads)
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


class Persistent:
    """One variant built once (model, Trainer or loop), warmed up, and trained on for more steps at each
    :meth:`advance` (``--persistent``): a Lightning variant continues with :func:`fit_more`, a loop calls its step
    again. Its rounds then differ only by what happens while they run, not by how a run was built."""

    def __init__(self, variant: str, kind: str, spec: ModelSpec, warmup: int, device: str) -> None:
        import torch

        if variant in FABRIC_VARIANTS or variant.endswith("-compiled"):
            raise ValueError(f"variant={variant!r} cannot run --persistent (Fabric and compiled rows run afresh); "
                             "valid choices: the Trainer rows and the loops")  # fmt: skip
        torch.manual_seed(0)
        self.variant, self.kind, self.batch = variant, kind, spec.batch
        self.cuda = device == "cuda"
        self.sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        batches = make_batches(kind, spec, 8, torch.device(device))
        net = build_model(kind, spec)
        self.amp: Any = None
        self.trainer: Any = None
        if variant in LIGHTNING_VARIANTS:
            self.timer = _step_timer(self.sync)
            self.trainer, self.module, self.loader = fit_parts(
                net, batches, max(warmup, 1), device, [self.timer], **_trainer_precision(variant, device))
            self.trainer.fit(self.module, self.loader)
        else:
            self.one, self.amp = loop_of(variant, net, torch.device(device))
            self.batches = batches
            time_steps(self.one, batches, warmup, self.sync)

    def advance(self, steps: int) -> dict[str, Any]:
        """``steps`` more steps; a record of them as :func:`run_child` returns (the peak memory is the process's,
        shared by every persistent variant)."""
        if self.trainer is not None:
            self.timer.times.clear()
            fit_more(self.trainer, self.module, self.loader, steps)
            times = list(self.timer.times)
            extra = _trainer_extra(self.variant, self.trainer)
        else:
            times = time_steps(self.one, self.batches, steps, self.sync)
            extra = _loop_extra(self.amp)
        return _record(self.variant, self.kind, self.batch, times, self.cuda, _harness.SHARED_PEAK, extra)


# -- the parent --------------------------------------------------------------------------------------------------------
def _spawn(variant: str, kind: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--_child", variant, "--model", kind, "--size", args.size,
        "--steps", str(steps), "--warmup", str(args.warmup), "--device", args.device, "--threads", str(args.threads),
    ]  # fmt: skip
    return _harness.run_child(cmd, f"variant {variant} on {kind}", args.child_timeout)


def combine(samples: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """One row from the repeats of one variant: medians of the step-time medians, max of the peaks."""
    row = dict(samples[0])
    row["step_ms_median"] = statistics.median(s["step_ms_median"] for s in samples)
    row["step_ms_runs"] = [s["step_ms_median"] for s in samples]
    row["step_ms_min"] = min(s["step_ms_min"] for s in samples)
    row["samples_per_second"] = batch / (row["step_ms_median"] / 1e3)
    row["peak_memory_bytes"] = max(s["peak_memory_bytes"] for s in samples)
    row["repeats"] = len(samples)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Throughput and peak-memory ratios against Lightning's AMP rows of the same model (when measured)."""
    for kind in {r["model"] for r in rows}:
        group = [r for r in rows if r["model"] == kind]
        refs = {r["variant"]: r for r in group if r["variant"] in REFERENCES}
        fp32 = next((r for r in group if r["variant"] == "fp32"), None)
        for r in group:
            for name, ref in refs.items():
                key = name.removeprefix("lightning-").replace("-", "_")
                r[f"throughput_vs_{key}"] = r["samples_per_second"] / ref["samples_per_second"]
                r[f"step_time_vs_{key}"] = r["step_ms_median"] / ref["step_ms_median"]
                # Paired: each repeat's ratio from two runs close in time, then the median over the repeats. Less
                # sensitive to a load that changes between the start and the end of the run.
                paired = [a / b for a, b in zip(r.get("step_ms_runs", []), ref.get("step_ms_runs", []))]
                if paired:
                    r[f"step_time_vs_{key}_paired"] = statistics.median(paired)
                    r[f"step_time_vs_{key}_paired_range"] = [min(paired), max(paired)]
            if fp32 is not None and _harness.own_peak(r) and _harness.own_peak(fp32):
                r["peak_memory_vs_fp32"] = r["peak_memory_bytes"] / fp32["peak_memory_bytes"]


#: Issue 25's O1 speed goals on a GPU: (row, its reference), each at >= 0.97x the reference's throughput.
O1_SPEED_PAIRS = (
    ("core-O1-fp16", "torch-autocast-fp16"),
    ("core-O1-bf16", "torch-autocast-bf16"),
    ("mpx-O1-bf16", "lightning-bf16-mixed"),
    ("core-O1-fp16-aligned", "torch-autocast-fp16"),
    ("core-O1-bf16-aligned", "torch-autocast-bf16"),
    ("mpx-O1-fp16-aligned", "lightning-16-mixed"),
    ("mpx-O1-bf16-aligned", "lightning-bf16-mixed"),
)
#: The fused AdamW goals on a GPU, where Lightning's "16-mixed" skips on the device and "bf16-mixed" checks nothing:
#: (row with ``skip_on_device=True``, its reference with the same fused AdamW, the least throughput ratio).
DEVICE_SKIP_PAIRS = (
    ("mpx-O1-fp16-fused", "lightning-16-mixed-fused", 0.97),
    ("mpx-O2-fp16-fused", "lightning-16-mixed-fused", 1.05),
    ("mpx-O1-bf16-fused", "lightning-bf16-mixed-fused", 0.97),
    ("core-O1-devskip-fp16", "torch-autocast-fused-fp16", 0.97),
    ("core-O1-devskip-bf16", "torch-autocast-fused-bf16", 0.97),
)


def check_targets(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The issue's targets that this run can judge (GPU targets on CUDA, the CPU target on CPU)."""

    def row(kind: str, variant: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["model"] == kind and r["variant"] == variant), None)

    checks = []
    for kind in sorted({r["model"] for r in rows}):
        if device == "cpu":
            for dtype in ("bf16",):
                o1, ref = row(kind, f"mpx-O1-{dtype}"), row(kind, "lightning-bf16-mixed")
                if o1 and ref:
                    value = o1.get("step_time_vs_bf16_mixed_paired", o1["step_ms_median"] / ref["step_ms_median"])
                    checks.append({"model": kind, "target": "mpx-O1-bf16 step time <= 1.3x lightning-bf16-mixed",
                                   "value": value, "met": value <= 1.3})
        else:
            ref, fp32 = row(kind, "lightning-16-mixed"), row(kind, "fp32")
            o1, o2 = row(kind, "mpx-O1-fp16"), row(kind, "mpx-O2-fp16")
            if o2 and ref:
                value = o2["samples_per_second"] / ref["samples_per_second"]
                checks.append({"model": kind, "target": "mpx-O2-fp16 throughput >= 1.05x lightning-16-mixed",
                               "value": value, "met": value >= 1.05})
            if o1 and ref:
                value = o1["samples_per_second"] / ref["samples_per_second"]
                checks.append({"model": kind, "target": "mpx-O1-fp16 throughput within 3% of lightning-16-mixed",
                               "value": value, "met": value >= 0.97})
            # Issue 25: O1 at torch.autocast's speed, plugin and core loop, both dtypes (and with the aligned table).
            for variant, reference in O1_SPEED_PAIRS:
                a, b = row(kind, variant), row(kind, reference)
                if a and b:
                    value = a["samples_per_second"] / b["samples_per_second"]
                    checks.append({"model": kind, "target": f"{variant} throughput >= 0.97x {reference}",
                                   "value": value, "met": value >= 0.97})
            # The fused AdamW rows: the plugin and the core loop skipping on the device, as torch's GradScaler does.
            for variant, reference, bar in DEVICE_SKIP_PAIRS:
                a, b = row(kind, variant), row(kind, reference)
                if a and b:
                    value = a["samples_per_second"] / b["samples_per_second"]
                    checks.append({"model": kind, "target": f"{variant} throughput >= {bar:.2f}x {reference}",
                                   "value": value, "met": value >= bar})
            # --persistent: the process's peak, not a row's
            if o2 and fp32 and _harness.own_peak(o2) and _harness.own_peak(fp32):
                value = o2["peak_memory_bytes"] / fp32["peak_memory_bytes"]
                checks.append({"model": kind, "target": "mpx-O2-fp16 peak memory below fp32",
                               "value": value, "met": value < 1.0})
    return checks


def table(rows: list[dict[str, Any]], pad: bool = False) -> str:
    """The rows as a markdown table: step time, throughput, memory, the ratios to Lightning's AMP rows."""

    def x(value: float | None) -> str | None:
        return None if value is None else f"{value:.2f}x"

    # The -clip and -fused rows' own references, each a column when it was measured.
    own = [(key, name) for key, name in (("throughput_vs_16_mixed_clip", "vs 16-mixed-clip"),
                                         ("throughput_vs_16_mixed_fused", "vs 16-mixed-fused"),
                                         ("throughput_vs_bf16_mixed_fused", "vs bf16-mixed-fused"))
           if any(key in r for r in rows)]  # fmt: skip
    columns = ["model", "variant", "steps", "step ms", "samples/s", "peak MiB", "vs 16-mixed", "vs bf16-mixed",
               *(name for _, name in own), "paired t/bf16", "skipped"]
    return _harness.markdown_table(columns, [
        [r["model"], r["variant"], r["steps_timed"], f"{r['step_ms_median']:.2f}", f"{r['samples_per_second']:.1f}",
         f"{r['peak_memory_bytes'] / 2**20:.0f}", x(r.get("throughput_vs_16_mixed")),
         x(r.get("throughput_vs_bf16_mixed")), *(x(r.get(key)) for key, _ in own),
         x(r.get("step_time_vs_bf16_mixed_paired")), r.get("skipped_steps")]
        for r in rows], align="ll" + "r" * (len(columns) - 2), pad=pad)  # fmt: skip


NOTE = ("vs: throughput of the row / throughput of Lightning's AMP row, same run; paired t/bf16: median over the "
        "repeats of the row's step time / lightning-bf16-mixed's step time in the same repeat.")
CPU_NOTE = ("On CPU Lightning runs precision='16-mixed' as bfloat16 autocast; the fp16 rows use float16, which has no "
            "fast CPU kernels: they are correctness rows, not speed configurations.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--size", choices=("tiny", "small", "real"), default=None,
                        help="default: small on CPU, real on CUDA (tiny: the test suite's, every code path)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cpu-fp16-steps", type=int, default=None,
                        help="timed steps for float16 rows on CPU (default: --steps)")
    parser.add_argument("--repeats", type=int, default=1, help="run the variant list this many times")
    parser.add_argument("--one-process", action="store_true",
                        help="run every variant in this process, the order rotated each of --repeats rounds (each "
                        "run builds its model, Trainer or loop afresh), instead of a child process per run: the "
                        "rows then do not carry the differences between processes")
    parser.add_argument("--persistent", action="store_true",
                        help="with --one-process: build every variant once (model, Trainer or loop), warm it up, "
                        "then train each on for --steps more steps per round, the order rotated (a Trainer continues "
                        "with fit() and a raised max_steps); peak memory is then not per variant")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="VARIANT",
                        help=f"subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every child")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds per variant before giving up")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/step_<device>.json")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0")
    if args.persistent and not args.one_process:
        parser.error("--persistent needs --one-process (the variants live in this process)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size is None:
        args.size = "real" if args.device == "cuda" else "small"
    kinds = MODELS if args.model == "all" else (args.model,)
    if args._child is not None:
        result = run_child(args._child, kinds[0], SPECS[(kinds[0], args.size)], args.steps, args.warmup,
                           args.device, args.threads)
        print(json.dumps(result))
        return None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
    fp16_steps = args.cpu_fp16_steps if args.device == "cpu" and args.cpu_fp16_steps else args.steps
    loads = [_harness.load_average()]
    started = time.perf_counter()

    persistent: dict[str, Persistent] = {}
    if args.persistent:
        import torch

        torch.set_num_threads(args.threads)
        for kind in kinds:
            for variant in args.variants:
                persistent[f"{kind}/{variant}"] = Persistent(variant, kind, SPECS[(kind, args.size)], args.warmup,
                                                             args.device)  # fmt: skip

    def sample(kind: str, variant: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            steps = fp16_steps if is_fp16(variant) else args.steps
            if persistent:
                result = persistent[f"{kind}/{variant}"].advance(steps)
            elif args.one_process:
                result = run_in_process(variant, kind, SPECS[(kind, args.size)], steps, args.warmup, args.device,
                                        args.threads)  # fmt: skip
            else:
                result = _spawn(variant, kind, args, steps)
            loads.append(_harness.load_average())
            print(f"  {kind:<6} {variant:<21} {result['step_ms_median']:9.2f} ms", flush=True)
            return result

        return run

    # The variant list, --repeats times: in order, each run a fresh child process; or, with --one-process, in this
    # process with the order rotated every round.
    out = args.out or _harness.default_out(f"step_{args.device}")

    def result_of(samples: dict[str, list[dict[str, Any]]], rounds_done: int) -> dict[str, Any]:
        rows = [combine(group, SPECS[(key.split("/")[0], args.size)].batch) for key, group in samples.items()
                if group]  # fmt: skip
        add_ratios(rows)
        return {
            "benchmark": "step",
            "command": _harness.command(argv),
            **_harness.machine(args.device),
            "threads": args.threads,
            "size": args.size,
            "specs": {kind: vars(SPECS[(kind, args.size)]) for kind in kinds},
            "steps": args.steps,
            "fp16_steps": fp16_steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rounds_done": rounds_done,
            "method": ("one process, each variant built once and trained on, rotated rounds" if args.persistent
                       else "one process, rotated rounds" if args.one_process else "a child process per run"),
            "loadavg": loads,
            "wall_seconds": time.perf_counter() - started,
            "rows": rows,
            "targets": check_targets(rows, args.device),
        }

    def after_round(index: int, samples: dict[str, list[dict[str, Any]]]) -> None:
        if args.one_process and index + 1 < args.repeats:  # a run cut short keeps the rounds it finished
            _harness.write_json(out, result_of(samples, index + 1), default=str)

    samples = _harness.interleave({f"{kind}/{variant}": sample(kind, variant) for kind in kinds
                                   for variant in args.variants}, args.repeats, rotate=args.one_process,
                                  after_round=after_round)  # fmt: skip
    result = result_of(samples, args.repeats)
    rows = result["rows"]
    print(table(rows, pad=True))
    print(NOTE + ("\n" + CPU_NOTE if args.device == "cpu" else ""))
    for check in result["targets"]:
        print(f"target [{check['model']}] {check['target']}: {check['value']:.3f} -> "
              f"{'MET' if check['met'] else 'NOT MET'}")
    _harness.save(out, result, {"": table(rows) + "\n\n" + NOTE}, default=str)
    return result


if __name__ == "__main__":
    main()
