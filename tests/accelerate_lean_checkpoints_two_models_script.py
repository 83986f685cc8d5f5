"""Ranks of tests/test_accelerate_lean_checkpoints_two_models.py: the Accelerate adapter's lean O2 ``save_state`` of TWO
models and two optimizers prepared in one accelerator, under DDP on two CPU processes (gloo), ONE launch. Each rank
writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

O2 float16 (dynamic scale); rank 1 alone gets an inf gradient in the second model at step 1, the step before
``save_state``: both ranks skip it. The run goes on for steps 2-3 (``straight``); a fresh accelerator with other
weights loads the folder on both ranks and continues (``resumed``).
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, write_rank_results

FP16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8}
INF_AT, SAVE_AFTER, STEPS = 1, 2, 4


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def prepared(seed: int) -> tuple[Any, ...]:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    acc = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(**FP16)])
    a, b = net(seed), net(seed + 1)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    return (acc, *acc.prepare(a, opt_a, b, opt_b))


def train(acc: Any, a: Any, opt_a: Any, b: Any, opt_b: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, rank)
        acc.backward(F.cross_entropy(a(x).float(), y) + F.cross_entropy(b(x * 2).float(), y))
        if step == INF_AT and rank == 1:
            next(acc.unwrap_model(b).parameters()).grad[0, 0] = float("inf")
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()


def masters(acc: Any, *models: Any) -> list[list[float]]:
    return [acc.amp.master_of(p).detach().flatten().tolist() for m in models for p in acc.unwrap_model(m).parameters()]


def two_models_case(r: dict[str, Any], out: str) -> None:
    rank = dist.get_rank()
    acc, a, opt_a, b, opt_b = prepared(0)
    train(acc, a, opt_a, b, opt_b, range(SAVE_AFTER), rank)
    path = os.path.join(out, "two_models")
    acc.save_state(path)
    dist.barrier()
    r["saved_skipped"] = list(acc.amp.skipped_steps)
    if rank == 0:
        engine = torch.load(os.path.join(path, "lightning_mpx_amp.bin"), weights_only=True)
        r["named"] = engine.get("masters_in_state_dict")
        r["held"] = [sorted(m) for m in engine["master_weights"]]
    train(acc, a, opt_a, b, opt_b, range(SAVE_AFTER, STEPS), rank)
    r["straight"] = masters(acc, a, b)
    fresh, a2, opt_a2, b2, opt_b2 = prepared(7)
    fresh.load_state(path)
    r["loaded_skipped"] = list(fresh.amp.skipped_steps)
    train(fresh, a2, opt_a2, b2, opt_b2, range(SAVE_AFTER, STEPS), rank)
    r["resumed"] = masters(fresh, a2, b2)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    results: dict[str, Any] = {"world": dist.get_world_size()}
    with case_error(results.setdefault("two_models", {})) as r:
        two_models_case(r, os.environ["MPX_OUT"])
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
