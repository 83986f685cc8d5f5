"""Run by tests/test_forensics.py: two CPU processes under Lightning's DDP strategy; a NaN in the batch of rank 1
only, at global step 1, and a gradient explosion (finite forward) on rank 1 only at step 3. Each rank writes its
overflow records and its overflow log lines to ``$MPX_OUT/rank{r}.json``.
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
    # Rank 1 only: a NaN in the batch at step 1 (forward), a gradient explosion with a finite forward at step 3.
    plugin = MixedPrecisionPlugin("O1", diagnose_overflows=True, overflow_log_interval=0.0)
    model = ForensicsModule("gradient", nan_at=(1, 1), only_at=(3, 1))
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=5)
    trainer.fit(model, loader(ForensicsData("gradient", n=40), batch_size=4))
    records = {r.step: r for r in model.records if r is not None}  # the last record, as seen after each step
    result: dict[str, Any] = {
        "skipped_steps": plugin.amp.skipped_steps,
        "records": [dict(dataclasses.asdict(r), culprits=r.culprits()) for _, r in sorted(records.items())],
        "messages": handler.messages,
    }
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    # Lightning destroys the process group at exit only for NCCL. A gloo group left alive can abort the interpreter
    # at exit ("terminate called without an active exception", pytorch/pytorch#190489), so end it here.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
