"""Run by tests/test_lightning_tensorboard.py: ``Fabric(strategy="ddp", devices=2)`` with a real TensorBoardLogger,
float16, an inf loss on rank 1 only at ``INJECT``; ``fabric.log_dict(mpx.metrics())`` every step on both ranks (the
logger writes on rank 0 only). Each rank writes the steps it skipped and its final weights to ``$MPX_OUT/rank{r}.json``;
:func:`fabric_run` is also the test's single-process reference run (``devices=1``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin

STEPS = 8
INJECT = {2, 3, 6}


def fabric_run(out: Path, rank_with_overflow: int, devices: int = 1) -> dict[str, object]:
    """Train ``STEPS`` steps logging every step to ``out/run/version_0``; the loss is inf at ``INJECT`` on
    ``rank_with_overflow``."""
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=1024.0, growth_interval=3)  # as reference()
    strategy = "ddp" if devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=[mpx],
                    loggers=[TensorBoardLogger(str(out), name="run", version=0)])
    fabric.launch()
    torch.manual_seed(0)
    module = nn.Linear(8, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    skipped = []
    for step in range(STEPS):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        if step in INJECT and fabric.global_rank == rank_with_overflow:
            loss = loss * float("inf")
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        metrics = mpx.metrics()
        if metrics["mpx/overflows"]:
            skipped.append(step)
        fabric.log_dict(metrics, step=step)
    fabric.logger.finalize("success")
    weights = [p.detach().float().flatten().tolist() for p in model.parameters()]
    return {"skipped": skipped, "weights": weights, "rank": fabric.global_rank}


def main() -> None:
    from tests.launch import end_ranks

    out = Path(os.environ["MPX_OUT"])
    result = fabric_run(out, rank_with_overflow=1, devices=2)
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
    end_ranks()


if __name__ == "__main__":
    main()
