"""Run by tests/test_lightning.py: two CPU processes under Lightning's DDP strategy, an overflow on rank 0 only.

Each rank writes what it ended with to ``$MPX_OUT/rank{r}.json``; the test checks that both skipped the same step.
"""

import json
import os
from typing import Any

import torch

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer


class RankZeroOverflow(Classifier):
    def on_after_backward(self) -> None:
        # After DDP's all-reduce: only rank 0's gradient holds the inf, so the ranks agree only if the plugin
        # reduces the overflow flag.
        if self.global_rank == 0 and self.trainer.global_step == 2:
            self.net[0].weight.grad[0, 0] = float("inf")


def main() -> None:
    # MPX_SKIP_ON_DEVICE=1: the flag reduced on the device and handed to a fused AdamW, read at the next batch
    on_device = os.environ.get("MPX_SKIP_ON_DEVICE") == "1"
    plugin = MixedPrecisionPlugin("O2", init_scale=1024.0, growth_interval=1000, skip_on_device=on_device)
    model = RankZeroOverflow(optimizer="adamw_fused" if on_device else "sgd", lr=0.01 if on_device else 0.05)
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_epochs=1)
    trainer.fit(model, loader(classification_data(n=80), batch_size=8))  # 5 steps per rank
    result: dict[str, Any] = {
        "skipped_steps": plugin.amp.skipped_steps,
        "scale": plugin.amp.scalers[0].get_scale(),
        "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
        "steps_taken": trainer.global_step,
        "overflow_parameters": plugin.amp.last_overflow_parameters,
        "overflow_ranks": list(plugin.amp.last_overflow.ranks) if plugin.amp.last_overflow is not None else None,
    }
    out = os.environ["MPX_OUT"]
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    # Lightning destroys the process group at exit only for NCCL. A gloo group left alive can abort the interpreter
    # at exit ("terminate called without an active exception", pytorch/pytorch#190489), so end it here, as torch's
    # docs ask every training script to do.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
