"""What overflow forensics costs: nothing on a clean step by default, the hooks when watching, the record on overflow.

A stack of ``--layers`` ``Linear(64, 64) + ReLU`` blocks is trained with SGD through :class:`lightning_mpx.Amp` on
CPU (one thread). Rows, each the median over ``--repeats`` runs of the mean thread CPU time over ``--steps``
iterations:

* ``clean-step``: ``amp.step; amp.update; zero_grad`` of an iteration that does not overflow (the engine's per-step
  host cost; with ``diagnose_overflows=False`` forensics adds nothing here but two attribute reads);
* ``iteration``: forward + backward + the same, with the forward watched (``diagnose_overflows=True``) or not;
* ``overflow-step``: ``amp.step`` of an iteration whose gradients hold an inf (builds ``amp.last_overflow``).

Run it with ``PYTHONPATH`` pointing at a version without forensics too: the rows that need ``diagnose_overflows``
are then left out and the ``clean-step`` row is the "before".

    python benchmarks/forensics_overhead.py [--layers 16] [--steps 100] [--repeats 5] [--level O2] [--out PATH]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import lightning_mpx
from lightning_mpx import Amp

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs

HAS_FORENSICS = "diagnose_overflows" in inspect.signature(Amp).parameters


def _setup(level: str, layers: int, diagnose: bool | None) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(64, 64), nn.ReLU()]
    settings: dict[str, Any] = {"half_dtype": "bfloat16", "loss_scale": "dynamic"}
    if diagnose is not None:
        settings["diagnose_overflows"] = diagnose
    amp = Amp(level, **settings)
    model = amp.prepare_model(nn.Sequential(*blocks))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))


def _timed(setup: Callable[[], None], timed: Callable[[], None], steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean CPU time of ``timed`` (after ``setup``, untimed), in microseconds.

    CPU time of this thread (torch runs on it with one thread), not wall time: on a shared machine the time the
    process waits for a core would otherwise swamp differences of a few microseconds."""
    for _ in range(10):
        setup()
        timed()
    runs = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(steps):
            setup()
            start = time.thread_time()
            timed()
            total += time.thread_time() - start
        runs.append(total / steps * 1e6)
    return statistics.median(runs)


def measure(level: str, layers: int, steps: int, repeats: int) -> list[dict[str, Any]]:
    x = torch.randn(16, 64)
    rows = []
    variants: list[tuple[str, bool | None]] = [("off", False), ("watched", True)] if HAS_FORENSICS else [("-", None)]
    for name, diagnose in variants:
        amp, model, optimizer = _setup(level, layers, diagnose)
        first = next(model.parameters())

        def backward(inject: bool = False) -> None:
            if inject:  # the scale halves on every overflow: keep it off its floor (which would arm the watch)
                amp.scalers[0].scale_tensor.fill_(2.0**16)
            with amp.forward_context():
                loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().square().mean()
            amp.backward(loss)
            if inject:
                first.grad.view(-1)[0] = float("inf")

        def engine() -> None:
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)

        def iteration() -> None:
            backward()
            engine()

        def nothing() -> None:
            pass

        rows.append({"row": "clean-step", "diagnose": name,
                     "us": _timed(backward, engine, steps, repeats)})  # fmt: skip
        rows.append({"row": "iteration", "diagnose": name, "us": _timed(nothing, iteration, steps, repeats)})
        if HAS_FORENSICS:
            rows.append({"row": "overflow-step", "diagnose": name,
                         "us": _timed(lambda: backward(inject=True), engine, max(1, steps // 5), repeats)})  # fmt: skip
    for row in rows:
        row.update(opt_level=level, modules=len(list(model.modules())), parameters=len(list(model.parameters())))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--level", choices=("O1", "O2"), default="O2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="", help="a name for this version in the JSON (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "forensics_overhead.json")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--layers, --steps and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = measure(args.level, args.layers, args.steps, args.repeats)
    print(f"lightning_mpx from {Path(lightning_mpx.__file__).parent}; {args.level} bfloat16, {args.layers} blocks")
    header = f"{'row':<14} {'diagnose':<9} {'us':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['row']:<14} {r['diagnose']:<9} {r['us']:>10.1f}")
    result = {
        "benchmark": "forensics_overhead",
        "label": args.label,
        "package_path": str(Path(lightning_mpx.__file__).parent),
        "device": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "loadavg": [load_before, os.getloadavg()],
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
