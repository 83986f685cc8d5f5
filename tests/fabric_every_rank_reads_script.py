"""Ranks of tests/test_fabric_every_rank_reads.py (gloo, ONE launch): Fabric DDP at O2 float16, reads on EVERY rank.

Each case trains a tiny model for ``STEPS`` iterations, rank 1's loss inf at iterations 1 and 3 (growth_interval=1),
and writes the scale every rank's ``mpx.metrics()`` read after each iteration's steps:

* ``read_save``: no forward after the last iteration's read: ``fabric.save`` of model, optimizer and plugin, then the
  saved scaler state and, in a fresh plugin, the scale resumed from it and one more iteration's scale;
* ``read_load``: a read, then ``fabric.load`` of the checkpoint saved two iterations before (every rank), then on.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import run_cases

CASES = ("read_save", "read_load")
STEPS = 5
INF_AT = (1, 3)


def _setup(fabric_out: list[Any]) -> tuple[Any, ...]:
    torch.manual_seed(0)
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**10, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    fabric.launch()
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return mpx, fabric, model, opt


def _iteration(fabric: Fabric, model: Any, opt: Any, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(10 * rank + step)
    x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    loss = F.cross_entropy(model(x), y)
    fabric.backward(loss * float("inf") if rank == 1 and step in INF_AT else loss)
    opt.step()
    opt.zero_grad()


def run_case(case: str, out_dir: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    mpx, fabric, model, opt = _setup([])
    out: dict[str, Any] = {"reads": [], "overflows": []}
    ckpt = out_dir / f"{case}.ckpt"
    for step in range(STEPS):
        _iteration(fabric, model, opt, step, rank)
        metrics = mpx.metrics()  # every rank reads
        out["reads"].append(metrics["mpx/loss_scale"])
        out["overflows"].append(metrics["mpx/overflows"])
        out["skipped"] = metrics["mpx/skipped_steps"]
        if case == "read_load" and step == 1:
            fabric.save(ckpt, {"model": model, "optimizer": opt, "mpx": mpx})
    if case == "read_save":
        fabric.save(ckpt, {"model": model, "optimizer": opt, "mpx": mpx})  # no forward since the last read
        out["live_after_save"] = float(mpx.amp.scalers[0].scale_tensor)
        fabric.barrier()
        out["saved"] = torch.load(ckpt, weights_only=False)["mpx"]["scalers"][0]["scale"]
        mpx2, fabric2, model2, opt2 = _setup([])
        fabric2.load(ckpt, {"model": model2, "optimizer": opt2, "mpx": mpx2})
        metrics = mpx2.metrics()
        out["resumed"], out["resumed_overflows"] = metrics["mpx/loss_scale"], metrics["mpx/overflows"]
        out["resumed_skipped"] = metrics["mpx/skipped_steps"]
        _iteration(fabric2, model2, opt2, STEPS, rank)
        out["resumed_next"] = mpx2.metrics()["mpx/loss_scale"]
    else:
        fabric.barrier()
        fabric.load(ckpt, {"model": model, "optimizer": opt, "mpx": mpx})
        metrics = mpx.metrics()
        out["after_load"], out["after_load_skipped"] = metrics["mpx/loss_scale"], metrics["mpx/skipped_steps"]
        _iteration(fabric, model, opt, 2, rank)  # iteration 2 again, from the checkpoint
        out["after_load_next"] = mpx.metrics()["mpx/loss_scale"]
    return out


def main() -> None:
    out_dir = Path(os.environ["MPX_OUT"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_cases({case: functools.partial(run_case, case, out_dir) for case in CASES})


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
