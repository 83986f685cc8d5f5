"""Ranks of tests/test_core_kept_writes.py (gloo, ONE launch): a write between accumulated backwards that looks like a
raw torch optimizer's step (engine/raw_steps.py ``stepped_along``, judged at the step by engine/kept_writes.py) made on
rank 0 alone, under Fabric DDP at O2 bfloat16 (against FP32 in one process: tests/test_core_descent_probes.py). Each
rank writes, per case, the windows whose step was refused and its final weights (FP32: the masters at O2).

* ``raw_rank0``: rank 0 alone writes a raw SGD step by hand (``p.sub_(lr * p.grad)``, gradients kept) after the first
  backward of the second window (inside ``no_backward_sync``): both ranks must refuse at that step (or neither), and
  then meet again (the window given up with ``zero_grad``; rank 0's weights keep its write, as the user made them);
* ``probe_rank0``: rank 0 alone makes a descent probe after the first backward of each window, a backward at the
  probed weights, and restores the weights from a copy: no refusal, the ranks equal (undone by subtraction instead,
  rank 0's half weights keep the subtraction's bfloat16 rounding: the ranks part by it, as they do by FP32's under
  ``"bf16-mixed"``).
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import case_error, finish_cases


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def case(kind: str, precision: str) -> dict[str, Any]:
    if precision == "O2":
        plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=precision)

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        net = _net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        refused: list[int] = []
        for window in range(4):
            for micro in range(2):
                x, y = _batch(2 * window + micro, rank)
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    fabric.backward(F.cross_entropy(model(x), y) / 2)
                if micro == 0 and rank == 0 and kind == "raw_rank0" and window == 1:
                    with torch.no_grad():
                        for p in net.parameters():
                            p.sub_(5e-2 * p.grad.to(p.dtype))
                if micro == 0 and rank == 0 and kind == "probe_rank0":
                    saved = [p.detach().clone() for p in net.parameters()]
                    with torch.no_grad():
                        for p in net.parameters():
                            p.sub_(5e-2 * p.grad.to(p.dtype))
                    with fabric.no_backward_sync(model, enabled=True):
                        fabric.backward(F.cross_entropy(model(x), y) / 2)
                    with torch.no_grad():
                        for p, copy in zip(net.parameters(), saved):
                            p.copy_(copy)
            try:
                opt.step()
            except RuntimeError as error:
                if "stepped along their gradients" not in str(error):
                    raise
                refused.append(window)
            opt.zero_grad()
        amp = getattr(fabric._precision, "amp", None)
        values = amp.fp32_state_dict(net) if amp is not None else net.state_dict()
        final = torch.cat([v.detach().float().flatten() for v in values.values()]).tolist()
        return {"refused": refused, "final": final}

    return fabric.launch(train)


CASES = tuple(os.environ.get("REVIEW67_CASES", "raw_rank0/O2,probe_rank0/O2").split(","))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CASES:
            kind, precision = name.split("/")
            with case_error(results.setdefault(name, {})) as result:
                result.update(case(kind, precision))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
