"""Graphs, graph breaks and recompiles of a model compiled through each front door, against the framework's own
precision (CPU, ``backend="aot_eager"``, bfloat16, a tiny MLP with a layer norm; ``--ckpt``: its first block under
activation checkpointing).

For each door (the core ``Amp``, Fabric, the Trainer, the Accelerate adapter), each placement of ``torch.compile``
(before or after the door's set-up; the Trainer: a compiled submodule or the compiled LightningModule; Accelerate
also ``dynamo_backend``) and each level (O1, O2, O3 and the framework's own: ``torch.autocast``, ``"bf16-mixed"``,
``mixed_precision="bf16"``), six steps count:

* ``graphs``: dynamo's unique graphs;
* ``breaks``: graph breaks dynamo logged (its ``graph_breaks`` log: ``counters["graph_break"]`` misses breaks dynamo
  skips, such as Fabric's own output hook), with their reasons;
* ``recompiles``: graphs compiled after the first step (a recompile per step would show as one per step).

Usage::

    python benchmarks/compile_graphs.py [--doors core fabric trainer accelerate] [--ckpt] [--out PATH]

Prints a table and writes JSON (default ``benchmarks/results/compile_graphs.json``). ``docs/compile.md`` quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import platform
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

STEPS = 6
LEVELS = ("O1", "O2", "O3")
RESULTS = Path(__file__).resolve().parent / "results" / "compile_graphs.json"


class _Breaks(logging.Handler):
    """Collects the graph breaks dynamo logs (where, and why)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        lines = [line.strip() for line in msg.splitlines() if line.strip()]
        where = lines[0].replace("Graph break in user code at ", "").split("site-packages/")[-1] if lines else ""
        reason = next((line for line in lines if "debug context" in line), lines[1] if len(lines) > 1 else "")
        self.reasons.append(f"{where}: {reason[:140]}")


