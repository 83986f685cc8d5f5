"""Ranks of tests/test_core_raw_head_beside.py: a raw head optimizer stepped beside the prepared one under Fabric's DDP,
on both ranks (engine/beside_steps.py). Two CPU processes (gloo), ONE launch. Each rank writes
``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

``raw_before``: the raw step before the prepared one (refused at that step, where the ranks meet in the flags'
all-reduce); ``raw_after``: after it (refused at the next backward, before DDP's all-reduce); ``raw_prepared``: the
head's optimizer given to ``fabric.setup`` too (no error). The group still works after them (no rank left in a
collective: no hang)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import run_cases


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _fabric_case(order: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="float16", loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugin)
    fabric.launch()
    net = _net()
    trunk, head = list(net[0].parameters()), list(net[2].parameters())
    if order == "prepared":
        model, optimizer, raw = fabric.setup(net, torch.optim.SGD(trunk, lr=0.05), torch.optim.SGD(head, lr=0.05))
    else:
        model, optimizer = fabric.setup(net, torch.optim.SGD(trunk, lr=0.05))
        raw = torch.optim.SGD(head, lr=0.05)  # never given to fabric.setup
    out: dict[str, Any] = {"iterations": 0}
    start = torch.cat([p.detach().flatten() for p in trunk])
    try:
        for i in range(3):
            g = torch.Generator().manual_seed(10 * i + fabric.global_rank)
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            fabric.backward(F.mse_loss(model(x).float(), y))
            if order == "before":
                raw.step()
            optimizer.step()
            if order != "before":
                raw.step()
            optimizer.zero_grad()
            raw.zero_grad()
            out["iterations"] += 1
    except RuntimeError as error:
        out["refused"] = str(error)
    out["trunk_moved"] = not torch.equal(start, torch.cat([p.detach().flatten() for p in trunk]))
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    return out


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    run_cases({f"raw_{order}": (lambda order=order: _fabric_case(order)) for order in ("before", "after", "prepared")})
