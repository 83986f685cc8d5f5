"""Ranks of tests/test_fabric_write_after_clip.py (gloo, ONE launch): Fabric's DDP at O2 float16,
``fabric.clip_gradients`` then a write to the model's gradients, rank 1's loss overflowing at step 1 (both ranks skip
it). Each rank writes, per case, its final weights (the masters at O2); the test runs the FP32 reference in one process
(the ranks' mean loss).

* ``clip_write``: one optimizer, clipped by norm, the gradients halved in place after the clip;
* ``shared_clip_write``: the whole model's optimizer and the head's own (one master), the whole one clipped by value,
  the head's gradients halved in place after the clip, then both steps.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import run_cases
from tests.lightning_ddp_no_sync_script import _batch, _net


def _run(kind: str, precision: str) -> dict[str, Any]:
    plugin = FabricMixedPrecisionPlugin(precision, half_dtype="float16", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        net = _net()
        if kind == "clip_write":
            model, whole = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            optimizers = [whole]
        else:
            model, whole, head = fabric.setup(
                net, torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(net[2].parameters(), lr=0.3)
            )
            optimizers = [whole, head]
        for step in range(3):
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x * 4).float(), y)
            if step == 1 and rank == 1:
                loss = loss * 1e8  # float16's gradients overflow at any scale, on rank 1 alone
            fabric.backward(loss)
            if kind == "clip_write":
                fabric.clip_gradients(model, whole, max_norm=0.5)
                for p in net.parameters():
                    p.grad.mul_(0.5)
            else:
                fabric.clip_gradients(model, whole, clip_val=0.05)
                for p in net[2].parameters():
                    p.grad.mul_(0.5)  # in place: one replaced is test_core_shared_masters_clip.py's strict xfail
            for opt in optimizers:
                opt.step()
            for opt in optimizers:
                opt.zero_grad()
        amp = getattr(fabric._precision, "amp", None)
        values = amp.fp32_state_dict(net) if amp is not None else net.state_dict()
        return {"final": torch.cat([v.detach().float().flatten() for v in values.values()]).tolist()}

    return fabric.launch(train)


def _case(kind: str, precision: str) -> Callable[[], dict[str, Any]]:
    def case() -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(kind, precision)

    return case


CASES = {f"{k}/O2": _case(k, "O2") for k in ("clip_write", "shared_clip_write")}  # FP32: in the test, one process


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_cases(CASES, timeout_s=60)
