"""Ranks of tests/test_core_sam_ddp.py: SAM (the documented recipe, docs/master_weights.md "SAM and two-pass
optimizers") under the Trainer's manual optimization with ``strategy="ddp"``, two CPU processes (gloo), ONE launch for
every multi-rank check. Each rank writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the
case's ``"error"``. A short group timeout: a rank left in a collective by the other fails the case instead of hanging.

Cases ``{precision}/{variant}``: precision ``O2`` (bfloat16), ``bf16-mixed`` (Lightning's own), ``O1`` (float16,
dynamic scale), ``32-true``; variant ``sync`` (both passes all-reduce) or ``no_sync`` (the first pass under
``self.trainer.model.no_sync()``: each rank perturbs by its own gradient, only the second pass all-reduces).
``overflow/{variant}``: O1 float16, an inf in rank 1's batch in the first pass of the second step: both ranks skip it.
``davda54``: O2, davda54's own ``second_step`` (its base step called directly): both ranks refuse it at the call.
Each records the weights after every step and the final loss scale.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import case_error, finish_cases
from tests.test_core_sam import SAM, DoorSAM


class SamModule(pl.LightningModule):
    """The recipe under manual optimization; ``no_sync``: the first pass without DDP's all-reduce."""

    def __init__(self, no_sync: bool, inf_at: int | None = None, raw: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.no_sync, self.inf_at, self.raw = no_sync, inf_at, raw
        self.calls = 0
        self.seen: list[list[float]] = []

    def training_step(self, batch: Any, index: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        first = x
        if self.calls == self.inf_at and self.global_rank == 1:
            first = x.clone()
            first[0, 0] = float("inf")
        sync = self.trainer.model.no_sync() if self.no_sync else contextlib.nullcontext()
        with sync:
            self.manual_backward(F.mse_loss(self.net(first).squeeze(-1).float(), y))
        optimizer.first_step(zero_grad=True)
        self.manual_backward(F.mse_loss(self.net(x).squeeze(-1).float(), y))  # at the perturbed weights
        if self.raw:  # davda54's own second_step: restore, then base_optimizer.step() itself
            optimizer.second_step(zero_grad=True)
        else:
            optimizer.second_step()
            optimizer.step()
            optimizer.zero_grad()
        self.calls += 1
        self.seen.append(flat(self.net.parameters()))

    def configure_optimizers(self) -> Any:
        return (SAM if self.raw else DoorSAM)(self.net.parameters(), torch.optim.SGD, lr=0.1, rho=0.05)


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


def _fit(r: dict, precision: str, no_sync: bool, inf_at: int | None = None, raw: bool = False) -> None:
    kwargs: dict[str, Any] = {"precision": precision}
    if precision == "O2":
        kwargs = {"plugins": [MixedPrecisionPlugin("O2", half_dtype="bfloat16")]}
    elif precision == "O1":
        kwargs = {"plugins": [MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**8,
                                                   growth_interval=100)]}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1).tanh())
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=2, **kwargs,
    )  # fmt: skip
    module = SamModule(no_sync, inf_at, raw)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    r["w"] = module.seen
    amp = getattr(trainer.precision_plugin, "amp", None)
    r["scale"] = amp.scalers[0].get_scale() if amp is not None else None


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    for variant in ("sync", "no_sync"):
        for precision in ("O2", "bf16-mixed", "O1", "32-true"):
            with case_error(results.setdefault(f"{precision}/{variant}", {})) as r:
                _fit(r, precision, variant == "no_sync")
        with case_error(results.setdefault(f"overflow/{variant}", {})) as r:
            _fit(r, "O1", variant == "no_sync", inf_at=1)
    with case_error(results.setdefault("davda54", {})) as r:
        _fit(r, "O2", no_sync=False, raw=True)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
