"""Run by tests/test_core_fsdp2_device_skip.py: the Trainer with a fused AdamW under Lightning's FSDP strategies, two
CPU processes (gloo), against ``skip_on_device=False``. ``$MPX_CASES``: ``sched`` (ModelParallelStrategy, a StepLR
stepped every optimizer step, ``accumulate_grad_batches=2``, logging every step, an inf on rank 0 only),
``fsdp1`` (FSDPStrategy, nothing set: the host path) and ``fsdp1_true`` (``skip_on_device=True``: refused). Every
rank writes ``$MPX_OUT/{case}_rank{r}.json``; Lightning's launcher starts the second process. ``core/<case>`` runs a
case of tests/hostile_fsdp_script.py (the core engine) in the process group the Trainer cases before it started,
written to ``$MPX_OUT/core_<case>_rank{r}.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import end_ranks
from tests.lightning_fsdp_script import BATCH, Net, data, full_params, make_strategy
from tests.lightning_helpers import loader, make_trainer

#: The prefix of a case of the core engine's script (``core/<case>``: tests/hostile_fsdp_script.py).
CORE = "core/"


class Logged(Net):
    """The fused AdamW with a StepLR stepped every optimizer step; logs its loss and LR every step, and records
    what the logger got and the plugin's metrics after each batch."""

    def __init__(self) -> None:
        super().__init__(inf_at=(2,), lr=0.1)
        self.fused = True
        self.seen: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        metrics.update({k: float(v) for k, v in self.trainer.precision_plugin.metrics().items()})
        metrics["step_lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append(metrics)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(case: str, skip_on_device: bool | None) -> dict[str, Any]:
    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", init_scale=1024.0, growth_interval=2,
                                  on_floor="continue", skip_on_device=skip_on_device)  # fmt: skip
    model = Logged()
    strategy = make_strategy("fsdp1" if case.startswith("fsdp1") else "fsdp2")
    settings: dict[str, Any] = dict(strategy=strategy, devices=2, max_steps=4, log_every_n_steps=1)
    if case == "sched":
        settings["accumulate_grad_batches"] = 2
    trainer = make_trainer(plugin, **settings)
    try:
        trainer.fit(model, loader(data("train"), BATCH))
    except ValueError as error:
        return {"error": str(error)}
    return {
        "on_device": [bool(s.on_device) for s in plugin.amp._machine.optimizers.values()],
        "seen": model.seen,
        "skipped": plugin.amp.skipped_steps,
        "global_step": trainer.global_step,
        "scalers": repr(plugin.amp.state_dict()["scalers"]),
        "params": full_params(trainer, model),
    }


def main() -> None:
    out = os.environ["MPX_OUT"]
    for case in os.environ["MPX_CASES"].split(","):
        if case.startswith(CORE):
            # The core engine's cases (tests/hostile_fsdp_script.py) in the group the Trainer cases started: in this
            # launch rather than one of their own.
            from tests.hostile_fsdp_script import run_case

            if not dist.is_initialized():
                raise RuntimeError(f"case {case!r} needs a Trainer case before it (they start the process group)")
            record = run_case(case[len(CORE):], dist.get_rank(), dist.get_world_size())
            dist.barrier()
        elif case == "fsdp1_true":
            record = {"device": fit(case, True)}
        else:
            record = {"device": fit(case, None), "host": fit(case, False)}
        with open(os.path.join(out, f"{case.replace('/', '_')}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f, default=str)
    end_ranks()


if __name__ == "__main__":
    main()
