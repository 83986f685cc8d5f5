"""The O1 engine against torch.autocast, per training step of a host-bound model: the CPU proxy of issue 25's GPU goals.

The model is plugin_overhead.py's: CIFAR ResNet-18's topology (62 parameter tensors, 21 batch norms) at a tiny width
(``--width 2``) on a 2x3x8x8 batch, so a step costs Python and dispatch, as the real ResNet-18 and GPT-2 steps do on
an H100 (host share 0.99). Its ops (convolutions, batch norm, ReLU, residual adds, a mean, a linear head, cross
entropy) get the same dtypes from O1's default table as from ``torch.autocast`` on either device, so each pair below
compares engines doing the same arithmetic. Rows (``--variants`` picks a subset):

* ``loop-autocast``: a hand-written AdamW loop in ``torch.autocast`` (``GradScaler`` for float16): the core rows'
  reference;
* ``loop-autocast-checked``: the same loop at bfloat16 with the skip guarantee ``Amp`` gives at every dtype, written
  with torch alone (the gradients checked for inf/NaN in torch's one kernel, read on the host, the step skipped on a
  hit: step.py's ``autocast-checked``); ``core-O1-aligned`` is judged against it too (float16: ``loop-autocast``);
* ``core-O1``: the ``Amp`` loop at O1 with no table given: ``CastTable.for_device(device)``, which on CUDA is autocast's
  (no mode) and on CPU the default table (it differs from CPU autocast's narrow lists, see
  tests/test_autocast_agreement.py, so the scope pushes the Python mode);
* ``core-O1-aligned``: the same with ``CastTable.autocast_aligned(device)`` (no difference, no mode: autocast alone):
  on CPU, the engine that O1 runs by default on CUDA, so the CPU row that stands for the GPU default;
* ``core-O1-mode``: the same with ``engine="mode"`` (the Python policy casting every call: the engine before);
* ``bf16-mixed`` (``16-mixed`` with ``--device cuda``): ``Trainer.fit`` with Lightning's own AMP: the plugin rows'
  reference;
* ``plugin-O1``, ``plugin-O1-aligned``, ``plugin-O2``: ``Trainer.fit`` with ``MixedPrecisionPlugin`` (same Trainer).

Method (plugin_overhead.py's): one run is ``--warmup`` + ``--steps`` steps in a fresh model; a step is the clock from
one batch start to the next (process CPU time on CPU, wall time with a sync on CUDA); each run is summarised by the
20th percentile of its steps; every variant runs once per repeat, the order rotated, ``--repeats`` times; a ratio is
taken within each repeat and the median (min, max) over repeats reported. The goal of issue 25: each ratio <= 1.03.

``--instructions N`` counts instead (the core rows by default; ``--variants`` adds the Trainer rows, each against
``bf16-mixed``): each row runs in its own process under ``valgrind --tool=callgrind`` twice, with ``--warmup`` steps
and then with ``N`` more, and the difference over ``N`` is its instructions per step (the whole step: forward,
backward, optimizer, Amp's bookkeeping; for the Trainer rows, Lightning's loop too). Unlike time, the count does not
move with the load of a shared machine, but a row's count still moves between processes of the same code (by 1-2 % per
step over 20 steps, within 0.6 % over 60 in stop 33's three runs): count 60 steps for a verdict near the goal.

``--phases`` also splits the Trainer rows' steps at Lightning's ``on_before_backward`` and ``on_after_backward``
hooks: ``forward`` (the training step, its ``zero_grad`` included), ``backward``, and ``step`` (the optimizer step,
the scale update and the loop's own work until the next batch), each run's 20th percentile per phase and its
difference to ``bf16-mixed`` within the repeat: where a row's extra time is spent.

    python benchmarks/o1_proxy.py [--device cpu|cuda] [--steps 60] [--warmup 15] [--repeats 6] [--phases] [--out PATH]
    python benchmarks/o1_proxy.py --instructions 60 [--warmup 5] [--jobs 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness  # noqa: E402
import step  # noqa: E402
from plugin_overhead import BLOCKS, _quiet, _Timer  # noqa: E402
from step import ModelSpec, build_model, make_batches  # noqa: E402

CORE = ("loop-autocast", "loop-autocast-checked", "core-O1", "core-O1-aligned", "core-O1-mode")
TRAINER = ("reference", "plugin-O1", "plugin-O1-aligned", "plugin-O2")
VARIANTS = CORE + TRAINER
#: (row, its reference): the ratios the goal is about.
PAIRS = (
    ("core-O1", "loop-autocast"),
    ("core-O1-aligned", "loop-autocast"),
    ("core-O1-aligned", "loop-autocast-checked"),
    ("core-O1-mode", "loop-autocast"),
    ("plugin-O1", "reference"),
    ("plugin-O1-aligned", "reference"),
    ("plugin-O2", "reference"),
)
GOAL = 1.03


def half_dtype(device: str) -> torch.dtype:
    return torch.float16 if device == "cuda" else torch.bfloat16


def reference_name(device: str) -> str:
    return "16-mixed" if device == "cuda" else "bf16-mixed"


def _table(variant: str, device: str) -> Any:
    from lightning_mpx import CastTable

    return CastTable.autocast_aligned(device) if variant.endswith("-aligned") else None


def run_loop(variant: str, spec: ModelSpec, batches: list[Any], total: int, device: str, clock: str) -> list[float]:
    from lightning_mpx import Amp

    torch.manual_seed(0)
    net = build_model("resnet", spec).to(device)
    timer = _Timer(torch.cuda.synchronize if device == "cuda" else (lambda: None), clock)
    dtype = half_dtype(device)
    if variant.startswith("loop-"):
        one, _ = step.loop_step(variant.removeprefix("loop-"), net, device, dtype)
    else:
        amp = Amp("O1", half_dtype=dtype, on_floor="continue", cast_table=_table(variant, device))
        if variant == "core-O1-mode":
            amp.policy.engine = "mode"
        net = amp.prepare_model(net)
        optimizer = amp.prepare_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))

        def one(x: Any, y: Any) -> None:
            with amp.forward_context():
                loss = step._loss(net(x), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)

    loader = iter(step.ListDataset(batches, total))
    for _ in range(total):
        timer.mark()
        one(*next(loader))
    timer.mark()
    return timer.step_times()


PHASES = ("forward", "backward", "step")


def run_trainer(variant: str, spec: ModelSpec, batches: list[Any], total: int, device: str, clock: str,
                phases: dict[str, list[float]] | None = None) -> list[float]:
    """``total`` steps of ``Trainer.fit``; returns the step times. ``phases``: also filled with each step's
    ``forward`` (batch start to Lightning's ``on_before_backward``: the training step, its zero_grad included),
    ``backward`` (to ``on_after_backward``) and ``step`` (from there to the next batch start: the optimizer step,
    the scale update and the loop's own work), in seconds."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    torch.manual_seed(0)
    net = build_model("resnet", spec)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timer = _Timer(sync, clock)
    inner = {"before": _Timer(sync, clock), "after": _Timer(sync, clock)}

    class Mark(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            timer.mark()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            timer.mark()

    class PhaseMark(Mark):
        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            inner["before"].mark()

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            inner["after"].mark()

    if variant == "reference":
        kwargs: dict[str, Any] = {"precision": reference_name(device)}
    else:
        level = variant.split("-")[1]
        kwargs = {"plugins": [MixedPrecisionPlugin(level, half_dtype=half_dtype(device), on_floor="continue",
                                                   cast_table=_table(variant, device))]}
    with _quiet():
        step.fit(net, batches, total, device, [Mark() if phases is None else PhaseMark()], False, **kwargs)
    if phases is not None:
        starts, before, after = timer.starts, inner["before"].starts, inner["after"].starts
        phases["forward"] = [b - a for a, b in zip(starts, before)]
        phases["backward"] = [b - a for a, b in zip(before, after)]
        phases["step"] = [b - a for a, b in zip(after, starts[1:])]
    return timer.step_times()


def _count(variant: str, steps: int, warmup: int, width: int, workdir: Path) -> int:
    """Instructions of one child process (warm-up, then ``steps`` steps of ``variant``) under callgrind."""
    out = workdir / f"{variant}-{steps}.callgrind"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                           "--_child", variant, str(steps), str(warmup), str(width)],
                          capture_output=True, text=True, env=env, timeout=3600)  # fmt: skip
    match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"{variant}: valgrind exited {done.returncode}:\n{done.stderr[-2000:]}")
    out.unlink(missing_ok=True)
    return int(match.group(1))


