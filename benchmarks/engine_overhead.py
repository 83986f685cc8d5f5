"""Host-side cost of the engine's per-step work (``Amp.step`` + ``Amp.update``), excluding forward and backward.

A model of ``--params`` small parameters (``Linear(8, 8)`` layers side by side, so the arithmetic is negligible and
what is left is per-parameter Python and dispatch) is trained with plain SGD. For each opt level the script times

* ``engine``: ``amp.step(optimizer); amp.update(); optimizer.zero_grad()`` per iteration (median of ``--repeats``
  runs of ``--steps`` iterations), which includes SGD's own per-parameter work;
* ``grad_pairs`` and ``finish_step``: the engine's two per-parameter bookkeeping passes alone (best of 5, timeit).

It is the before/after measurement of the "per-step Python work" fix in ``docs/benchmarks.md``; run it once with
``PYTHONPATH`` pointing at each version.

Telemetry rows (float16, dynamic scale): two identical engines side by side in one process, ``on`` (underflow and
headroom telemetry requested every ``--telemetry-every`` iterations, as the Lightning plugin does on logging steps)
and ``off`` (never requested), stepping in turn, one iteration each (``--steps`` iterations per repeat, the order
swapped every repeat, ``--repeats`` times), with two such pairs built in opposite orders to cancel a bias of
construction order. Reported: the engine time of ``on``'s non-logging iterations against ``off``'s iterations (the
acceptance: equal within noise), and ``on``'s logging iterations (the request, the measuring unscale, and building
``Amp.metrics()``), whose extra cost over ``off`` is the price of a logging step.

    python benchmarks/engine_overhead.py [--params 150] [--steps 200] [--repeats 5] [--telemetry-every 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lightning_mpx
from lightning_mpx import Amp

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs


class _SideBySide(nn.ModuleList):
    """Layers applied to the same input and summed: many parameters, no deep chain to overflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self)  # type: ignore[return-value]


