"""Run by tests/test_fsdp_policies.py: ``shard_model`` at O2 (bfloat16) on two CPU processes (gloo), with torchrun's
environment (``tests/launch.py``'s ``run_script`` forks both ranks; run alone, the script starts them itself).

Each rank trains a 4-layer MLP (with batch norm, an FP32 island) for a few AdamW steps on its own data and writes to
``$MPX_OUT/rank{r}.json`` what it holds afterwards: the bytes of its parameter shards (and of the storages behind
them), the model's FP32 bytes before sharding, and every live full-size FP32 tensor (there should be none: FSDP's
sharded FP32 parameters are the master weights, the half compute copies are freed after each use).
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionSettings
from lightning_mpx.integrations.fsdp import check_sharded_model, shard_model
from tests.launch import end_ranks, launch_ranks

WIDTH, LAYERS, STEPS, WORLD = 256, 4, 5, 2


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)]
    for _ in range(LAYERS - 1):
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


def full_size_fp32() -> list[list[int]]:
    """Shapes of the live plain tensors with an FP32 storage at least as large as one full weight matrix."""
    limit = WIDTH * WIDTH * 4
    found = []
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.dtype == torch.float32:
            if obj.untyped_storage().nbytes() >= limit:
                found.append(list(obj.shape))
    return found


def worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo")
    settings = MixedPrecisionSettings.from_kwargs("O2", half_dtype="bfloat16")
    model = build()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = shard_model(model, settings, blocks=nn.Linear)
    check_sharded_model(model, settings)
    amp = Amp.from_settings(settings)
    compute = set()
    # A pre-hook: it runs after FSDP's (prepended) all-gather, before the post-forward hook reshards.
    model[-1].register_forward_pre_hook(lambda mod, args: compute.add(str(mod.weight.dtype)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)
    losses = []
    for _ in range(STEPS):
        with amp.forward_context():
            loss = F.mse_loss(model(x), y)
        loss.backward()
        grads = {str(p.grad.dtype) for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    del loss
    gc.collect()
    local = [p.to_local() for p in model.parameters()]
    result = {
        "model_fp32_bytes": model_bytes,
        "local_param_bytes": sum(t.numel() * t.element_size() for t in local),
        "local_storage_bytes": sum(t.untyped_storage().nbytes() for t in local),
        "full_size_fp32_tensors": full_size_fp32(),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted(grads),
        "compute_dtypes": sorted(compute),
        "losses": losses,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_ranks()  # a barrier, then no teardown (tests/launch.py)


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, WORLD)
    assert int(os.environ["WORLD_SIZE"]) == WORLD
    worker(int(os.environ["RANK"]), os.environ["MPX_OUT"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
