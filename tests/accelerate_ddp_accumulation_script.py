"""Ranks of tests/test_accelerate_keyword_parity.py (gloo, ONE launch): the Accelerate adapter's gradient accumulation
under DDP with a float16 overflow on rank 1 only, against Accelerate's own ``"fp16"`` (its ``GradScaler`` path, given a
CPU ``torch.amp.GradScaler``: on a CPU Accelerate makes none) and ``"bf16"``.

Each case trains a tiny MLP for 8 micro-batches, 2 per optimizer step (an SGD step, a clip at 10 when
``accelerator.sync_gradients``), each rank on its own batches; rank 1's loss is ``inf`` at micro-batches 2 (under
``no_sync``) and 5 (the synchronising one). Each rank writes, per step, ``step_was_skipped``, the loss scale after it,
the clip's norm, ``sync_gradients`` at each micro-batch, and the final FP32 weights (at O2 the masters).

* ``accum/{O1,O2,fp16}``: ``Accelerator(gradient_accumulation_steps=2)`` and ``with accelerator.accumulate(model)``;
* ``no_sync/{O2,fp16}``: no plugin; ``with accelerator.no_sync(model)`` around the first micro-batch's backward, the
  loss halved by hand, the step after the second;
* ``sync_each/{O2,bf16}``: ``GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)``, bfloat16, no overflow;
* ``short_window/{O2,fp16}``: a prepared DataLoader whose last window is one micro-batch long, rank 1 overflowing there.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import run_cases

F16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8, "growth_interval": 2}
POISONED = (2, 5)  # rank 1's micro-batches whose loss is inf: one under no_sync, one synchronising


def _accelerator(level: str, **kwargs: Any) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    if level == "fp16":  # Accelerate's own fp16 path (scaler.scale(loss).backward(), scaler.step, scaler.update)
        accelerator = NativeAccelerator(mixed_precision="fp16", cpu=True, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=F16["init_scale"], growth_interval=2)
        accelerator.native_amp = True  # its autocast around the forward, float16 on the CPU
        return accelerator
    if level == "bf16":
        return NativeAccelerator(mixed_precision="bf16", cpu=True, **kwargs)
    handler = MixedPrecisionKwargs(**(F16 if level != "O2bf16" else {"half_dtype": "bfloat16"}))
    return Accelerator(mixed_precision=level[:2], cpu=True, kwargs_handlers=[handler], **kwargs)


def _run(level: str, how: str) -> dict[str, Any]:
    from accelerate.utils import GradientAccumulationPlugin

    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        if how == "accum":
            accelerator = _accelerator(level, gradient_accumulation_steps=2)
        elif how == "sync_each":
            plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
            accelerator = _accelerator(level, gradient_accumulation_plugin=plugin)
        else:
            accelerator = _accelerator(level)
        rank = accelerator.process_index
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        out: dict[str, Any] = {"wrapper": type(model).__name__, "skipped": [], "scales": [], "norms": [], "sync": []}
        for micro in range(8):
            g = torch.Generator().manual_seed(100 * micro + rank)
            x = torch.randn(4, 4, generator=g)
            poison = float("inf") if how != "sync_each" and rank == 1 and micro in POISONED else 1.0
            last = micro % 2 == 1
            if how == "no_sync":
                context = contextlib.nullcontext() if last else accelerator.no_sync(model)
            else:
                context = accelerator.accumulate(model)
            with context:
                loss = F.mse_loss(model(x).float(), x.sum(1, keepdim=True)) * poison
                accelerator.backward(loss / 2 if how == "no_sync" else loss)
                sync = accelerator.sync_gradients if how != "no_sync" else last
                out["sync"].append(bool(sync))
                if sync:
                    out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), 10.0)))
                if how == "no_sync" and not last:
                    continue
                optimizer.step()
                if sync:
                    out["skipped"].append(bool(optimizer.step_was_skipped))
                    amp, scaler = getattr(accelerator, "amp", None), accelerator.scaler
                    scale = amp.metrics()["mpx/loss_scale"] if amp is not None else scaler and scaler.get_scale()
                    out["scales"].append(float(scale or 1.0))
                optimizer.zero_grad()
        amp = getattr(accelerator, "amp", None)
        params = amp.master_params(optimizer.optimizer) if amp is not None else model.module.parameters()
        out["weights"] = torch.cat([p.detach().float().flatten() for p in params]).tolist()
        return out


def _short_window(level: str) -> dict[str, Any]:
    """A prepared DataLoader of 5 batches per rank under ``gradient_accumulation_steps=2``: its last window is one
    micro-batch long (Accelerate synchronises at the end of the loader), and rank 1 overflows there."""
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = _accelerator(level, gradient_accumulation_steps=2)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        x = torch.randn(40, 4, generator=torch.Generator().manual_seed(5))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05), loader)
        out: dict[str, Any] = {"sync": [], "skipped": [], "scales": []}
        for micro, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                poison = float("inf") if accelerator.process_index == 1 and micro == 4 else 1.0
                accelerator.backward(F.mse_loss(model(xb).float(), yb) * poison)
                out["sync"].append(bool(accelerator.sync_gradients))
                optimizer.step()
                if accelerator.sync_gradients:
                    out["skipped"].append(bool(optimizer.step_was_skipped))
                    amp = getattr(accelerator, "amp", None)
                    scale = amp.metrics()["mpx/loss_scale"] if amp is not None else accelerator.scaler.get_scale()
                    out["scales"].append(float(scale))
                optimizer.zero_grad()
        amp = getattr(accelerator, "amp", None)
        params = amp.master_params(optimizer.optimizer) if amp is not None else model.module.parameters()
        out["weights"] = torch.cat([p.detach().float().flatten() for p in params]).tolist()
        return out


CASES = {
    "accum/O1": lambda: _run("O1", "accum"),
    "accum/O2": lambda: _run("O2", "accum"),
    "accum/fp16": lambda: _run("fp16", "accum"),
    "no_sync/O2": lambda: _run("O2", "no_sync"),
    "no_sync/fp16": lambda: _run("fp16", "no_sync"),
    "sync_each/O2": lambda: _run("O2bf16", "sync_each"),
    "sync_each/bf16": lambda: _run("bf16", "sync_each"),
    "short_window/O2": lambda: _short_window("O2"),
    "short_window/fp16": lambda: _short_window("fp16"),
}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    run_cases(CASES)