def instructions(args: argparse.Namespace) -> dict[str, Any]:
    """Instructions per step of the chosen rows, each against its reference (the core rows against the autocast
    loop, the Trainer rows against Lightning's "bf16-mixed" on the same Trainer)."""
    variants = [v for v in VARIANTS if v in args.variants] or list(CORE)
    for reference in ("loop-autocast", "loop-autocast-checked", "reference"):
        if any(ref == reference and row in variants for row, ref in PAIRS) and reference not in variants:
            variants.insert(0, reference)
    jobs = [(v, n) for v in variants for n in (0, args.instructions)]
    with tempfile.TemporaryDirectory(prefix="o1-proxy-cg-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(jobs, pool.map(lambda j: _count(j[0], j[1], args.warmup, args.width, Path(tmp)), jobs)))
    per_step = {v: (counts[(v, args.instructions)] - counts[(v, 0)]) / args.instructions for v in variants}
    rows = [{"row": v, "reference": v, "instructions_per_step": per_step[v], "ratio": 1.0}
            for v in variants if not any(row == v for row, _ in PAIRS)]
    rows += [{"row": row, "reference": ref, "instructions_per_step": per_step[row],
              "ratio": per_step[row] / per_step[ref]}
             for row, ref in PAIRS if row in per_step and ref in per_step]
    table = _harness.markdown_table(["row", "instructions/step", "reference", "ratio"],
                                    [[r["row"], f"{r['instructions_per_step']:,.0f}", r["reference"],
                                      f"{r['ratio']:.4f}x"] for r in rows])
    print(f"instructions per step (callgrind, {args.instructions} steps after {args.warmup}):\n{table}")
    return {"rows": rows, "table": table}


def _child(variant: str, steps: int, warmup: int, width: int) -> None:
    torch.set_num_threads(1)
    spec = ModelSpec(batch=2, image=8, width=width, blocks=BLOCKS)
    runner = run_trainer if variant in TRAINER else run_loop
    runner(variant, spec, make_batches("resnet", spec, 8, torch.device("cpu")), warmup + steps, "cpu", "cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--_child"]:
        _child(raw[1], int(raw[2]), int(raw[3]), int(raw[4]))
        return {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps at the start of every run")
    parser.add_argument("--repeats", type=int, default=6, help="runs of every variant, the order rotated")
    parser.add_argument("--width", type=int, default=2, help="channels of the first stage (ResNet-18: 64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--instructions", type=int, default=0, metavar="N",
                        help="count instructions per step of the core rows over N steps (callgrind) instead of timing")
    parser.add_argument("--jobs", type=int, default=2, help="--instructions: valgrind processes at once")
    parser.add_argument("--phases", action="store_true",
                        help="also time the Trainer rows' forward, backward and step phases (Lightning's hooks)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=_harness.default_out("o1_proxy"))
    args = parser.parse_args(argv)
    if args.steps < 5 or args.warmup < 0 or args.repeats < 1 or args.width < 1:
        parser.error(f"--steps={args.steps} must be at least 5, --warmup={args.warmup} at least 0, "
                     f"--repeats={args.repeats} and --width={args.width} at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device and none is available; use --device cpu")
    clock = "wall" if args.device == "cuda" else "cpu"
    if args.instructions:
        if args.device != "cpu":
            parser.error("--instructions counts on CPU only (valgrind)")
        counted = instructions(args)
        result = {"benchmark": "o1_proxy_instructions", "label": args.label, "command": _harness.command(argv),
                  **_harness.machine("cpu"), "width": args.width, "steps": args.instructions, "warmup": args.warmup,
                  "rows": counted["rows"]}
        _harness.save(args.out, result, {"instructions per step": counted["table"]})
        return result
    variants = list(dict.fromkeys(
        [ref for row, ref in PAIRS if row in args.variants and ref not in args.variants] + args.variants))
    torch.set_num_threads(args.threads)
    spec = ModelSpec(batch=2, image=8, width=args.width, blocks=BLOCKS)
    batches = make_batches("resnet", spec, 8, torch.device(args.device))
    total = args.warmup + args.steps + 1
    machine = _harness.machine(args.device)
    ref = reference_name(args.device)
    shown = {v: ref if v == "reference" else v for v in VARIANTS}

    # Per Trainer row and phase, each run's 20th percentile (ms), with --phases.
    phase_samples: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in variants if v in TRAINER}

    def run(variant: str, steps: int, phases: dict[str, list[float]] | None = None) -> list[float]:
        if variant in TRAINER:
            return run_trainer(variant, spec, batches, steps, args.device, clock, phases)
        return run_loop(variant, spec, batches, steps, args.device, clock)

    def timed(variant: str) -> Callable[[], float]:
        def once() -> float:
            gc.collect()
            phases: dict[str, list[float]] | None = {} if args.phases and variant in TRAINER else None
            ms = [t * 1e3 for t in run(variant, total, phases)[args.warmup:]]
            for name, times in (phases or {}).items():
                phase_samples[variant][name].append(
                    statistics.quantiles([t * 1e3 for t in times[args.warmup:]], n=5)[0]
                )
            return statistics.quantiles(ms, n=5)[0]

        return once

    def progress(index: int, samples: dict[str, list[float]]) -> None:
        print(f"repeat {index + 1}/{args.repeats} (p20 ms): "
              + ", ".join(f"{shown[v]} {samples[v][-1]:.3f}" for v in variants), flush=True)

    with tempfile.TemporaryDirectory(prefix="o1-proxy-"):
        for variant in variants:  # imports and first-call set-up: not timed
            run(variant, 6)
        samples = _harness.interleave({v: timed(v) for v in variants}, args.repeats, after_round=progress)
    rows = []
    for row, base in PAIRS:
        if row in samples and base in samples:
            ratios = [a / b for a, b in zip(samples[row], samples[base])]
            rows.append({"row": shown[row], "reference": shown[base], "ratio": statistics.median(ratios),
                         "min": min(ratios), "max": max(ratios), "ratios": ratios,
                         "row_ms": statistics.median(samples[row]), "reference_ms": statistics.median(samples[base]),
                         "meets_goal": statistics.median(ratios) <= GOAL})
    tables = {"ratios within a repeat (p20 of each run's steps)": _harness.markdown_table(
        ["row", "reference", "row ms", "reference ms", "ratio", "min", "max", f"<= {GOAL}"],
        [[r["row"], r["reference"], f"{r['row_ms']:.3f}", f"{r['reference_ms']:.3f}", f"{r['ratio']:.3f}",
          f"{r['min']:.3f}", f"{r['max']:.3f}", "yes" if r["meets_goal"] else "no"] for r in rows])}
    phase_rows = []
    if args.phases:
        base = phase_samples.get("reference")
        for variant, by_phase in phase_samples.items():
            row = {"row": shown[variant], **{p: statistics.median(by_phase[p]) for p in PHASES}}
            if base is not None:  # the difference to the reference within each repeat, then its median
                row.update({f"{p}_minus_reference": statistics.median(
                    [a - b for a, b in zip(by_phase[p], base[p])]) for p in PHASES})
            phase_rows.append(row)
        tables[f"phases of the Trainer rows (p20 ms of each run, median over repeats; minus {ref} within a repeat)"] = (
            _harness.markdown_table(
                ["row", *PHASES, *(f"{p} - {ref}" for p in PHASES)],
                [[r["row"], *(f"{r[p]:.3f}" for p in PHASES),
                  *(f"{r[p + '_minus_reference']:+.3f}" if p + "_minus_reference" in r else "-" for p in PHASES)]
                 for r in phase_rows]))
    print(f"lightning_mpx from {machine['package_path']}; {args.device}, {clock} clock, {args.repeats} repeats of "
          f"{args.steps} steps, load {machine['loadavg']}")
    for title, text in tables.items():
        print(f"\n{title}:\n{text}")
    result = {
        "benchmark": "o1_proxy",
        "label": args.label,
        "command": _harness.command(argv),
        **machine,
        "half_dtype": str(half_dtype(args.device)).removeprefix("torch."),
        "reference": ref,
        "clock": clock,
        "loadavg": [machine["loadavg"], _harness.load_average()],
        "model": {"blocks": list(BLOCKS), "width": args.width, "batch": 2, "image": 8},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "samples_ms": {shown[v]: samples[v] for v in variants},
        "rows": rows,
        "phases": phase_rows,
        "goal": GOAL,
    }
    _harness.save(args.out, result, tables)
    return result


if __name__ == "__main__":
    main()
