"""Run by tests/test_lightning_contract.py: ``strategy="ddp_spawn"`` with the plugin, two CPU processes (gloo).

Lightning pickles the Trainer, its precision plugin included, into each process it spawns. Each fit trains a
classifier with a per-step scheduler, an overflow injected on rank 0 only at step 2, and gradient clipping. Every
rank writes what it ended with to ``$MPX_OUT/{level}_rank{r}.json``; the main process writes the weights Lightning
brought back from rank 0 and those of the same training run in this process on one device (the same global
batches, each of them whole) to ``$MPX_OUT/{level}_main.json``.
"""

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_mpx import CastTable, MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

STEPS = 4
BATCH = 8  # per process


class RankZeroOverflow(Classifier):
    """An inf in rank 0's gradient at step 2 (after DDP's all-reduce): the ranks agree only if the plugin reduces the
    overflow flag. In a single-process run, the same step overflows there."""

    def on_after_backward(self) -> None:
        if self.global_rank == 0 and self.trainer.global_step == 2:
            self.net[0].weight.grad[0, 0] = float("inf")


class Report(pl.Callback):
    """Writes each rank's end state, then ends the process group (Lightning ends it at exit only for NCCL; a gloo
    group left alive can abort the interpreter at exit, pytorch/pytorch#190489)."""

    def __init__(self, out: str, level: str) -> None:
        self.out, self.level = out, level
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        result = {
            "plugin": type(plugin).__name__,
            "world_size": trainer.world_size,
            "skipped_steps": plugin.amp.skipped_steps,
            "scale": plugin.amp.scalers[0].get_scale(),
            "lrs": self.lrs,
            "table_has_outer": plugin.amp.policy is not None and torch.outer in plugin.amp.policy.table,
            "params": [p.detach().float().flatten().tolist() for p in pl_module.parameters()],
        }
        with open(os.path.join(self.out, f"{self.level}_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _plugin(level: str) -> MixedPrecisionPlugin:
    settings: dict[str, Any] = dict(init_scale=1024.0, growth_interval=1000)
    if level == "O1":
        # A user's own table travels with the plugin (pickled by name: F.max_pool2d and Tensor methods cannot be).
        table = CastTable.default()
        table.register(torch.outer, "half")
        settings["cast_table"] = table
    return MixedPrecisionPlugin(level, **{"half_dtype": "float16", **settings})


def _global_batches(dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
    """The samples in the order that makes batch k of 2 * BATCH hold what the two ranks' batch k hold together.

    Lightning gives each rank of a training run a shuffling ``DistributedSampler`` (seed ``PL_GLOBAL_SEED``, else
    0): the same sampler, asked for each rank's order, gives them."""
    seed = int(os.getenv("PL_GLOBAL_SEED", 0))
    ranks = [
        list(torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=seed))
        for r in (0, 1)
    ]
    order = [i for k in range(STEPS) for r in (0, 1) for i in ranks[r][k * BATCH : (k + 1) * BATCH]]
    return torch.utils.data.Subset(dataset, order)


def main() -> None:
    out = os.environ["MPX_OUT"]
    data = classification_data(n=2 * BATCH * STEPS)
    for level in os.environ.get("MPX_LEVELS", "O1").split(","):
        model = RankZeroOverflow(optimizer="sgd", lr=0.5, scheduler=True)
        trainer = make_trainer(
            _plugin(level),
            strategy="ddp_spawn",
            devices=2,
            max_epochs=1,
            gradient_clip_val=1.0,
            callbacks=[Report(out, level)],
        )
        trainer.fit(model, loader(data, batch_size=BATCH))
        brought_back = [p.detach().float().flatten().tolist() for p in model.parameters()]

        reference = RankZeroOverflow(optimizer="sgd", lr=0.5, scheduler=True)
        make_trainer(_plugin(level), max_epochs=1, gradient_clip_val=1.0).fit(
            reference, loader(_global_batches(data), batch_size=2 * BATCH)
        )
        result = {
            "main": brought_back,
            "reference": [p.detach().float().flatten().tolist() for p in reference.parameters()],
        }
        with open(os.path.join(out, f"{level}_main.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":  # the guard spawn needs: each process imports this file again
    main()
