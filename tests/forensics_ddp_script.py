"""Run by tests/test_forensics.py: two CPU processes under Lightning's DDP strategy; a NaN in the batch of rank 1
only, at global step 1. Each rank writes its overflow record and its overflow log lines to ``$MPX_OUT/rank{r}.json``.
"""

import dataclasses
import json
import logging
import os
from typing import Any

import torch

from lightning_mpx import MixedPrecisionPlugin
from tests.forensics_models import ForensicsData, ForensicsModule
from tests.lightning_helpers import loader, make_trainer


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Gradient overflow" in record.getMessage():
            self.messages.append(record.getMessage())


def main() -> None:
    handler = _Messages()
    mpx_log = logging.getLogger("lightning_mpx")
    mpx_log.addHandler(handler)
    mpx_log.setLevel(logging.INFO)
    plugin = MixedPrecisionPlugin("O1", diagnose_overflows=True)
    model = ForensicsModule("clean", nan_on_rank=1, nan_at_step=1)
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=3)
    trainer.fit(model, loader(ForensicsData("clean", n=32), batch_size=4))
    record = plugin.amp.last_overflow
    result: dict[str, Any] = {
        "skipped_steps": plugin.amp.skipped_steps,
        "record": dataclasses.asdict(record) if record is not None else None,
        "messages": handler.messages,
    }
    if record is not None:
        result["record"]["culprits"] = record.culprits()
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    # Lightning destroys the process group at exit only for NCCL. A gloo group left alive can abort the interpreter
    # at exit ("terminate called without an active exception", pytorch/pytorch#190489), so end it here.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
