"""Run by tests/test_core_doctor_run_points.py: two gloo ranks under the Trainer's DDP, float16, rank 1's batch alone
overflowing (a NaN in its forward at step 1, a gradient explosion with a finite forward at step 3), a logger on rank 0
only (``logger=False`` on rank 1, as a user who builds it under ``rank == 0`` does), every step logged, skipping on the
device (fused AdamW, ``skip_on_device=True``: the outcome read lazily, on rank 0 alone by its logger). Each rank
writes what it logged and its facts to ``$MPX_OUT/rank{r}.json``."""

import os
from typing import Any

import torch

from lightning_mpx import MixedPrecisionPlugin
from tests.forensics_models import ForensicsData, ForensicsModule
from tests.launch import end_ranks, write_rank_results
from tests.lightning_helpers import RecordingLogger, loader, make_trainer


class FusedAdamW(ForensicsModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for case, module, device in (("device", FusedAdamW, True),):  # the host read: tests/test_forensics_ddp.py
        plugin = MixedPrecisionPlugin("O1", half_dtype="float16", diagnose_overflows=True, skip_on_device=device)
        logger = RecordingLogger() if rank == 0 else False
        model = module("gradient", nan_at=(1, 1), only_at=(3, 1))
        trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=5, log_every_n_steps=1, logger=logger)
        trainer.fit(model, loader(ForensicsData("gradient", n=40), batch_size=4))
        optimizer = trainer.optimizers[0]
        steps = {int(s["step"]) for s in optimizer.state.values()}
        kept = logger.logged if logger else []
        logged = [(step, {k: v for k, v in m.items() if k.startswith("mpx/")}) for step, m in kept]
        results[case] = {
            "skipped_steps": plugin.amp.skipped_steps,
            "optimizer_steps": sorted(steps),
            "logged": logged,
            "weights_equal_finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
            "grad_kinds": model.grad_kinds,  # the reference: each backward's (synchronised) non-finite gradients
        }
    write_rank_results(results, rank=rank)
    end_ranks()


if __name__ == "__main__":
    main()
