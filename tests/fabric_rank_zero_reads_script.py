"""Ranks of tests/test_fabric_rank_zero_reads.py (gloo, ONE launch): Fabric DDP at O2 float16 with reads on rank 0
alone.

Rank 0 reads, rank 1 does not; each rank trains on its own batches and writes the live scale after each
``fabric.backward`` (the previous iteration's update done there on every rank), what rank 0 read, and the final
weights and skip count:

* ``unmet_nograd``: a body given to ``fabric.setup(body, opt_a)``, a head set up apart (``fabric.setup_module``,
  ``fabric.setup_optimizers``) that the loss uses from iteration 3 on; ``opt_a.step()``, ``mpx.metrics()`` on rank 0,
  ``opt_b.step()`` (its parameters without gradients before iteration 3); rank 1's loss inf at iteration 1;
* ``accum_skip``: fused AdamW (``skip_on_device=True``), two micro-batches under ``fabric.no_backward_sync``, reads of
  ``mpx.scaler.get_scale()`` after each ``fabric.backward``, ``mpx.metrics()`` after ``fabric.clip_gradients`` and after
  the steps; rank 1's second micro-batch inf at iteration 2;
* ``two_opts_skip``: body and head optimizers given to one ``fabric.setup``, fused AdamW (skipped on the device),
  ``mpx.metrics()``, ``mpx.step_was_skipped`` and ``mpx.state_dict()`` read between their steps; rank 1's loss inf at
  iterations 1 and 4.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import run_cases

CASES = ("unmet_nograd", "accum_skip", "two_opts_skip")
STEPS = 6


def _values(params: Any) -> list[float]:
    return torch.cat([p.detach().float().flatten() for p in params]).tolist()


def _inf_if(loss: torch.Tensor, overflow: bool) -> torch.Tensor:
    return loss * float("inf") if overflow else loss


def run_case(case: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    skip = case != "unmet_nograd"
    mpx = FabricMixedPrecisionPlugin(
        "O2", half_dtype="float16", init_scale=2.0**10, growth_interval=1, **({"skip_on_device": True} if skip else {})
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    fabric.launch()
    body, head = nn.Linear(8, 8), nn.Linear(8, 4)
    if skip:
        model, opt_a, opt_b = fabric.setup(
            nn.Sequential(body, nn.Tanh(), head),
            torch.optim.AdamW(body.parameters(), lr=1e-2, fused=True),
            torch.optim.AdamW(head.parameters(), lr=1e-2, fused=True),
        )
    else:
        model, opt_a = fabric.setup(body, torch.optim.SGD(body.parameters(), lr=0.1))
        head_model = fabric.setup_module(head)
        opt_b = fabric.setup_optimizers(torch.optim.SGD(head.parameters(), lr=0.1))
    out: dict[str, Any] = {"live": [], "reads": []}
    read = rank == 0

    def backward(loss: torch.Tensor) -> None:
        fabric.backward(loss)
        out["live"].append(float(mpx.amp.scalers[0].scale_tensor))

    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        if case == "unmet_nograd":
            hidden = model(x)
            logits = head_model(hidden) if step >= 3 else hidden[:, :4]  # the head unused at first: no gradients
            backward(_inf_if(F.cross_entropy(logits, y), rank == 1 and step == 1))
            opt_a.step()
            if read:
                out["reads"].append(mpx.metrics()["mpx/loss_scale"])
            opt_b.step()  # met here at iteration 0, its parameters without gradients: the read must not end it alone
        elif case == "accum_skip":
            for micro in range(2):
                loss = F.cross_entropy(model(x[4 * micro : 4 * micro + 4]), y[4 * micro : 4 * micro + 4])
                loss = _inf_if(loss, rank == 1 and step == 2 and micro == 1)
                if micro == 0:
                    with fabric.no_backward_sync(model):
                        backward(loss)
                else:
                    backward(loss)
                if read:
                    out["reads"].append(mpx.scaler.get_scale())
            fabric.clip_gradients(model, opt_a, max_norm=1.0, error_if_nonfinite=False)
            if read:
                out["reads"].append(mpx.metrics()["mpx/loss_scale"])
            opt_a.step()
            opt_b.step()
            if read:
                out["reads"].append(mpx.metrics()["mpx/loss_scale"])
                out["reads"].append(mpx.step_was_skipped(opt_a))
        else:
            backward(_inf_if(F.cross_entropy(model(x), y), rank == 1 and step in (1, 4)))
            opt_a.step()
            if read:
                out["reads"].append(mpx.metrics()["mpx/loss_scale"])
                out["reads"].append(mpx.step_was_skipped(opt_a))
                out["reads"].append(mpx.state_dict()["scalers"][0]["scale"])
            opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    backward(F.cross_entropy(model(x)[:, :4], y))  # on every rank: ends the last iteration
    out["final"] = _values([*body.parameters(), *head.parameters()])
    out["skipped"] = mpx.metrics()["mpx/skipped_steps"]
    return out


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_cases({case: functools.partial(run_case, case) for case in CASES})


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
