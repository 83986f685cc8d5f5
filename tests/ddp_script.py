"""Run by tests/test_lightning.py: two CPU processes under Lightning's DDP strategy, an overflow on rank 0 only.

``$MPX_SKIP_ON_DEVICE`` lists the runs, one after the other in the same two processes (``0``: the overflow flag read
on the host; ``1``: ``skip_on_device=True``). Each rank writes what it ended with to
``$MPX_OUT/skip{0|1}_rank{r}.json``; the test checks that both skipped the same step.
"""

import os
from typing import Any

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import end_ranks, write_rank_results
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer


class RankZeroOverflow(Classifier):
    def on_after_backward(self) -> None:
        # After DDP's all-reduce: only rank 0's gradient holds the inf, so the ranks agree only if the plugin
        # reduces the overflow flag.
        if self.global_rank == 0 and self.trainer.global_step == 2:
            self.net[0].weight.grad[0, 0] = float("inf")


def run(on_device: bool) -> None:
    # on_device: the flag reduced on the device and handed to a fused AdamW, read at the next batch
    plugin = MixedPrecisionPlugin(
        "O2", init_scale=1024.0, growth_interval=1000, skip_on_device=on_device, half_dtype="float16"
    )
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
    write_rank_results(result, f"skip{int(on_device)}_", trainer.global_rank)


def main() -> None:
    for mode in os.environ["MPX_SKIP_ON_DEVICE"].split(","):  # the first run's Trainer starts the second process
        run(mode == "1")
    end_ranks()  # Lightning leaves a gloo group to the interpreter's exit


if __name__ == "__main__":
    main()
