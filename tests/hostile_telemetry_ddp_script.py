"""Run by tests/test_hostile_telemetry.py: two CPU processes under Lightning's DDP strategy, overflows on rank 1 only,
metrics logged to TensorBoard by rank 0 only (Lightning's loggers write on rank zero), a fused AdamW (the overflow is
skipped on the device and read a batch later). The test reads ``$MPX_OUT/run/version_0`` back."""

import os

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import end_ranks
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

OVERFLOW_STEPS = (2, 3)  # on rank 1 only


class RankOneOverflow(Classifier):
    def on_after_backward(self) -> None:
        if self.global_rank == 1 and self.trainer.global_step in OVERFLOW_STEPS:
            self.net[0].weight.grad[0, 0] = float("inf")


def main() -> None:
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=1024.0, growth_interval=3)
    logger = TensorBoardLogger(os.environ["MPX_OUT"], name="run", version=0)
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=8, logger=logger, log_every_n_steps=1)
    trainer.fit(RankOneOverflow(optimizer="adamw_fused", lr=0.01), loader(classification_data(n=128), batch_size=8))
    end_ranks()  # Lightning leaves a gloo group to the interpreter's exit


if __name__ == "__main__":
    main()
