"""Run by tests/test_accelerate.py under `accelerate launch` with two processes (not collected by pytest).

Each rank trains the same DDP model at O2 on its own shard of the data; at step 2 rank 0 alone puts an inf into a
gradient after the backward (after DDP's all-reduce), so only the reduced overflow flag can make rank 1 skip too.
Each rank writes what it saw to OUT_DIR/rank{r}.json and its final parameters to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
from tests.launch import end_ranks


def main(out_dir: Path) -> None:
    # float16's dynamic loss scale (a CPU's default half dtype is bfloat16, with a static scale)
    accelerator = Accelerator(
        mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")]
    )
    # Each rank starts from other weights: DDP broadcasts rank 0's when it wraps the model, and the FP32 masters must
    # follow, or the ranks drift apart from the first step on.
    torch.manual_seed(accelerator.process_index)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    inner = accelerator.unwrap_model(model)
    assert inner[0].weight.dtype == torch.float16, "converted before DDP wrapped it"
    skipped = []
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + accelerator.process_index)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        accelerator.backward(F.cross_entropy(model(x), y))
        if step == 2 and accelerator.process_index == 0:
            with torch.no_grad():
                inner[0].weight.grad[0, 0] = float("inf")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    rank = accelerator.process_index
    masters = [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]
    # Parameters only: DDP broadcasts batch-norm buffers before each forward, so after the last one they differ.
    params = {name: p.detach().clone() for name, p in inner.named_parameters()}
    torch.save({"model": params, "masters": masters}, out_dir / f"rank{rank}.pt")
    report = {
        "world_size": accelerator.num_processes,
        "skipped": skipped,
        "scale": accelerator.amp.scalers[0].get_scale(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.save_state(str(out_dir / "checkpoint"))
    # Not accelerator.end_training(): the gloo group's teardown at exit was seen to abort one rank ("terminate called
    # without an active exception") or hang it in a loaded full run; end_ranks waits for every rank and leaves.
    end_ranks()


if __name__ == "__main__":
    # A rank that hangs prints every thread's stack and exits before the test's timeout, so that the test's failure
    # shows where (the test prints the launch's stderr).
    faulthandler.dump_traceback_later(150, exit=True)
    main(Path(sys.argv[1]))