def measure(level: str, params: int, steps: int, repeats: int) -> dict[str, Any]:
    """Per-iteration engine time and the two bookkeeping passes for one opt level (bfloat16)."""
    torch.manual_seed(0)
    model = _SideBySide([nn.Linear(8, 8) for _ in range(max(1, params // 2))])
    amp = Amp(level, half_dtype="bfloat16")
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(4, 8)

    def backward() -> None:
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().sum()
        amp.backward(loss)

    def engine() -> None:
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(20):
        backward()
        engine()
    runs = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(steps):
            backward()
            start = time.perf_counter()
            engine()
            total += time.perf_counter() - start
        runs.append(total / steps * 1e6)
    backward()
    state = amp._state(optimizer)
    grad_pairs = min(timeit.repeat(lambda: amp._grad_pairs(optimizer), number=200, repeat=5)) / 200 * 1e6
    finish = min(timeit.repeat(lambda: amp._finish_step(state), number=200, repeat=5)) / 200 * 1e6
    return {
        "opt_level": level,
        "parameters": sum(1 for _ in model.parameters()),
        "engine_us_per_step": statistics.median(runs),
        "engine_us_runs": runs,
        "grad_pairs_us": grad_pairs,
        "finish_step_us": finish,
    }


def measure_telemetry(level: str, params: int, steps: int, repeats: int, every: int) -> dict[str, Any]:
    """Engine time per iteration with telemetry requested every ``every`` iterations (non-logging and logging
    iterations apart) and without it, the two engines stepping in turn (float16).

    Two pairs of engines are built, one in each order ("on" first, then "off" first), and every repeat runs both:
    on this machine the engine built first is a few percent slower at O2 whatever it does (an A/A run shows it), and
    the two orders cancel that out.
    """
    engines: dict[tuple[int, str], tuple[Amp, nn.Module, torch.optim.Optimizer]] = {}
    for pair, order in enumerate((("on", "off"), ("off", "on"))):
        for name in order:
            torch.manual_seed(0)
            model = _SideBySide([nn.Linear(8, 8) for _ in range(max(1, params // 2))])
            amp = Amp(level, half_dtype="float16", init_scale=2.0**10)
            model = amp.prepare_model(model)
            optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
            engines[pair, name] = (amp, model, optimizer)
    x = torch.randn(4, 8)
    counters = dict.fromkeys(engines, 0)
    times: dict[str, list[float]] = {"on_nonlogging": [], "on_logging": [], "off": []}
    repeat_means: dict[str, list[float]] = {"on_nonlogging": [], "off": []}

    def iteration(key: tuple[int, str]) -> tuple[bool, float]:
        amp, model, optimizer = engines[key]
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().sum()
        amp.backward(loss)
        logging = key[1] == "on" and counters[key] % every == 0
        counters[key] += 1
        start = time.perf_counter()
        if logging:
            amp.request_telemetry()
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad(set_to_none=True)
        if logging:
            amp.metrics()  # what a logging step builds (device tensors; the logger's read is not counted)
        return logging, (time.perf_counter() - start) * 1e6

    for key in engines:  # warm-up, the telemetry path included (iteration 0 logs)
        for _ in range(20):
            iteration(key)
    for repeat in range(repeats):
        names = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        means: dict[str, list[float]] = {"on_nonlogging": [], "off": []}
        for pair in (0, 1):
            for _ in range(steps):
                for name in names:  # one iteration each, in turn: a change of load hits both alike
                    logging, us = iteration((pair, name))
                    kind = "off" if name == "off" else "on_logging" if logging else "on_nonlogging"
                    times[kind].append(us)
                    if kind != "on_logging":
                        means[kind].append(us)
        for kind, values in means.items():
            repeat_means[kind].append(statistics.mean(values))
    on, off = statistics.median(times["on_nonlogging"]), statistics.median(times["off"])
    logging_us = statistics.median(times["on_logging"]) if times["on_logging"] else float("nan")
    return {
        "opt_level": level,
        "parameters": sum(1 for _ in engines[0, "on"][1].parameters()),
        "telemetry_every": every,
        "off_us_median": off,
        "on_nonlogging_us_median": on,
        "nonlogging_vs_off_pct": (on / off - 1) * 100,
        "off_repeat_means_us": repeat_means["off"],
        "on_nonlogging_repeat_means_us": repeat_means["on_nonlogging"],
        "on_logging_us_median": logging_us,
        "logging_extra_us": logging_us - off,
        "logging_iterations": len(times["on_logging"]),
        "measurements": sum(engines[pair, "on"][0].telemetry.measurements for pair in (0, 1)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=150, help="number of parameter tensors (GPT-2 small: 148)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", nargs="+", choices=("O1", "O2", "O3"), default=["O1", "O2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--telemetry-every", type=int, default=10, help="logging interval of the telemetry rows")
    parser.add_argument("--no-telemetry", action="store_true", help="skip the telemetry rows")
    parser.add_argument("--label", default="", help="a name for this version in the JSON (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine_overhead.json")
    args = parser.parse_args(argv)
    if args.params < 2 or args.steps < 1 or args.repeats < 1 or args.telemetry_every < 1:
        parser.error("--params must be at least 2, --steps, --repeats and --telemetry-every at least 1")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = [measure(level, args.params, args.steps, args.repeats) for level in args.levels]
    header = f"{'level':<6} {'params':>7} {'engine us/step':>15} {'grad_pairs us':>14} {'finish_step us':>15}"
    print(f"lightning_mpx from {Path(lightning_mpx.__file__).parent}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['opt_level']:<6} {r['parameters']:>7} {r['engine_us_per_step']:>15.0f} {r['grad_pairs_us']:>14.1f} "
              f"{r['finish_step_us']:>15.1f}")
    telemetry_rows = []
    if not args.no_telemetry:
        telemetry_rows = [
            measure_telemetry(level, args.params, args.steps, args.repeats, args.telemetry_every)
            for level in args.levels
        ]
        header = (
            f"{'telemetry':<9} {'params':>7} {'off us':>8} {'on, non-logging us':>19} {'diff %':>7} "
            f"{'on, logging us':>15} {'logging extra us':>17}"
        )
        print()
        print(f"telemetry requested every {args.telemetry_every} iterations (float16), engines in turn; medians")
        print(header)
        print("-" * len(header))
        for r in telemetry_rows:
            print(
                f"{r['opt_level']:<9} {r['parameters']:>7} {r['off_us_median']:>8.0f} "
                f"{r['on_nonlogging_us_median']:>19.0f} {r['nonlogging_vs_off_pct']:>+7.1f} "
                f"{r['on_logging_us_median']:>15.0f} {r['logging_extra_us']:>17.0f}"
            )
    result = {
        "benchmark": "engine_overhead",
        "label": args.label,
        "package_path": str(Path(lightning_mpx.__file__).parent),
        "device": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "loadavg": [load_before, os.getloadavg()],
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        "telemetry_rows": telemetry_rows,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
