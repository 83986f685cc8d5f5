"""Attack C: Fabric DDP 2 gloo procs, O1 bf16 static scale, on_floor='raise' default, overflow on rank 0 only at
step OVER, rank-0-only reads (HABIT env: skipped | metrics | bool | none). SKIP env: 0/1."""
import os, sys, json
import torch, torch.nn.functional as F
from torch import nn
from lightning.fabric import Fabric
from lightning_mpx import FabricMixedPrecisionPlugin
from lightning_mpx.loss_scaler import LossScaleFloorError

SKIP = os.environ.get("SKIP", "1") == "1"
HABIT = os.environ.get("HABIT", "skipped")
OVER = int(os.environ.get("OVER", "2"))
STEPS = int(os.environ.get("STEPS", "5"))

mpx = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16", skip_on_device=SKIP)
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
fabric.launch()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
model, opt = fabric.setup(model, opt)
rank = fabric.global_rank
where = "none"
try:
    for step in range(STEPS):
        where = f"step {step} forward/backward"
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        out = model(x)
        fabric.backward(F.cross_entropy(out, y))
        if rank == 0 and step == OVER:
            model.module[0].weight.grad[0, 0] = float("inf")
        where = f"step {step} optimizer.step"
        outcome = opt.step()
        where = f"step {step} rank0 read"
        if fabric.is_global_zero:
            if HABIT == "skipped":
                mpx.step_was_skipped(opt)
            elif HABIT == "metrics":
                fabric.log_dict(mpx.metrics())
                mpx.metrics()
            elif HABIT == "bool":
                bool(outcome)
        opt.zero_grad()
    where = "after loop settle"
    mpx.amp.settle_step_outcomes()
    where = "teardown"
    print(f"[rank {rank}] finished without raising", file=sys.stderr, flush=True)
except LossScaleFloorError as e:
    print(f"[rank {rank}] LossScaleFloorError at {where}", file=sys.stderr, flush=True)
    sys.exit(3)
