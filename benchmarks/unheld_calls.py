"""Python calls per step where parameters that require grad are held by no optimizer (a head fine-tuned while the
backbone still requires grad), core ``Amp`` at O2, bfloat16 (static scale) and float16 (dynamic scale).

The engine watches such parameters (``engine/raw_steps.py`` ``UnheldParams``) and, at a dynamic scale, notes which
gradients each backward left there and the scale they carry (``engine/carried_scales.py``), so that an optimizer
registered over them later unscales them by that scale. This counts what that costs a step: Python calls (a
``sys.setprofile`` counter) per step of ``depth`` Linear layers with an AdamW over the last two, after a warm-up; at
two depths, so that a cost per parameter shows as a growth. Deterministic (no timing)::

    python benchmarks/unheld_calls.py                      # benchmarks/results/unheld_calls.json and .md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _harness
import torch
from torch import nn


def calls_per_step(dtype: torch.dtype, depth: int, steps: int, warmup: int) -> float:
    from lightning_mpx import Amp

    torch.manual_seed(0)
    amp = Amp("O2", half_dtype=dtype)
    model = amp.prepare_model(nn.Sequential(*[nn.Linear(32, 32) for _ in range(depth)]))
    head = [p for layer in list(model)[-2:] for p in layer.parameters()]
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(head, lr=1e-3))
    x = torch.randn(4, 32)

    def step() -> None:
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()

    for _ in range(warmup):
        step()
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return count[0] / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs=2, default=(8, 32), help="two model depths (Linear layers)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(_harness.default_out("unheld_calls")))
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")  # the engine's warning about the unheld parameters, once per run
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        low, high = (calls_per_step(dtype, d, args.steps, args.warmup) for d in args.depths)
        growth = (high - low) / (args.depths[1] - args.depths[0])
        rows.append({"half_dtype": str(dtype).removeprefix("torch."), "depths": list(args.depths),
                     "calls_per_step": [low, high], "growth_per_layer": growth})
    table = _harness.markdown_table(
        ["half_dtype", f"calls/step, {args.depths[0]} layers", f"calls/step, {args.depths[1]} layers",
         "growth per layer"],
        [[r["half_dtype"], _harness.cell(r["calls_per_step"][0], ".1f"), _harness.cell(r["calls_per_step"][1], ".1f"),
          _harness.cell(r["growth_per_layer"], ".2f")] for r in rows],
    )
    print(table)
    result = {"benchmark": "unheld_calls", "command": _harness.command(argv), **_harness.machine("cpu"),
              "steps": args.steps, "warmup": args.warmup, "rows": rows}
    _harness.save(Path(args.out), result, {"": table})


if __name__ == "__main__":
    main()
