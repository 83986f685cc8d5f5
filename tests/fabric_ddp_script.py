"""Run by tests/test_fabric.py: ``Fabric(strategy="ddp", devices=2)`` with the plugin, two CPU processes (gloo).

Fabric's launcher starts the second process by running this script again. For each opt level in ``$MPX_LEVELS``
each rank (its own initial weights, before DDP makes them rank 0's) trains 4 optimizer steps of 2 accumulated
micro-batches (``fabric.no_backward_sync`` on the first), clipping, with a per-step schedule held on skipped steps;
an inf is written into rank 0's gradient only (after DDP's all-reduce) at step 2. Every rank writes what it ended
with to ``$MPX_OUT/{level}_rank{r}.json``.
"""

import json
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import end_ranks

STEPS = 4
ACCUMULATE = 2
INF_AT = 2


def run(level: str, half_dtype: str, out: str) -> None:
    # on_floor="continue": bfloat16's static scale of 1 is its floor, where an overflow raises by default.
    mpx = FabricMixedPrecisionPlugin(
        level, half_dtype=half_dtype, init_scale=1024.0, growth_interval=1000, on_floor="continue"
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    fabric.launch()  # the first level starts the second process; later ones find the process group running
    # Each rank initialises its own weights: DDP gives every rank rank 0's at setup, and O2's FP32 masters must
    # follow (else each rank would step from its own masters and the ranks would drift apart).
    torch.manual_seed(fabric.global_rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(1 + fabric.global_rank)  # each rank its own data
    record: dict = {"skipped": [], "lrs": [], "norms": []}
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                fabric.backward(F.cross_entropy(model(x), y) / ACCUMULATE)
        if step == INF_AT and fabric.global_rank == 0:
            model.module[0].weight.grad[0, 0] = float("inf")  # rank 0 only: the ranks agree only through the plugin
        record["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=1.0)))
        record["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        skipped = mpx.step_was_skipped(optimizer)
        record["skipped"].append(skipped)
        if not skipped:
            scheduler.step()
        optimizer.zero_grad()
    metrics = mpx.metrics()
    record.update(
        world_size=fabric.world_size,
        scale=metrics["mpx/loss_scale"],
        skipped_steps=metrics["mpx/skipped_steps"],
        params=[p.detach().float().flatten().tolist() for p in model.parameters()],
        masters=[p.detach().flatten().tolist() for p in mpx.amp.master_params(optimizer.optimizer)],
        param_dtype=str(next(model.parameters()).dtype),
    )
    with open(os.path.join(out, f"{level}_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    out = os.environ["MPX_OUT"]
    for case in os.environ.get("MPX_LEVELS", "O2:float16").split(","):
        level, half_dtype = case.split(":")
        run(level, half_dtype, out)
    end_ranks()  # Fabric leaves the gloo group to the interpreter's exit


if __name__ == "__main__":
    main()