class Net(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)
        self.ckpt = ckpt

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.ln(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False) if self.ckpt else self._inner(x)
        return self.fc2(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def compiled(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="aot_eager")


class Probe:
    """Counts one case: graphs, breaks, graphs made after the first step."""

    def __init__(self, breaks: _Breaks) -> None:
        torch._dynamo.reset()
        counters.clear()
        breaks.reasons.clear()
        self.breaks = breaks
        self.after_first: int | None = None

    def step_done(self, step: int) -> None:
        if step == 0:
            self.after_first = counters["stats"]["unique_graphs"]

    def result(self) -> dict[str, Any]:
        graphs = counters["stats"]["unique_graphs"]
        return {
            "graphs": graphs,
            "breaks": len(self.breaks.reasons),
            "recompiles": graphs - (self.after_first or 0),
            "reasons": dict(Counter(self.breaks.reasons)),
        }


def core(level: str, place: str, ckpt: bool, probe: Probe) -> list[float]:
    from lightning_mpx import Amp

    net, losses = Net(ckpt), []
    if level == "autocast":
        run = compiled(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i in range(STEPS):
            x, y = batch(i)
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.cross_entropy(run(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            probe.step_done(i)
        return losses
    amp = Amp(level, half_dtype="bfloat16")
    run = amp.prepare_model(compiled(net) if place == "before" else net)
    run = compiled(run) if place == "after" else run
    opt = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    for i in range(STEPS):
        x, y = batch(i)
        with amp.forward_context():
            out = run(amp.cast_inputs(x))
        loss = F.cross_entropy(amp.cast_outputs(out).float(), y)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad()
        amp.update()
        losses.append(loss.item())
        probe.step_done(i)
    return losses


def fabric(level: str, place: str, ckpt: bool, probe: Probe) -> list[float]:
    from lightning.fabric import Fabric

    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

    net = Net(ckpt)
    if level == "bf16-mixed":
        fab = Fabric(accelerator="cpu", devices=1, precision=level)
    else:
        fab = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")])
    model, opt = fab.setup(compiled(net) if place == "before" else net, torch.optim.SGD(net.parameters(), lr=0.1))
    model = compiled(model) if place == "after" else model
    losses = []
    for i in range(STEPS):
        x, y = batch(i)
        loss = F.cross_entropy(model(x).float(), y)
        fab.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        probe.step_done(i)
    return losses


def trainer(level: str, place: str, ckpt: bool, probe: Probe) -> list[float]:
    import lightning.pytorch as pl

    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = compiled(Net(ckpt)) if place == "submodule" else Net(ckpt)
            self.losses: list[float] = []

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return F.cross_entropy(self.net(b[0]).float(), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_batch_end(self, outputs: Any, *args: Any) -> None:
            self.losses.append(float(outputs["loss"]))
            probe.step_done(len(self.losses) - 1)

    module = Module()
    precision = {"precision": level} if level == "bf16-mixed" else {
        "plugins": [MixedPrecisionPlugin(level, half_dtype="bfloat16")]}
    fit = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **precision)
    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*(batch(i) for i in range(STEPS)))))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        fit.fit(compiled(module) if place == "module" else module, torch.utils.data.DataLoader(data, batch_size=8))
    return module.losses


def accelerate(level: str, place: str, ckpt: bool, probe: Probe) -> list[float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.integrations.accelerate import Accelerator as MpxAccelerator
    from lightning_mpx.integrations.accelerate_kwargs import MixedPrecisionKwargs

    AcceleratorState._reset_state(True)  # Accelerate's process-wide state, afresh for each case
    GradientState._reset_state()
    net = Net(ckpt)
    dynamo = {"dynamo_backend": "aot_eager"} if place == "dynamo_backend" else {}
    if level == "bf16":
        acc = Accelerator(mixed_precision=level, **dynamo)
    else:
        acc = MpxAccelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")],
                             **dynamo)
    model, opt = acc.prepare(compiled(net) if place == "before" else net, torch.optim.SGD(net.parameters(), lr=0.1))
    model = compiled(model) if place == "after" else model
    losses = []
    for i in range(STEPS):
        x, y = batch(i)
        loss = F.cross_entropy(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        probe.step_done(i)
    return losses


DOORS: dict[str, tuple[Callable[..., list[float]], tuple[str, ...], str]] = {
    "core": (core, ("before", "after"), "autocast"),
    "fabric": (fabric, ("before", "after"), "bf16-mixed"),
    "trainer": (trainer, ("submodule", "module"), "bf16-mixed"),
    "accelerate": (accelerate, ("before", "after", "dynamo_backend"), "bf16"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doors", nargs="+", choices=list(DOORS), default=list(DOORS))
    parser.add_argument("--ckpt", action="store_true", help="the first block under activation checkpointing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_mpx", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    breaks = _Breaks()
    torch._logging.set_logs(graph_breaks=True)
    graph_breaks = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    graph_breaks.addHandler(breaks)
    graph_breaks.propagate = False
    rows = []
    print(f"{'door':<10} {'placement':<15} {'level':<11} {'graphs':>6} {'breaks':>6} {'recompiles':>10}")
    for door in args.doors:
        run, places, own = DOORS[door]
        for place in places:
            for level in (*LEVELS, own):
                probe = Probe(breaks)
                row: dict[str, Any] = {"door": door, "placement": place, "level": level, "ckpt": args.ckpt}
                try:
                    losses = run(level, place, args.ckpt, probe)
                    row.update(probe.result(), first_loss=losses[0])
                    print(f"{door:<10} {place:<15} {level:<11} {row['graphs']:>6} {row['breaks']:>6} "
                          f"{row['recompiles']:>10}", flush=True)
                except Exception as error:  # a case that fails is a row that says so
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(f"{door:<10} {place:<15} {level:<11} ERROR {row['error']}", flush=True)
                rows.append(row)
    meta = {"command": "python benchmarks/compile_graphs.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "steps": STEPS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
