"""Run by tests/test_hostile_readers.py: two CPU processes under Lightning's DDP strategy with the docs/lightning.md
recipe (``MpxMetricsToCallbacks``), ``EarlyStopping(monitor="mpx/overflows")`` and
``ModelCheckpoint(monitor="mpx/loss_scale")``; overflows on rank 1 only, a fused AdamW (skipped on the device), the
metrics logged to TensorBoard by rank 0 only. A first fit saves a checkpoint between two logs; a second resumes from
it. Each rank writes what its callbacks saw per step to ``$MPX_OUT/rank{r}.json``."""

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

OVERFLOW_STEPS = (2, 3, 6, 9)  # on rank 1 only


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


def fit(out: Path, max_steps: int, ckpt_path: str | None) -> tuple[Seen, ModelCheckpoint, EarlyStopping]:
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=1024.0, growth_interval=3)
    seen = Seen()
    best = ModelCheckpoint(dirpath=str(out / "best"), monitor="mpx/loss_scale", mode="max", every_n_train_steps=1,
                           filename="{step}")
    last = ModelCheckpoint(dirpath=str(out / "last"), save_last=True, every_n_train_steps=6)
    stop = EarlyStopping(monitor="mpx/overflows", mode="min", patience=1000, check_on_train_epoch_end=True)
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=max_steps, max_epochs=10,
                           logger=TensorBoardLogger(str(out), name="run", version=0), log_every_n_steps=4,
                           enable_checkpointing=True, callbacks=[docs_recipe()(), seen, best, last, stop])
    trainer.fit(RankOneOverflow(optimizer="adamw_fused", lr=0.01), loader(classification_data(n=128), batch_size=8),
                ckpt_path=ckpt_path)
    return seen, best, stop


def main() -> None:
    out = Path(os.environ["MPX_OUT"])
    first, best, _ = fit(out, 6, None)  # saved after step 5: step 6 is not logged yet ... nor are 4 and 5
    second, best2, stop = fit(out, 12, str(out / "last" / "last.ckpt"))
    rank = int(os.environ["RANK"])
    result = {"seen": {**first.seen, **second.seen}, "best": [float(best.best_model_score), float(best2.best_model_score)],
              "stop_best": float(stop.best_score)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_ranks()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        from tests.launch import launch_ranks

        raise SystemExit(launch_ranks(__file__))
