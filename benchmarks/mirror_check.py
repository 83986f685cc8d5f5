"""Host cost of O2's check for writes to the half model before each step (``Mirror.take_writes``), CPU.

A model of ``--params`` half parameters (``Linear(8, 8)`` layers side by side) has FP32 masters through ``Amp("O2")``.
Each row times one ``take_writes()`` call (what ``amp.step`` runs first) after a given write pattern, median of
``--repeats`` rounds of ``--calls`` calls, the rows rotated within a round:

* ``nothing``: no write since the last check (the common step), default ``model_writes="versions"``;
* ``data_read``: every parameter's ``p.data`` read (not written) before the check: each is compared once;
* ``data_clamp``: WGAN's ``p.data.clamp_(-c, c)`` on every parameter before the check (taken through the
  parameters' ``.data`` watch);
* ``values_nothing`` / ``values_clamp``: the same two with ``model_writes="values"`` (every parameter compared at
  every check).

The ``data_*`` and ``values_*`` rows include the write pattern itself (the reads or the clamps), timed alone in the
``pattern_*`` rows so that the check's share can be read off.

    python benchmarks/mirror_check.py [--params 150] [--calls 200] [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import lightning_mpx
from lightning_mpx import Amp

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs


def _engine(params: int, model_writes: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    amp = Amp("O2", model_writes=model_writes)
    model = amp.prepare_model(nn.ModuleList(nn.Linear(8, 8) for _ in range(params // 2)))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    (mirror,) = amp._mirrors(amp._state(optimizer))
    mirror.take_writes()
    return model, mirror


def _read(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.norm()  # a read of .data, as logging code does


def _clamp(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-1.0, 1.0)


def rows(params: int, calls: int, repeats: int) -> list[dict[str, Any]]:
    versions_model, versions = _engine(params, "versions")
    values_model, values = _engine(params, "values")
    plain = nn.ModuleList(nn.Linear(8, 8) for _ in range(params // 2)).half()
    cases: dict[str, Callable[[], Any]] = {
        "nothing": versions.take_writes,
        "data_read": lambda: (_read(versions_model), versions.take_writes()),
        "data_clamp": lambda: (_clamp(versions_model), versions.take_writes()),
        "values_nothing": values.take_writes,
        "values_clamp": lambda: (_clamp(values_model), values.take_writes()),
        "pattern_read": lambda: _read(plain),
        "pattern_clamp": lambda: _clamp(plain),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(repeats):
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name in order:
            fn = cases[name]
            fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return [
        {"case": name, "params": params, "us_median": statistics.median(s), "us_min": min(s), "us_max": max(s)}
        for name, s in samples.items()
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=150)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mirror_check.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = rows(args.params, args.calls, args.repeats)
    print(f"{'case':<16}{'us/check median':>16}{'min':>10}{'max':>10}")
    for row in table:
        print(f"{row['case']:<16}{row['us_median']:>16.1f}{row['us_min']:>10.1f}{row['us_max']:>10.1f}")
    result = {
        "benchmark": "mirror_check",
        "lightning_mpx": lightning_mpx.__version__,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "loadavg": list(__import__("os").getloadavg()),
        "settings": vars(args) | {"out": str(args.out)},
        "rows": table,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
