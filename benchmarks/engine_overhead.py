"""Host time of the engine's own per-step work (``Amp.step`` + ``Amp.update``), and what its optional parts add.

CPU, one thread, plain SGD, models whose arithmetic is negligible, so that what is left is per-parameter Python and
dispatch: the cost a GPU step hides only while the host stays ahead of the device. Four parts (``--parts``):

* ``engine``: ``amp.step(optimizer); amp.update(); optimizer.zero_grad()`` per iteration at each ``--levels`` level
  (bfloat16), on ``--params`` parameter tensors (``Linear(8, 8)`` layers side by side); the median and IQR over
  ``--repeats`` runs of ``--steps`` iterations (SGD's own per-parameter work included).
* ``telemetry``: underflow and headroom telemetry (float16, dynamic scale). Two identical engines side by side in
  one process, ``on`` (telemetry requested every ``--telemetry-every`` iterations, as the Lightning plugin does on
  logging steps) and ``off`` (never), stepping in turn, one iteration each, the order swapped every repeat, with
  two such pairs built in opposite orders (an A/A run showed the engine built first a few percent slower). Read:
  ``on``'s non-logging iterations against ``off``'s (equal within noise is the claim) and ``on``'s logging
  iterations (the request, the measuring unscale and ``Amp.metrics()``): the price of a logging step.
* ``forensics``: overflow forensics on a stack of ``--layers`` ``Linear(64, 64) + ReLU`` blocks, unwatched (the
  default, ``diagnose_overflows=False``) and watched (``True``): ``clean-step`` (the engine's calls on an iteration
  that does not overflow), ``iteration`` (forward + backward + the same) and ``overflow-step`` (``amp.step`` on
  gradients holding an inf: builds ``amp.last_overflow``). Thread CPU time, median over the repeats.
* ``writes``: O2's check for writes to the half model that every step runs first, alone, after a write pattern:
  ``nothing`` (the common step, ``model_writes="versions"``), ``data_read`` (every ``p.data`` read, each then
  compared once), ``data_clamp`` (WGAN's ``p.data.clamp_`` on every parameter), ``values_nothing`` /
  ``values_clamp`` (``model_writes="values"``: every parameter compared at every check), and the patterns alone
  (``pattern_read``, ``pattern_clamp``) so that the check's share can be read off. Rotated rounds of ``--steps``
  calls, microseconds per check.
* ``skip``: ``skip_on_device`` with ``AdamW(fused=True)`` (bfloat16): the default's host read of the overflow flag
  against the flag handed to the fused step, with the deferred outcome read right after the step so that all of its
  host work is counted; two engines in turn, one iteration each, the order swapped every repeat. On a CPU nothing
  runs ahead of the host, so this is the host work only: what a GPU gains (no wait for the backward per step) is not
  in it.

``--instructions N`` counts instead of timing: per ``--levels`` level, a child process under
``valgrind --tool=callgrind`` runs five warm-up iterations and then ``N`` more (forward, backward,
``amp.step``, ``amp.update``, ``zero_grad``; bfloat16, SGD, ``--params`` tensors), once with ``N`` and once with none,
and the difference over ``N`` is the instructions of one iteration. The count does not move with the load of a shared
machine, so two trees compare on one figure each: the host cost of a step.

For a before/after figure run it once with ``PYTHONPATH`` on each version (``--label`` names them in the JSON).

    python benchmarks/engine_overhead.py [--parts engine telemetry forensics writes skip] [--levels O1 O2]
        [--params 150] [--steps 200] [--repeats 5] [--telemetry-every 10] [--layers 16] [--label L] [--out PATH]
    python benchmarks/engine_overhead.py --instructions 40 [--levels O1 O2] [--params 150] [--label L]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs
import torch
from torch import nn

from lightning_mpx import Amp

PARTS = ("engine", "telemetry", "forensics", "writes", "skip")


class _SideBySide(nn.ModuleList):
    """Layers applied to the same input and summed: many parameters, no deep chain to overflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self)  # type: ignore[return-value]


