"""Ranks of tests/test_fabric_clip_reads.py (gloo, ONE launch): Fabric DDP at O2 float16, two optimizers sharing a
parameter, each clipped with ``fabric.clip_gradients``, a write to the model's gradients, the steps; rank 1 alone
overflows at step :data:`INF_AT`. Case ``read``: rank 0 alone reads ``mpx.main_params(first)`` for a log after the first
clip (rank-0-only logging); case ``plain``: no read. Each rank writes its skips and final weights (FP32 masters)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import quiet_case as _quiet
from tests.launch import run_cases
from tests.test_fabric_clip_reads import MAX_NORM, _Net

STEPS = 3
INF_AT = 1


def _ddp(read: bool) -> dict[str, Any]:
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    rank = fabric.global_rank
    net = _Net()
    first = torch.optim.SGD([*net.a.parameters(), *net.shared.parameters()], lr=0.3)
    second = torch.optim.SGD([*net.b.parameters(), *net.shared.parameters()], lr=0.3)
    model, first, second = fabric.setup(net, first, second)
    out: dict[str, Any] = {"skipped": [], "logged": []}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + 10 * step + rank)
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        loss = F.cross_entropy(model(x).float(), y)
        fabric.backward(loss * 1e8 if (step == INF_AT and rank == 1) else loss)  # float16 overflows, rank 1 alone
        fabric.clip_gradients(model, first, max_norm=MAX_NORM, error_if_nonfinite=False)
        if read and rank == 0:  # a log of the masters' norm, on rank 0 only
            grads = [p.grad for p in plugin.main_params(first)]
            out["logged"].append(float(torch.nn.utils.get_total_norm(grads)))
        fabric.clip_gradients(model, second, max_norm=MAX_NORM, error_if_nonfinite=False)
        for param in net.parameters():
            param.grad.mul_(0.5)
        first.step()
        second.step()
        out["skipped"].append([plugin.step_was_skipped(first), plugin.step_was_skipped(second)])
        first.zero_grad()
        second.zero_grad()
    out["final"] = torch.cat([v.float().flatten() for v in plugin.fp32_state_dict(net).values()]).tolist()
    return out


CASES = {"read": _quiet(lambda: _ddp(True)), "plain": _quiet(lambda: _ddp(False))}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_cases(CASES, timeout_s=60)
