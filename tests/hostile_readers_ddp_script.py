"""Run by tests/test_hostile_readers.py: two CPU processes under Lightning's DDP strategy with the docs/lightning.md
recipe (``MpxMetricsToCallbacks``), ``EarlyStopping(monitor="mpx/overflows")`` and
``ModelCheckpoint(monitor="mpx/loss_scale")``; overflows on rank 1 only, a fused AdamW (skipped on the device), the
metrics logged to TensorBoard by rank 0 only. Each rank writes what its callbacks saw per step to
``$MPX_OUT/rank{r}.json``."""

import json
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import end_ranks
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer
from tests.test_metric_readers import docs_recipe

OVERFLOW_STEPS = (2, 3, 6)  # on rank 1 only


class RankOneOverflow(Classifier):
    def on_after_backward(self) -> None:
        if self.global_rank == 1 and self.trainer.global_step in OVERFLOW_STEPS:
            self.net[0].weight.grad[0, 0] = float("inf")


class Seen(pl.Callback):
    """What ``trainer.callback_metrics`` holds after each step (after the recipe's callback)."""

    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        metrics = trainer.callback_metrics
        self.seen[trainer.global_step - 1] = [float(metrics["mpx/loss_scale"]), float(metrics["mpx/overflows"])]


def main() -> None:
    out = Path(os.environ["MPX_OUT"])
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=1024.0, growth_interval=3)
    seen = Seen()
    best = ModelCheckpoint(dirpath=str(out / "best"), monitor="mpx/loss_scale", mode="max", every_n_train_steps=1,
                           filename="{step}")
    stop = EarlyStopping(monitor="mpx/overflows", mode="min", patience=1000, check_on_train_epoch_end=True)
    logger = TensorBoardLogger(str(out), name="run", version=0)
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=8, logger=logger, log_every_n_steps=4,
                           enable_checkpointing=True, callbacks=[docs_recipe()(), seen, best, stop])
    trainer.fit(RankOneOverflow(optimizer="adamw_fused", lr=0.01), loader(classification_data(n=128), batch_size=8))
    result = {"seen": seen.seen, "best": float(best.best_model_score), "stopped": trainer.should_stop}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    end_ranks()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        from tests.launch import launch_ranks

        raise SystemExit(launch_ranks(__file__))
