"""Run by tests/test_fabric_state_dict_habits.py: ``Fabric(strategy="ddp", devices=2)`` at O2 (bfloat16), two CPU
processes (gloo), the checkpoint habits of stop 54's masters-in-state-dict.

1. Uninterrupted: 4 steps (each rank its own data).
2. Interrupted: 2 steps, ``fabric.save`` of ``{"model", "optimizer", "mpx"}`` on both ranks, and the habit: rank 0
   alone ``torch.save(model.state_dict())``; a fresh run (other initial weights) ``fabric.load``\\ s it and takes
   steps 2 and 3.
3. The habit's file loaded into a fresh model (and the checkpoint's optimizer entry into its AdamW) that
   ``precision="bf16-mixed"`` trains for steps 2 and 3.

Each rank writes its ``state_dict()`` values (and dtypes) to ``$MPX_OUT/rank{r}.json``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import end_ranks, write_rank_results

SAVED_AFTER, STEPS = 2, 4


def make(seed: int, precision: str | None = None) -> tuple[Fabric, Any, Any, Any]:
    mpx = None
    if precision is None:
        mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx] if mpx else None, precision=precision)
    fabric.launch()  # the ranks are forked already: no process is started
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if mpx is not None:
        mpx.setup_optimizers(optimizer)
    return fabric, model, optimizer, mpx


def train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        fabric.backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def values(model: Any) -> dict[str, Any]:
    state = model.state_dict()
    return {k: {"dtype": str(v.dtype), "values": v.detach().float().flatten().tolist()} for k, v in state.items()}


def main() -> None:
    out = os.environ["MPX_OUT"]
    path = os.path.join(out, "run.ckpt")  # one path: Fabric writes it on rank 0
    habit = os.path.join(out, "habit.pt")
    results: dict[str, Any] = {}

    fabric, model, optimizer, _ = make(seed=0)
    train(fabric, model, optimizer, range(STEPS))
    results["uninterrupted"] = values(model)

    fabric, model, optimizer, mpx = make(seed=0)
    train(fabric, model, optimizer, range(SAVED_AFTER))
    results["saved"] = values(model)
    fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    if fabric.global_rank == 0:
        torch.save(model.state_dict(), habit)  # the habit: rank 0 saves the weights alone
    fabric.barrier()

    fabric, model, optimizer, mpx = make(seed=1)
    fabric.load(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    train(fabric, model, optimizer, range(SAVED_AFTER, STEPS))
    results["resumed"] = values(model)
    results["scale"] = mpx.metrics()["mpx/loss_scale"]

    fabric, model, optimizer, _ = make(seed=2, precision="bf16-mixed")
    model.load_state_dict(torch.load(habit, weights_only=True))
    fabric.load(path, {"optimizer": optimizer}, strict=False)  # the O2 run's AdamW state (its masters')
    results["habit_loaded"] = values(model)
    train(fabric, model, optimizer, range(SAVED_AFTER, STEPS))
    results["habit_trained"] = values(model)

    write_rank_results(results, rank=dist.get_rank())
    end_ranks()


if __name__ == "__main__":
    main()
