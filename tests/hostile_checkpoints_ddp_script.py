"""Run by tests/test_hostile_checkpoints.py: checkpoints across world sizes, two CPU processes (gloo), the core
``Amp`` under torch's ``DistributedDataParallel`` (``found_inf_reducer`` set), at O1 and O2 (bfloat16, a dynamic
scale so that an overflow halves it and counts a skipped step).

For each level:

1. 2 ranks to 1 process: a 2-rank run overflows on rank 1 at step 1 (both ranks skip), rank 0 saves after step 1
   (the model's state dict as DDP gives it, with ``module.``); rank 0 alone resumes it in one process on the whole
   batch (both ranks' halves) for steps 2 and 3. Reference: the 2-rank run continued.
2. 1 process to 2 ranks: each rank makes the same 1-process checkpoint (whole batches, the same overflow), the 2
   ranks resume it under DDP. Reference: the 1-process run continued.

Each rank writes what it saw to ``$MPX_OUT/rank{r}.json``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mpx import Amp
from tests.launch import end_ranks

OVERFLOW_STEP, SAVED_AFTER, STEPS = 1, 2, 4


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of step ``step``'s batch; ``None``: the whole batch (both halves)."""
    if rank is None:
        halves = [batch(step, r) for r in (0, 1)]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def make(level: str, seed: int, ddp: bool) -> tuple[Amp, nn.Module, nn.Module, torch.optim.Optimizer]:
    amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)
    inner = amp.prepare_model(net(seed))
    model = inner
    if ddp:
        amp.found_inf_reducer = lambda flag: dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        model = DistributedDataParallel(inner)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return amp, inner, model, optimizer


def train(amp: Amp, model: nn.Module, optimizer: Any, steps: range, rank: int | None) -> None:
    for step in steps:
        x, y = batch(step, rank)
        with amp.forward_context():
            out = amp.cast_outputs(model(amp.cast_inputs(x)))
        amp.backward(F.cross_entropy(out.float(), y))
        if step == OVERFLOW_STEP and rank in (1, None):
            next(model.parameters()).grad[0, 0] = float("inf")  # rank 1's gradient only: the reducer spreads it
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


def weights(amp: Amp, inner: nn.Module) -> list[list[float]]:
    return [amp.master_of(p).detach().float().flatten().tolist() for p in inner.parameters()]


def checkpoint(amp: Amp, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What a user saves (DDP's state dict, with ``module.``), through ``torch.save`` and ``weights_only`` loading."""
    buffer = io.BytesIO()
    torch.save({"amp": amp.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resume(level: str, saved: dict[str, Any], ddp: bool) -> tuple[Amp, nn.Module, nn.Module, Any, dict[str, Any]]:
    amp, inner, model, optimizer = make(level, seed=9, ddp=ddp)  # other weights: the checkpoint must replace them
    inner.load_state_dict({k.removeprefix("module."): v for k, v in saved["model"].items()})
    optimizer.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    masters = saved["amp"]["master_weights"]
    model_state = {k.removeprefix("module."): v for k, v in saved["model"].items()}
    seen = {
        # O2: the masters are the checkpoint's; O1 (no masters): the FP32 weights are the model's state dict's
        "masters_exact": all(
            torch.equal(amp.master_of(p), masters[0][name] if masters else model_state[name])
            for name, p in inner.named_parameters()
        ),
        "scale": amp.scalers[0].get_scale(),
        "skipped_steps": amp.state_dict()["skipped_steps"],
    }
    return amp, inner, model, optimizer, seen


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")  # only to start the 2 processes and the group
    fabric.launch()
    rank = fabric.global_rank
    record: dict[str, Any] = {}
    for level in ("O1", "O2"):
        # 1. 2 ranks -> 1 process
        amp, inner, model, optimizer = make(level, seed=0, ddp=True)
        train(amp, model, optimizer, range(SAVED_AFTER), rank)
        saved = checkpoint(amp, model, optimizer)
        record[f"{level}/ddp_saved"] = {"scale": saved["amp"]["scalers"][0]["scale"],
                                        "skipped_steps": saved["amp"]["skipped_steps"]}
        train(amp, model, optimizer, range(SAVED_AFTER, STEPS), rank)
        record[f"{level}/ddp_straight"] = weights(amp, inner)
        if rank == 0:  # one process, no collective
            amp1, inner1, model1, opt1, seen = resume(level, saved, ddp=False)
            train(amp1, model1, opt1, range(SAVED_AFTER, STEPS), None)
            record[f"{level}/to_one"] = {**seen, "weights": weights(amp1, inner1)}
        dist.barrier()
        # 2. 1 process -> 2 ranks (each rank makes the same 1-process checkpoint)
        amp1, inner1, model1, opt1 = make(level, seed=0, ddp=False)
        train(amp1, model1, opt1, range(SAVED_AFTER), None)
        saved = checkpoint(amp1, model1, opt1)
        record[f"{level}/one_saved"] = {"scale": saved["amp"]["scalers"][0]["scale"],
                                        "skipped_steps": saved["amp"]["skipped_steps"]}
        train(amp1, model1, opt1, range(SAVED_AFTER, STEPS), None)
        record[f"{level}/one_straight"] = weights(amp1, inner1)
        amp2, inner2, model2, opt2, seen = resume(level, saved, ddp=True)
        train(amp2, model2, opt2, range(SAVED_AFTER, STEPS), rank)
        record[f"{level}/to_two"] = {**seen, "weights": weights(amp2, inner2)}
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    end_ranks()


if __name__ == "__main__":
    main()
