"""Run by tests/test_forensics.py: two CPU processes under Lightning's DDP strategy; a NaN in the batch of rank 1
only, at global step 1, and a gradient explosion (finite forward) on rank 1 only at step 3. Each rank writes its
overflow records and its overflow log lines to ``$MPX_OUT/rank{r}.json``.
"""

import dataclasses
import logging
from typing import Any

from lightning_mpx import MixedPrecisionPlugin
from tests.forensics_models import ForensicsData, ForensicsModule
from tests.launch import end_ranks, write_rank_results
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
    plugin = MixedPrecisionPlugin("O1", diagnose_overflows=True, overflow_log_interval=0.0, half_dtype="float16")
    model = ForensicsModule("gradient", nan_at=(1, 1), only_at=(3, 1))
    trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=5)
    trainer.fit(model, loader(ForensicsData("gradient", n=40), batch_size=4))
    records = {r.step: r for r in model.records if r is not None}  # the last record, as seen after each step
    result: dict[str, Any] = {
        "skipped_steps": plugin.amp.skipped_steps,
        "records": [dict(dataclasses.asdict(r), culprits=r.culprits()) for _, r in sorted(records.items())],
        "messages": handler.messages,
    }
    write_rank_results(result, rank=trainer.global_rank)
    end_ranks()  # Lightning leaves a gloo group to the interpreter's exit


if __name__ == "__main__":
    main()
