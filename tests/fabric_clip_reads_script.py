"""Ranks of tests/test_fabric_clip_reads.py (gloo, ONE launch): Fabric DDP at O2 float16, two optimizers sharing a
parameter, each clipped with ``fabric.clip_gradients``, a write to the model's gradients, the steps; rank 1 alone
overflows at step :data:`INF_AT`. Case ``read``: rank 0 alone reads ``mpx.main_params(first)`` for a log after the first
clip (rank-0-only logging); case ``plain``: no read. Each rank writes its skips and final weights (FP32 masters).

The user's own reads of ``mpx.main_params(optimizer)`` on rank 0 alone (a log of the gradients' norm), float16, rank 1
alone overflowing at :data:`INF_AT`, each case against the same run without the read (``<case>:plain``):

* ``ddp:<level>:read``: DDP, the read right after ``fabric.backward`` (before ``fabric.clip_gradients``);
  ``apart:O2:read``: the same with the optimizer set up apart (``fabric.setup_optimizers``).
* ``accumulate:<level>:read``: DDP, two micro-batches under ``fabric.no_backward_sync``, the read on the first
  (non-final) one, where rank 1 overflows alone (the gradients not reduced yet).
* ``fsdp2:read``: ``ModelParallelStrategy`` (FSDP2) at O1 (the optimizer set up apart), the read after
  ``fabric.clip_gradients``; ``fsdp2:early_read``: the read right after ``fabric.backward``, then the clip;
  ``fsdp2:torch_clip``: no read, torch's clip of ``main_params`` right after ``fabric.backward`` on both ranks."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import shard_model
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


_FLOAT16: dict[str, Any] = {"half_dtype": "float16", "init_scale": 2.0**8}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + 10 * step + 3 * micro + rank)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def _norm(params: Any) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm([g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]))


def _ddp_read(level: str, read: bool, micro: int, *, apart: bool = False) -> dict[str, Any]:
    plugin = FabricMixedPrecisionPlugin(level, **_FLOAT16)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    rank = fabric.global_rank
    net = _net()
    if apart:  # met by the plugin at rank 0's read (rank 1: at its clip)
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.3))
    else:
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.3))
    out: dict[str, Any] = {"skipped": [], "logged": [], "clipped": []}
    for step in range(STEPS):
        for m in range(micro):
            x, y = _batch(step, m, rank)
            with fabric.no_backward_sync(model, enabled=m < micro - 1):
                loss = F.cross_entropy(model(x).float(), y) / micro
                fabric.backward(loss * 1e8 if (step == INF_AT and rank == 1 and m == 0) else loss)
            if read and rank == 0 and m == 0:  # a log of the gradients' norm, on rank 0 only
                out["logged"].append(_norm(plugin.main_params(optimizer)))
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        out["clipped"].append(float(norm))  # the reduced gradients' norm: what a read after the last backward logs
        optimizer.step()
        out["skipped"].append(plugin.step_was_skipped(optimizer))
        optimizer.zero_grad()
    out["final"] = torch.cat([v.float().flatten() for v in plugin.fp32_state_dict(net).values()]).tolist()
    return out


def _fsdp2(read: bool, clip: str = "fabric") -> dict[str, Any]:
    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=[model[0], model[2]])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                     timeout=timedelta(seconds=30))  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    rank = fabric.global_rank
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.3))
    out: dict[str, Any] = {"skipped": [], "logged": []}
    for step in range(STEPS):
        x, y = _batch(step, 0, rank)
        loss = F.cross_entropy(model(x).float(), y)
        fabric.backward(loss * float("inf") if (step == INF_AT and rank == 1) else loss)
        if clip == "early_read" and rank == 0:  # rank 0 alone, right after the backward: no collective either
            out["logged"].append(len(list(plugin.main_params(optimizer))))
        if clip == "torch":  # torch's clip of main_params right after fabric.backward, on both ranks (over DTensors)
            torch.nn.utils.clip_grad_norm_(list(plugin.main_params(optimizer)), MAX_NORM)
        else:
            fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        if read and rank == 0:  # rank 0 alone: must not enter a collective the other rank never joins
            out["logged"].append(len(list(plugin.main_params(optimizer))))
        optimizer.step()
        out["skipped"].append(plugin.step_was_skipped(optimizer))
        optimizer.zero_grad()
    out["final"] = torch.cat([p.detach().full_tensor().float().flatten() for p in model.parameters()]).tolist()
    return out


CASES = {
    "read": _quiet(lambda: _ddp(True)),
    "plain": _quiet(lambda: _ddp(False)),
    **{f"ddp:{level}:{kind}": _quiet(lambda level=level, kind=kind: _ddp_read(level, kind == "read", 1))
       for level in ("O1", "O2") for kind in ("read", "plain")},
    **{f"apart:O2:{kind}": _quiet(lambda kind=kind: _ddp_read("O2", kind == "read", 1, apart=True))
       for kind in ("read", "plain")},
    **{f"accumulate:{level}:{kind}": _quiet(lambda level=level, kind=kind: _ddp_read(level, kind == "read", 2))
       for level in ("O1", "O2") for kind in ("read", "plain")},
    **{f"fsdp2:{kind}": _quiet(lambda kind=kind: _fsdp2(kind == "read")) for kind in ("read", "plain")},
    "fsdp2:torch_clip": _quiet(lambda: _fsdp2(False, clip="torch")),
    "fsdp2:early_read": _quiet(lambda: _fsdp2(False, clip="early_read")),
}  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_cases(CASES, timeout_s=60)
