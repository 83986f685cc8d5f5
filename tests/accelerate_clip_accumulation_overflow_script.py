"""Ranks of tests/test_accelerate_clip_accumulation_overflow.py (gloo, ONE launch): the Accelerate adapter's clips under
DDP with ``gradient_accumulation_steps=3`` and a float16 overflow on rank 1 only, against Accelerate's own ``"fp16"``
(its ``GradScaler`` path, given a CPU ``torch.amp.GradScaler``: on a CPU Accelerate makes none).

Each case trains a tiny model (a body and a head) for 9 micro-batches, 3 per optimizer step, each rank on its own
batches; rank 1's loss is ``inf`` at micro-batch 1 (no sync) and 5 (the synchronising one of the second step). At each
synchronising micro-batch (``accelerator.sync_gradients``) a clip habit runs, then the step. Each rank writes, per
step, ``step_was_skipped``, the loss scale after it, the clip's norm (its type too), and the final FP32 weights.

* ``norm/{O2,fp16}``: ``accelerator.clip_grad_norm_(model.parameters(), 0.5)``;
* ``unscale_write/{O2,fp16}``: ``unscale_gradients()`` (not under ``"fp16"``, whose own clip unscales again and gets
  ``GradScaler``'s "unscale_() has already been called"), the clip, then ``p.grad.mul_(0.5)`` on the model's
  gradients;
* ``subset_write/{O2,fp16}``: the clip of ``model.module.head.parameters()``, then the write;
* ``value/{O1,O2,fp16}``: ``clip_grad_value_(model.parameters(), 0.05)``;
* ``two_opts/{O2,fp16}``: an optimizer for the body and one for the head, ``unscale_gradients(optimizer=opt_head)``
  (not under ``"fp16"``) then the clip of every parameter, both stepped.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import run_cases

F16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8, "growth_interval": 2}
POISONED = (1, 5)  # rank 1's micro-batches whose loss is inf: one inside the window, one synchronising


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _accelerator(level: str) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    if level == "fp16":  # Accelerate's own fp16 path (scaler.scale(loss).backward(), scaler.step, scaler.update)
        accelerator = NativeAccelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=3)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=F16["init_scale"], growth_interval=2)
        accelerator.native_amp = True  # its autocast around the forward, float16 on the CPU
        return accelerator
    return Accelerator(mixed_precision=level, cpu=True, gradient_accumulation_steps=3,
                       kwargs_handlers=[MixedPrecisionKwargs(**F16)])  # fmt: skip


def _run(level: str, habit: str) -> dict[str, Any]:
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = _accelerator(level)
        rank = accelerator.process_index
        torch.manual_seed(0)
        net = _Net()
        if habit == "two_opts":
            opts = [torch.optim.SGD(net.body.parameters(), lr=0.1, momentum=0.9),
                    torch.optim.SGD(net.head.parameters(), lr=0.1, momentum=0.9)]  # fmt: skip
        else:
            opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]
        model, *opts = accelerator.prepare(net, *opts)
        out: dict[str, Any] = {"skipped": [], "scales": [], "norms": [], "norm_types": []}
        for micro in range(9):
            g = torch.Generator().manual_seed(100 * micro + rank)
            x = torch.randn(4, 4, generator=g)
            poison = float("inf") if rank == 1 and micro in POISONED else 1.0
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x).float(), torch.stack([x.sum(1), x[:, 0]], 1)) * poison
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = None
                    if habit == "norm":
                        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    elif habit == "unscale_write":
                        if level != "fp16":  # Accelerate's own clip unscales again: GradScaler's error after it
                            accelerator.unscale_gradients()
                        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    elif habit == "subset_write":
                        norm = accelerator.clip_grad_norm_(model.module.head.parameters(), 0.2)
                    elif habit == "value":
                        accelerator.clip_grad_value_(model.parameters(), 0.05)
                    else:  # two_opts
                        if level != "fp16":
                            accelerator.unscale_gradients(optimizer=opts[1])
                        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    if habit.endswith("_write"):
                        for p in model.parameters():
                            p.grad.mul_(0.5)
                    if norm is not None:
                        out["norms"].append(float(norm))
                        out["norm_types"].append(f"{type(norm).__name__}/{norm.dtype}/{norm.shape}")
                for opt in opts:
                    opt.step()
                if accelerator.sync_gradients:
                    out["skipped"].append([bool(opt.step_was_skipped) for opt in opts])
                    amp, scaler = getattr(accelerator, "amp", None), accelerator.scaler
                    scale = amp.metrics()["mpx/loss_scale"] if amp is not None else scaler.get_scale()
                    out["scales"].append(float(scale))
                for opt in opts:
                    opt.zero_grad()
        amp = getattr(accelerator, "amp", None)
        if amp is not None:
            state = accelerator.get_state_dict(model)
            out["weights"] = torch.cat([state[k].float().flatten() for k in sorted(state)]).tolist()
        else:
            state = model.module.state_dict()
            out["weights"] = torch.cat([state[k].float().flatten() for k in sorted(state)]).tolist()
        return out


CASES = {
    f"{habit}/{level}": (lambda habit=habit, level=level: _run(level, habit))
    for habit, levels in (
        ("norm", ("O2", "fp16")),
        ("unscale_write", ("O2", "fp16")),
        ("subset_write", ("O2", "fp16")),
        ("value", ("O1", "O2", "fp16")),
        ("two_opts", ("O2", "fp16")),
    )
    for level in levels
}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    run_cases(CASES)