def _engine(level: str, params: int, *, fused_adamw: bool = False,
            **settings: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    amp = Amp(level, **settings)
    model = amp.prepare_model(_SideBySide([nn.Linear(8, 8) for _ in range(max(1, params // 2))]))
    if fused_adamw:
        return amp, model, amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))


def _iteration(amp: Amp, model: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward through the engine (untimed in every part but forensics' ``iteration``)."""
    with amp.forward_context():
        loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().sum()
    amp.backward(loss)


def _step(amp: Amp, optimizer: torch.optim.Optimizer) -> None:
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad(set_to_none=True)


# -- engine -----------------------------------------------------------------------------------------------------------
def measure(level: str, params: int, steps: int, repeats: int) -> dict[str, Any]:
    """Per-iteration engine time at ``level`` (bfloat16): median and IQR over the repeats' means."""
    amp, model, optimizer = _engine(level, params, half_dtype="bfloat16")
    x = torch.randn(4, 8)
    for _ in range(20):
        _iteration(amp, model, x)
        _step(amp, optimizer)
    runs = [_harness.per_call_us(lambda: _step(amp, optimizer), steps, setup=lambda: _iteration(amp, model, x))
            for _ in range(repeats)]  # fmt: skip
    spread = _harness.spread(runs)
    return {
        "opt_level": level,
        "parameters": sum(1 for _ in model.parameters()),
        "engine_us_per_step": spread.median,
        "engine_us_iqr": spread.iqr,
        "engine_us_runs": runs,
    }


# -- telemetry --------------------------------------------------------------------------------------------------------
def measure_telemetry(level: str, params: int, steps: int, repeats: int, every: int) -> dict[str, Any]:
    """Engine time per iteration with telemetry requested every ``every`` iterations (non-logging and logging
    iterations apart) and without it, the two engines stepping in turn (float16); see the module's docstring."""
    engines = {(pair, name): _engine(level, params, half_dtype="float16", init_scale=2.0**10)
               for pair, order in enumerate((("on", "off"), ("off", "on"))) for name in order}  # fmt: skip
    x = torch.randn(4, 8)
    counters = dict.fromkeys(engines, 0)
    times: dict[str, list[float]] = {"on_nonlogging": [], "on_logging": [], "off": []}
    repeat_means: dict[str, list[float]] = {"on_nonlogging": [], "off": []}

    def iteration(key: tuple[int, str]) -> tuple[bool, float]:
        amp, model, optimizer = engines[key]
        _iteration(amp, model, x)
        logging = key[1] == "on" and counters[key] % every == 0
        counters[key] += 1
        start = time.perf_counter()
        if logging:
            amp.request_telemetry()
        _step(amp, optimizer)
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


# -- skip -------------------------------------------------------------------------------------------------------------
def measure_skip(level: str, params: int, steps: int, repeats: int) -> dict[str, Any]:
    """Engine time per iteration with ``AdamW(fused=True)`` (bfloat16): the host read of the overflow flag before
    the step (the default) against ``skip_on_device=True`` (the flag handed to the fused step, the outcome read right
    after it, so that the deferred read's host work is counted), the two engines stepping in turn."""
    engines = {name: _engine(level, params, fused_adamw=True, half_dtype="bfloat16", skip_on_device=name == "device")
               for name in ("host", "device")}  # fmt: skip
    x = torch.randn(4, 8)

    def iteration(name: str) -> float:
        amp, model, optimizer = engines[name]
        _iteration(amp, model, x)
        start = time.perf_counter()
        _step(amp, optimizer)
        amp.read_step_outcomes()  # nothing for the host read; the deferred read for skip_on_device
        return (time.perf_counter() - start) * 1e6

    for name in engines:
        for _ in range(20):
            iteration(name)
    means: dict[str, list[float]] = {"host": [], "device": []}
    for repeat in range(repeats):
        names = ("host", "device") if repeat % 2 == 0 else ("device", "host")
        times: dict[str, list[float]] = {"host": [], "device": []}
        for _ in range(steps):
            for name in names:  # one iteration each, in turn
                times[name].append(iteration(name))
        for name, values in times.items():
            means[name].append(statistics.mean(values))
    ratios = [d / h for d, h in zip(means["device"], means["host"])]
    # torch's own share: its fused AdamW's step with and without a found_inf (on a skip-capable step torch corrects
    # the step counters with one _foreach_sub_, a loop over the tensors on a CPU, one kernel on CUDA)
    params = [p.detach().clone().requires_grad_() for p in engines["host"][1].parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    plain = torch.optim.AdamW(params, lr=1e-3, fused=True)
    flag = torch.zeros(())

    def torch_step(with_flag: bool) -> None:
        if with_flag:
            plain.found_inf, plain.grad_scale = flag, None  # type: ignore[attr-defined]
        plain.step()
        if with_flag:
            del plain.found_inf, plain.grad_scale  # type: ignore[attr-defined]

    torch_us = {with_flag: statistics.median(_harness.per_call_us(lambda: torch_step(with_flag), steps)
                                             for _ in range(repeats)) for with_flag in (False, True)}  # fmt: skip
    return {
        "opt_level": level,
        "parameters": sum(1 for _ in engines["host"][1].parameters()),
        "host_read_us": statistics.median(means["host"]),
        "skip_on_device_us": statistics.median(means["device"]),
        "device_vs_host": statistics.median(ratios),
        "device_vs_host_range": [min(ratios), max(ratios)],
        "settings_skip_on_device": {name: engine[0].settings.skip_on_device for name, engine in engines.items()},
        "torch_fused_step_us": torch_us[False],
        "torch_fused_step_with_found_inf_us": torch_us[True],
        "host_read_repeat_means_us": means["host"],
        "skip_on_device_repeat_means_us": means["device"],
    }


# -- forensics --------------------------------------------------------------------------------------------------------
def measure_forensics(level: str, layers: int, steps: int, repeats: int) -> list[dict[str, Any]]:
    """``clean-step``, ``iteration`` and ``overflow-step`` rows, unwatched and watched (bfloat16, dynamic scale)."""
    x = torch.randn(16, 64)
    rows = []
    for name, diagnose in (("off", False), ("watched", True)):
        torch.manual_seed(0)
        amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", diagnose_overflows=diagnose)
        model = amp.prepare_model(nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(64, 64), nn.ReLU()))))
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
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
            _step(amp, optimizer)

        def iteration() -> None:
            backward()
            engine()

        def timed(fn: Callable[[], None], calls: int, setup: Callable[[], None] | None = None) -> float:
            # Thread CPU time: on a shared machine the wait for a core would swamp differences of a few us.
            _harness.per_call_us(fn, 10, setup=setup, clock="thread")  # warm-up
            return statistics.median(_harness.per_call_us(fn, calls, setup=setup, clock="thread")
                                     for _ in range(repeats))  # fmt: skip

        rows.append({"row": "clean-step", "diagnose": name, "us": timed(engine, steps, backward)})
        rows.append({"row": "iteration", "diagnose": name, "us": timed(iteration, steps)})
        rows.append({"row": "overflow-step", "diagnose": name,
                     "us": timed(engine, max(1, steps // 5), lambda: backward(inject=True))})  # fmt: skip
    for row in rows:
        row.update(opt_level=level, modules=len(list(model.modules())), parameters=len(list(model.parameters())))
    return rows


# -- writes -----------------------------------------------------------------------------------------------------------
def _write_check(amp: Amp, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """The check ``amp.step`` runs first at O2 (``Mirror.take_writes``). It has no public entry point of its own, so
    this reaches into the engine: the one line to change when the engine's parts move."""
    (mirror,) = amp._machine.mirrors(amp._state(optimizer), compare=amp.model_writes == "values")
    mirror.take_writes()
    return mirror.take_writes


def _read(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.norm()  # a read of .data, as logging code does


def _clamp(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-1.0, 1.0)


def measure_writes(params: int, calls: int, repeats: int) -> list[dict[str, Any]]:
    """Microseconds per write check after each write pattern, rotated rounds of ``calls`` calls."""
    amp_v, versions_model, versions_opt = _engine("O2", params, model_writes="versions")
    amp_c, values_model, values_opt = _engine("O2", params, model_writes="values")
    versions, values = _write_check(amp_v, versions_opt), _write_check(amp_c, values_opt)
    plain = nn.ModuleList(nn.Linear(8, 8) for _ in range(params // 2)).half()
    cases: dict[str, Callable[[], Any]] = {
        "nothing": versions,
        "data_read": lambda: (_read(versions_model), versions()),
        "data_clamp": lambda: (_clamp(versions_model), versions()),
        "values_nothing": values,
        "values_clamp": lambda: (_clamp(values_model), values()),
        "pattern_read": lambda: _read(plain),
        "pattern_clamp": lambda: _clamp(plain),
    }

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            fn()
            return _harness.per_call_us(fn, calls)

        return run

    samples = _harness.interleave({name: timed(fn) for name, fn in cases.items()}, repeats)
    return [{"case": name, "params": params, "us_median": statistics.median(s), "us_min": min(s), "us_max": max(s)}
            for name, s in samples.items()]  # fmt: skip


# -- main -------------------------------------------------------------------------------------------------------------
def tables(result: dict[str, Any]) -> dict[str, str]:
    """The result's parts as markdown tables."""
    out = {}
    if result["rows"]:
        out["engine: step + update + zero_grad per iteration, bfloat16 (median of the repeats, IQR)"] = \
            _harness.markdown_table(["level", "parameters", "engine us/step", "IQR"], [
                [r["opt_level"], r["parameters"], f"{r['engine_us_per_step']:.0f}",
                 f"{r['engine_us_iqr'][0]:.0f}-{r['engine_us_iqr'][1]:.0f}"] for r in result["rows"]])
    if result["telemetry_rows"]:
        out[f"telemetry every {result['telemetry_rows'][0]['telemetry_every']} iterations, float16, engines in "
            "turn (medians, us)"] = _harness.markdown_table(
            ["level", "parameters", "off", "on, non-logging", "diff %", "on, logging", "logging extra"], [
                [r["opt_level"], r["parameters"], f"{r['off_us_median']:.0f}", f"{r['on_nonlogging_us_median']:.0f}",
                 f"{r['nonlogging_vs_off_pct']:+.1f}", f"{r['on_logging_us_median']:.0f}",
                 f"{r['logging_extra_us']:.0f}"] for r in result["telemetry_rows"]])
    if result.get("skip_rows"):
        out["skip: step + update + zero_grad (+ the outcome's read) per iteration, AdamW(fused=True), bfloat16, "
            "engines in turn (median of the repeats' means, us)"] = _harness.markdown_table(
            ["level", "parameters", "host read", "skip_on_device", "ratio per repeat [min, max]",
             "torch's fused step", "with found_inf"], [
                [r["opt_level"], r["parameters"], f"{r['host_read_us']:.0f}", f"{r['skip_on_device_us']:.0f}",
                 f"{r['device_vs_host']:.3f} [{r['device_vs_host_range'][0]:.3f}, {r['device_vs_host_range'][1]:.3f}]",
                 f"{r['torch_fused_step_us']:.0f}", f"{r['torch_fused_step_with_found_inf_us']:.0f}"]
                for r in result["skip_rows"]])
    if result["forensics_rows"]:
        out["forensics: thread CPU time, median of the repeats (us)"] = _harness.markdown_table(
            ["level", "row", "diagnose", "us"],
            [[r["opt_level"], r["row"], r["diagnose"], f"{r['us']:.1f}"] for r in result["forensics_rows"]],
            align="lllr")
    if result["write_check_rows"]:
        out["O2 write check: us per check after each pattern (median, min, max of the rounds)"] = \
            _harness.markdown_table(["case", "parameters", "median", "min", "max"], [
                [r["case"], r["params"], f"{r['us_median']:.1f}", f"{r['us_min']:.1f}", f"{r['us_max']:.1f}"]
                for r in result["write_check_rows"]])
    return out


# -- instructions -----------------------------------------------------------------------------------------------------
def _child(level: str, params: int, steps: int) -> None:
    """The counted process: five warm-up iterations, then ``steps`` more (run under callgrind by the parent)."""
    torch.set_num_threads(1)
    amp, model, optimizer = _engine(level, params, half_dtype="bfloat16")
    x = torch.randn(4, 8)
    for _ in range(5 + steps):
        _iteration(amp, model, x)
        _step(amp, optimizer)


def _count(level: str, params: int, steps: int, workdir: Path) -> int:
    out = workdir / f"{level}-{steps}.callgrind"
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                           "--_child", level, str(params), str(steps)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, timeout=3600)
    match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"{level}: valgrind exited {done.returncode}:\n{done.stderr[-2000:]}")
    out.unlink(missing_ok=True)
    return int(match.group(1))


def measure_instructions(levels: list[str], params: int, steps: int, jobs: int = 2) -> list[dict[str, Any]]:
    """Instructions of one training iteration per level (callgrind; see the module's docstring)."""
    work = [(level, n) for level in levels for n in (0, steps)]
    with tempfile.TemporaryDirectory(prefix="engine-cg-") as tmp, ThreadPoolExecutor(jobs) as pool:
        counts = dict(zip(work, pool.map(lambda w: _count(w[0], params, w[1], Path(tmp)), work)))
    return [{"opt_level": level, "parameters": params, "steps": steps,
             "instructions_per_iteration": (counts[(level, steps)] - counts[(level, 0)]) / steps}
            for level in levels]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        _child(argv[1], int(argv[2]), int(argv[3]))
        return {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--levels", nargs="+", choices=("O1", "O2", "O3"), default=["O1", "O2"],
                        help="engine, telemetry and forensics: the opt levels (writes: O2 only)")
    parser.add_argument("--params", type=int, default=150, help="parameter tensors (GPT-2 small: 148)")
    parser.add_argument("--steps", type=int, default=200, help="iterations (writes: calls) per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--telemetry-every", type=int, default=10, help="logging interval of the telemetry part")
    parser.add_argument("--layers", type=int, default=16, help="forensics: Linear(64, 64) + ReLU blocks")
    parser.add_argument("--label", default="", help="a name for this version in the JSON (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=_harness.default_out("engine_overhead"))
    parser.add_argument("--instructions", type=int, default=0, metavar="N",
                        help="count instructions per iteration over N iterations (callgrind) instead of timing")
    args = parser.parse_args(argv)
    if args.params < 2 or min(args.steps, args.repeats, args.telemetry_every, args.layers) < 1:
        parser.error(f"--params={args.params} must be at least 2; --steps={args.steps}, --repeats={args.repeats}, "
                     f"--telemetry-every={args.telemetry_every} and --layers={args.layers} at least 1")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"benchmark": "engine_overhead", "label": args.label,
                              "command": _harness.command(argv), **_harness.machine()}  # fmt: skip
    print(f"lightning_mpx from {result['package_path']}")
    if args.instructions:
        result["instruction_rows"] = measure_instructions(args.levels, args.params, args.instructions)
        table = _harness.markdown_table(
            ["level", "parameters", "instructions per iteration"],
            [[r["opt_level"], r["parameters"], f"{r['instructions_per_iteration']:,.0f}"]
             for r in result["instruction_rows"]])
        print(f"\ninstructions per iteration (callgrind, {args.instructions} iterations after 5):\n{table}")
        _harness.save(args.out, result, {"instructions per iteration": table})
        return result
    parts = set(args.parts)
    result["rows"] = [measure(level, args.params, args.steps, args.repeats)
                      for level in args.levels] if "engine" in parts else []  # fmt: skip
    result["telemetry_rows"] = [measure_telemetry(level, args.params, args.steps, args.repeats, args.telemetry_every)
                                for level in args.levels] if "telemetry" in parts else []  # fmt: skip
    result["forensics_rows"] = [row for level in args.levels for row in
                                measure_forensics(level, args.layers, args.steps, args.repeats)
                                ] if "forensics" in parts else []  # fmt: skip
    result["write_check_rows"] = measure_writes(args.params, args.steps, args.repeats) if "writes" in parts else []
    result["skip_rows"] = [measure_skip(level, args.params, args.steps, args.repeats)
                           for level in args.levels] if "skip" in parts else []  # fmt: skip
    result.update(steps=args.steps, repeats=args.repeats, loadavg=[result["loadavg"], _harness.load_average()])
    out = tables(result)
    for title, table in out.items():
        print(f"\n{title}:\n{table}")
    _harness.save(args.out, result, out)
    return result


if __name__ == "__main__":
    main()
