"""Ranks of tests/test_accelerate_lean_checkpoints.py: the Accelerate adapter's lean O2 checkpoints on two CPU processes
(gloo), ONE launch for every multi-rank check. Each rank writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its
traceback in the case's ``"error"``.

* ``ddp``: O2 float16 (dynamic scale) under DDP; rank 1 alone gets an inf gradient at step 1, the step before
  ``save_state`` (with ``register_for_checkpointing`` of a counter); the run goes on for steps 2-3 (``straight``); a
  fresh accelerator on both ranks (``save_on_each_node=True``) loads it and continues; it saves again.
  The test loads the first checkpoint in ONE process (another world size).
* ``fsdp2``: O2 bfloat16 under Accelerate's FSDP2 (sharded engine): the engine file keeps its masters, and a fresh
  accelerator resumes to the same weights.
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


def batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of step ``step``'s batch; ``None``: both halves."""
    if rank is None:
        halves = [batch(step, r) for r in (0, 1)]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


class Counter:
    """An object registered for checkpointing beside the models."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def train(
    acc: Any,
    model: Any,
    optimizer: Any,
    steps: range,
    rank: int | None,
    counter: Counter | None = None,
    poison: bool = True,
) -> None:
    for step in steps:
        x, y = batch(step, rank)
        acc.backward(F.cross_entropy(model(x).float(), y))
        if poison and step == INF_AT and rank == 1:
            next(acc.unwrap_model(model).parameters()).grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        if counter is not None:
            counter.n += 1


def masters(acc: Any, model: Any) -> list[list[float]]:
    return [acc.amp.master_of(p).detach().float().flatten().tolist() for p in acc.unwrap_model(model).parameters()]


def ddp_accelerator(**extra: Any) -> Any:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    return Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(**FP16)], **extra)


def ddp_case(r: dict[str, Any], out: str) -> None:
    rank = dist.get_rank()
    acc = ddp_accelerator()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    module = net(0)
    model, optimizer = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    train(acc, model, optimizer, range(SAVE_AFTER), rank, counter)
    path = os.path.join(out, "ddp_ckpt")
    acc.save_state(path)
    dist.barrier()
    r["saved"] = masters(acc, model)
    r["saved_scale"] = acc.amp.scalers[0].get_scale()
    r["saved_skipped"] = list(acc.amp.skipped_steps)
    if rank == 0:
        engine = torch.load(os.path.join(path, "lightning_mpx_amp.bin"), weights_only=True)
        r["named"] = engine.get("masters_in_state_dict")
        r["held"] = [sorted(m) for m in engine["master_weights"]]
        r["files"] = sorted(os.listdir(path))
    train(acc, model, optimizer, range(SAVE_AFTER, STEPS), rank)
    r["straight"] = masters(acc, model)

    from accelerate.utils import ProjectConfiguration

    fresh = ddp_accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    counter2 = Counter()
    fresh.register_for_checkpointing(counter2)
    module2 = net(7)
    model2, optimizer2 = fresh.prepare(module2, torch.optim.AdamW(module2.parameters(), lr=1e-2))
    fresh.load_state(path)
    r["loaded"] = masters(fresh, model2)
    r["loaded_scale"] = fresh.amp.scalers[0].get_scale()
    r["loaded_skipped"] = list(fresh.amp.skipped_steps)
    r["counter"] = counter2.n
    train(fresh, model2, optimizer2, range(SAVE_AFTER, STEPS), rank)
    r["resumed"] = masters(fresh, model2)
    again = os.path.join(out, "ddp_ckpt_each_node")
    fresh.save_state(again)
    dist.barrier()
    r["again_files"] = sorted(os.listdir(again))


def fsdp2_case(r: dict[str, Any], out: str) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    def make() -> Any:
        reset_accelerate_state()
        PartialState(cpu=True)
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        PartialState._shared_state["device"] = torch.device("cpu")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        kwargs = [MixedPrecisionKwargs(half_dtype="bfloat16")]
        return Accelerator(mixed_precision="O2", fsdp_plugin=plugin, cpu=True, kwargs_handlers=kwargs)

    def full(model: Any) -> list[list[float]]:
        return [p.full_tensor().float().flatten().tolist() for p in model.parameters()]

    rank = dist.get_rank()
    acc = make()
    module = net(0)
    model, optimizer = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    train(acc, model, optimizer, range(2), rank, poison=False)
    path = os.path.join(out, "fsdp_ckpt")
    acc.save_state(path)
    dist.barrier()
    engine = torch.load(os.path.join(path, "lightning_mpx_amp.bin"), weights_only=True)
    r["named"] = engine.get("masters_in_state_dict")
    r["held_count"] = sum(len(m) for m in engine["master_weights"])
    train(acc, model, optimizer, range(2, 4), rank)
    r["straight"] = full(model)
    fresh = make()
    module2 = net(7)
    model2, optimizer2 = fresh.prepare(module2, torch.optim.AdamW(module2.parameters(), lr=1e-2))
    fresh.load_state(path)
    train(fresh, model2, optimizer2, range(2, 4), rank)
    r["resumed"] = full(model2)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    out = os.environ["MPX_OUT"]
    results: dict[str, Any] = {"world": dist.get_world_size()}
    with case_error(results.setdefault("ddp", {})) as r:
        ddp_case(r, out)
    with case_error(results.setdefault("fsdp2", {})) as r:
        fsdp2_case(r, out)
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
